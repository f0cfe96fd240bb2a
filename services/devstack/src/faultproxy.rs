//! A small userspace TCP proxy in front of one peer, for faults the kernel here cannot make
//! (there is no tc netem): latency added per direction and changeable at run time, a blackhole
//! (connections are accepted and read, nothing is forwarded, nothing is answered) and resets
//! (every connection, open or new, is closed with an RST).
//!
//! It can also wait for one request and strike right after it ([`FaultProxy::after_request`]):
//! the request (a chunk sent upstream containing a given pattern) goes through untouched, and
//! then its answer is stalled or cut. That is the fault where a write reached the peer and was
//! applied but its sender never heard so.
//!
//! It runs on its own thread with its own runtime, so it keeps time however busy the caller's
//! runtime is, and it can be used from synchronous and asynchronous code alike.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use dlock_devstack::faultproxy::{Direction, FaultProxy, Mode};
//! let proxy = FaultProxy::start("127.0.0.1:0".parse()?, "127.0.0.1:5432".parse()?)?;
//! proxy.set_latency(Direction::Downstream, std::time::Duration::from_millis(900));
//! proxy.set_mode(Mode::Blackhole);
//! proxy.set_mode(Mode::Forward);
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward, after the configured latency.
    Forward,
    /// Accept and read, never forward, never answer: the peer seems to hang.
    Blackhole,
    /// Reset every open connection and every new one.
    Reset,
}

/// What happens once the request [`FaultProxy::after_request`] waits for has gone through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterMatch {
    /// The connection that carried the request: the next answer the peer sends on it is held
    /// back this long, and what follows waits behind it (answers keep their order). Answers
    /// read once the stall is over pass as before.
    StallAnswer(Duration),
    /// The connection that carried the request: the next answer the peer sends on it is
    /// swallowed, and the connection is reset both ways. The peer has answered, so it has
    /// handled the request; its sender hears a broken connection instead.
    CutAnswer,
}

/// An armed [`FaultProxy::after_request`].
struct Trigger {
    pattern: Vec<u8>,
    skip: usize,
    then: AfterMatch,
}

/// Per connection: whether its next answer is to be cut (and the signal that it was) or stalled.
#[derive(Default)]
struct Cut {
    armed: AtomicBool,
    done: tokio::sync::Notify,
    stall_us: AtomicU64,
}

/// A direction of traffic through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the client to the peer (requests).
    Upstream,
    /// From the peer back to the client (answers).
    Downstream,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicUsize,
    reset: AtomicUsize,
    blackholed_bytes: AtomicU64,
    forwarded_bytes: AtomicU64,
}

struct Shared {
    upstream: SocketAddr,
    latency_up_us: AtomicU64,
    latency_down_us: AtomicU64,
    mode: watch::Sender<Mode>,
    counters: Counters,
    trigger: Mutex<Option<Trigger>>,
    fired: AtomicUsize,
}

impl Shared {
    /// Called with each chunk going upstream: fires the armed trigger when the chunk has its
    /// pattern (after `skip` earlier matches), before the chunk is forwarded.
    fn watch(&self, chunk: &[u8], cut: &Cut) {
        let mut trigger = self.trigger.lock().unwrap_or_else(|e| e.into_inner());
        let Some(armed) = trigger.as_mut() else {
            return;
        };
        let pattern = armed.pattern.as_slice();
        if pattern.is_empty() || !chunk.windows(pattern.len()).any(|w| w == pattern) {
            return;
        }
        if armed.skip > 0 {
            armed.skip -= 1;
            return;
        }
        let then = armed.then;
        *trigger = None;
        match then {
            AfterMatch::StallAnswer(stall) => {
                let us = stall.as_micros().min(u64::MAX as u128) as u64;
                cut.stall_us.store(us, Ordering::SeqCst);
            }
            AfterMatch::CutAnswer => cut.armed.store(true, Ordering::SeqCst),
        }
        self.fired.fetch_add(1, Ordering::SeqCst);
    }

    fn latency(&self, direction: Direction) -> Duration {
        Duration::from_micros(match direction {
            Direction::Upstream => self.latency_up_us.load(Ordering::SeqCst),
            Direction::Downstream => self.latency_down_us.load(Ordering::SeqCst),
        })
    }
}

/// What the proxy has seen so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub accepted: usize,
    pub reset: usize,
    pub blackholed_bytes: u64,
    pub forwarded_bytes: u64,
}

/// A running proxy; stopped (its listener and every connection closed) on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and forwards to `upstream`.
    pub fn start(listen: SocketAddr, upstream: SocketAddr) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building the fault proxy's runtime")?;
        // Bound here, outside any runtime, so that start works from async code too.
        let listener = std::net::TcpListener::bind(listen)
            .with_context(|| format!("fault proxy: binding {listen}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(Mode::Forward);
        let shared = Arc::new(Shared {
            upstream,
            latency_up_us: AtomicU64::new(0),
            latency_down_us: AtomicU64::new(0),
            mode,
            counters: Counters::default(),
            trigger: Mutex::new(None),
            fired: AtomicUsize::new(0),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("faultproxy-{}", addr.port()))
            .spawn({
                let shared = shared.clone();
                move || {
                    runtime.block_on(async move {
                        let Ok(listener) = TcpListener::from_std(listener) else {
                            return;
                        };
                        tokio::select! {
                            () = accept_loop(listener, shared) => {},
                            _ = stopped => {},
                        }
                    });
                    // Dropping the runtime cancels every connection task.
                }
            })
            .context("spawning the fault proxy's thread")?;
        Ok(Self {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Adds `latency` to every chunk in `direction` from now on (chunks keep their order).
    pub fn set_latency(&self, direction: Direction, latency: Duration) {
        let us = latency.as_micros().min(u64::MAX as u128) as u64;
        match direction {
            Direction::Upstream => self.shared.latency_up_us.store(us, Ordering::SeqCst),
            Direction::Downstream => self.shared.latency_down_us.store(us, Ordering::SeqCst),
        }
    }

    pub fn latency(&self, direction: Direction) -> Duration {
        self.shared.latency(direction)
    }

    /// Switches the mode for open connections and new ones alike.
    pub fn set_mode(&self, mode: Mode) {
        self.shared.mode.send_replace(mode);
    }

    pub fn mode(&self) -> Mode {
        *self.shared.mode.borrow()
    }

    /// Waits for one request: the `skip + 1`-th chunk sent upstream (on any connection) that
    /// contains `pattern` is forwarded as usual, and then `then` happens. One shot: it is
    /// disarmed once it fires; arming again replaces a trigger that has not fired.
    pub fn after_request(&self, pattern: &[u8], skip: usize, then: AfterMatch) {
        *self
            .shared
            .trigger
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Trigger {
            pattern: pattern.to_vec(),
            skip,
            then,
        });
    }

    /// How many triggers of [`FaultProxy::after_request`] have fired.
    pub fn fired(&self) -> usize {
        self.shared.fired.load(Ordering::SeqCst)
    }

    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            accepted: c.accepted.load(Ordering::SeqCst),
            reset: c.reset.load(Ordering::SeqCst),
            blackholed_bytes: c.blackholed_bytes.load(Ordering::SeqCst),
            forwarded_bytes: c.forwarded_bytes.load(Ordering::SeqCst),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        shared.counters.accepted.fetch_add(1, Ordering::SeqCst);
        let _ = client.set_nodelay(true);
        tokio::spawn(connection(client, shared.clone()));
    }
}

fn reset(stream: &TcpStream, shared: &Shared) {
    // SO_LINGER 0: the close that follows sends an RST instead of a FIN.
    let _ = stream.set_zero_linger();
    shared.counters.reset.fetch_add(1, Ordering::SeqCst);
}

/// Resolves when the mode becomes Reset (or the proxy stops).
async fn reset_signal(mut mode: watch::Receiver<Mode>) {
    loop {
        if *mode.borrow_and_update() == Mode::Reset {
            return;
        }
        if mode.changed().await.is_err() {
            return;
        }
    }
}

async fn connection(mut client: TcpStream, shared: Arc<Shared>) {
    let mode = shared.mode.subscribe();
    let current = *mode.borrow();
    match current {
        Mode::Reset => return reset(&client, &shared),
        Mode::Blackhole => {
            // A blackholed connection stays one: it never reaches the peer.
            let mut buf = vec![0u8; 16 * 1024];
            let swallow = async {
                loop {
                    match client.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => {
                            shared
                                .counters
                                .blackholed_bytes
                                .fetch_add(n as u64, Ordering::SeqCst);
                        }
                    }
                }
            };
            let reset_now = tokio::select! {
                closed = swallow => closed,
                () = reset_signal(mode) => true,
            };
            if reset_now {
                reset(&client, &shared);
            }
            return;
        }
        Mode::Forward => {}
    }
    let upstream = match TcpStream::connect(shared.upstream).await {
        Ok(s) => s,
        Err(_) => return reset(&client, &shared),
    };
    let _ = upstream.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut upstream_read, mut upstream_write) = upstream.into_split();
    let cut = Cut::default();
    let both = async {
        tokio::join!(
            pipe(
                &mut client_read,
                &mut upstream_write,
                &shared,
                Direction::Upstream,
                &cut,
            ),
            pipe(
                &mut upstream_read,
                &mut client_write,
                &shared,
                Direction::Downstream,
                &cut,
            ),
        )
    };
    let reset_now = tokio::select! {
        _ = both => false,
        () = reset_signal(mode) => true,
        () = cut.done.notified() => true,
    };
    if reset_now {
        reset(client_read.as_ref(), &shared);
        reset(upstream_read.as_ref(), &shared);
    }
}

/// Copies one direction: each chunk is stamped when read and written `latency` later, in order.
/// In blackhole mode chunks are read and dropped. Upstream chunks are shown to the armed
/// trigger; downstream, a connection whose answer is to be cut drops its next chunk and signals
/// `cut.done`.
async fn pipe(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    shared: &Shared,
    direction: Direction,
    cut: &Cut,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mode = *shared.mode.borrow();
                    if direction == Direction::Downstream && cut.armed.load(Ordering::SeqCst) {
                        shared
                            .counters
                            .blackholed_bytes
                            .fetch_add(n as u64, Ordering::SeqCst);
                        cut.done.notify_one();
                        break;
                    }
                    if mode == Mode::Forward {
                        if direction == Direction::Upstream {
                            shared.watch(&buf[..n], cut);
                        }
                        let mut due = Instant::now() + shared.latency(direction);
                        if direction == Direction::Downstream {
                            due += Duration::from_micros(cut.stall_us.swap(0, Ordering::SeqCst));
                        }
                        if tx.send((due, buf[..n].to_vec())).is_err() {
                            break;
                        }
                    } else {
                        shared
                            .counters
                            .blackholed_bytes
                            .fetch_add(n as u64, Ordering::SeqCst);
                    }
                }
            }
        }
        drop(tx);
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            shared
                .counters
                .forwarded_bytes
                .fetch_add(chunk.len() as u64, Ordering::SeqCst);
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(addr: SocketAddr) -> std::io::Result<Duration> {
        let mut s = TcpStream::connect(addr).await?;
        let started = std::time::Instant::now();
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        Ok(started.elapsed())
    }

    fn proxy(upstream: SocketAddr) -> FaultProxy {
        FaultProxy::start(
            "127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")),
            upstream,
        )
        .unwrap_or_else(|e| panic!("{e:#}"))
    }

    #[tokio::test]
    async fn forwards_and_adds_latency_per_direction() {
        let proxy = proxy(echo().await);
        let fast = round_trip(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(fast < Duration::from_millis(150), "{fast:?}");
        proxy.set_latency(Direction::Upstream, Duration::from_millis(100));
        proxy.set_latency(Direction::Downstream, Duration::from_millis(200));
        let slow = round_trip(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(slow >= Duration::from_millis(300), "{slow:?}");
        assert!(proxy.stats().forwarded_bytes >= 16);
    }

    /// Sends `message` on `s` and reads its echo.
    async fn echo_on(s: &mut TcpStream, message: &[u8]) -> std::io::Result<()> {
        s.write_all(message).await?;
        let mut buf = vec![0u8; message.len()];
        s.read_exact(&mut buf).await?;
        assert_eq!(buf, message);
        Ok(())
    }

    #[tokio::test]
    async fn after_a_matching_request_its_answer_is_cut_or_stalled() {
        let proxy = proxy(echo().await);
        proxy.after_request(b"write", 1, AfterMatch::CutAnswer);
        let mut s = TcpStream::connect(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // Positive control: other requests, and the first match (skipped), are answered.
        echo_on(&mut s, b"read-1")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        echo_on(&mut s, b"write-1")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(proxy.fired(), 0);
        let cut = tokio::time::timeout(Duration::from_secs(2), echo_on(&mut s, b"write-2"))
            .await
            .unwrap_or_else(|e| panic!("the cut connection hung: {e}"));
        assert!(cut.is_err(), "the answer to the matching request was cut");
        assert_eq!(proxy.fired(), 1);
        // One shot: a new connection is served again.
        round_trip(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("after the cut: {e}"));

        proxy.after_request(
            b"slow",
            0,
            AfterMatch::StallAnswer(Duration::from_millis(300)),
        );
        let mut s = TcpStream::connect(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let fast = std::time::Instant::now();
        echo_on(&mut s, b"quick")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(fast.elapsed() < Duration::from_millis(150));
        let slow = std::time::Instant::now();
        echo_on(&mut s, b"slow")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            slow.elapsed() >= Duration::from_millis(300),
            "{:?}",
            slow.elapsed()
        );
        assert_eq!(proxy.fired(), 2);
        // Only that answer was stalled.
        let after = std::time::Instant::now();
        echo_on(&mut s, b"quick")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(after.elapsed() < Duration::from_millis(150));
    }

    #[tokio::test]
    async fn a_blackhole_swallows_and_a_reset_resets() {
        let proxy = proxy(echo().await);
        proxy.set_mode(Mode::Blackhole);
        let hung = tokio::time::timeout(Duration::from_millis(300), round_trip(proxy.addr())).await;
        assert!(hung.is_err(), "a blackhole never answers: {hung:?}");
        assert!(proxy.stats().blackholed_bytes >= 4);
        // An open connection is reset when the mode switches.
        let mut open = TcpStream::connect(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        proxy.set_mode(Mode::Reset);
        let mut buf = [0u8; 4];
        let read = tokio::time::timeout(Duration::from_secs(2), open.read(&mut buf))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            read.map_err(|e| e.kind()).err(),
            Some(std::io::ErrorKind::ConnectionReset)
        );
        let refused = round_trip(proxy.addr()).await;
        assert!(refused.is_err(), "new connections are reset");
        proxy.set_mode(Mode::Forward);
        round_trip(proxy.addr())
            .await
            .unwrap_or_else(|e| panic!("forwarding again: {e}"));
    }
}
