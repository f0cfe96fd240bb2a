//! A PostgreSQL primary with a streaming-replication standby, for failover tests: the standby is
//! a `pg_basebackup -R` of the primary on a physical replication slot, synchronous
//! (`synchronous_standby_names`, what a managed HA database gives) or asynchronous (a
//! cross-region read replica). The pair can kill its primary outright, promote its standby, pause
//! the standby's replay or cut it off from the primary (so that the primary acknowledges writes
//! the standby never receives).
//!
//! Services reach the pair by a multi-host URL ([`PgPair::url`]) and follow a promotion on their
//! own (services/server/src/pg.rs).

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::*;

/// How the primary waits for its standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names = '*'`: a commit is acknowledged once the standby has flushed
    /// its WAL, so a promotion loses no acknowledged write.
    Synchronous,
    /// The primary acknowledges a commit on its own; the standby follows when it can, and a
    /// promotion loses whatever it had not received.
    Asynchronous,
}

/// The replication slot the standby streams from.
const SLOT: &str = "dlock_standby";

/// A primary and its standby, both throwaway servers on free loopback ports.
pub struct PgPair {
    /// Declared first: stopped before the directories go.
    pub primary: PgServer,
    pub standby: PgServer,
    pub replication: Replication,
    /// The primary's port, held once the primary is killed, so that no other server started
    /// meanwhile (another test's) answers there as a primary the services would take.
    held: Option<PortHold>,
    _standby_dir: tempfile::TempDir,
}

impl PgPair {
    /// Starts a primary, takes a base backup of it on a new physical slot and starts that as a
    /// streaming standby; returns once the standby streams (and, synchronous, is the primary's
    /// synchronous standby).
    pub fn start(replication: Replication) -> Result<Self> {
        let mut settings = vec![
            "wal_level=replica".to_owned(),
            "max_wal_senders=10".to_owned(),
            "max_replication_slots=10".to_owned(),
        ];
        if replication == Replication::Synchronous {
            settings.push("synchronous_standby_names=*".to_owned());
        }
        let primary = PgServer::start_with(None, &[], |_| Ok(settings))?;
        let bin = pg_bin_dir()?;
        let standby_dir = tempfile::Builder::new()
            .prefix("dlock-pg-standby-")
            .tempdir()?;
        chown_for_postgres(standby_dir.path())?;
        let data = standby_dir.path().join("data");
        let mut backup = pg_command(&bin.join("pg_basebackup"));
        backup
            .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
            .args(["-U", "postgres", "-D"])
            .arg(&data)
            .args(["-R", "-X", "stream", "-C", "-S", SLOT])
            .args(["--checkpoint=fast", "--no-sync"]);
        run_output(backup, "pg_basebackup", None)?;
        let standby = PgServer::start_with(Some(standby_dir.path()), &[], |_| {
            Ok(vec![
                "hot_standby=on".to_owned(),
                "cluster_name=dlock_standby".to_owned(),
            ])
        })?;
        let pair = Self {
            primary,
            standby,
            replication,
            held: None,
            _standby_dir: standby_dir,
        };
        let wanted = match replication {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        wait_until("the standby streaming", Duration::from_secs(30), || {
            pair.primary
                .psql(
                    "postgres",
                    "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'",
                )
                .is_ok_and(|s| s == wanted)
        })?;
        Ok(pair)
    }

    /// Both servers as one multi-host URL that takes only the one that accepts writes:
    /// `postgres://postgres@127.0.0.1:<primary>,127.0.0.1:<standby>/<database>?target_session_attrs=read-write`.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/{database}?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// Creates `name` on the primary and waits until the standby has it too.
    pub fn create_database(&self, name: &str) -> Result<()> {
        self.primary.create_database(name)?;
        self.caught_up()
    }

    /// Waits until the standby has replayed everything the primary has written so far.
    pub fn caught_up(&self) -> Result<()> {
        let lsn = self
            .primary
            .psql("postgres", "SELECT pg_current_wal_lsn()")?;
        wait_until("the standby's replay", Duration::from_secs(30), || {
            self.standby
                .psql(
                    "postgres",
                    &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
                )
                .is_ok_and(|s| s == "t")
        })
    }

    /// SIGKILLs the primary (no shutdown, as in a crash of its machine) and holds its port.
    pub fn kill_primary(&mut self) -> Result<()> {
        let port = self.primary.port;
        self.primary.kill();
        // Its backends notice the postmaster's death and exit; until the port is free to hold,
        // a connection may still reach one, so wait for it.
        let mut hold = None;
        wait_until(
            "the killed primary's port to be free",
            Duration::from_secs(10),
            || {
                hold = PortHold::bind(port).ok();
                hold.is_some()
            },
        )?;
        self.held = hold;
        Ok(())
    }

    /// Promotes the standby (`pg_promote()`, waiting for it) and returns how long it took.
    pub fn promote(&self) -> Result<Duration> {
        let started = Instant::now();
        let answer = self
            .standby
            .psql("postgres", "SELECT pg_promote(true, 60)")?;
        if answer != "t" {
            bail!("pg_promote() answered {answer:?}: the standby was not promoted");
        }
        Ok(started.elapsed())
    }

    /// Pauses the standby's WAL replay: it still receives and flushes, replays nothing.
    pub fn pause_replay(&self) -> Result<()> {
        self.standby
            .psql("postgres", "SELECT pg_wal_replay_pause()")
            .map(drop)
    }

    /// Resumes a paused replay.
    pub fn resume_replay(&self) -> Result<()> {
        self.standby
            .psql("postgres", "SELECT pg_wal_replay_resume()")
            .map(drop)
    }

    /// Cuts the standby off from its primary (an empty `primary_conninfo`, reloaded) and waits
    /// until its WAL receiver is gone: from now on the primary's writes never reach it. Only for
    /// an asynchronous pair (a synchronous primary would wait for the standby forever).
    pub fn cut(&self) -> Result<()> {
        if self.replication == Replication::Synchronous {
            bail!("cutting a synchronous standby off would stall every commit of the primary");
        }
        self.standby
            .psql("postgres", "ALTER SYSTEM SET primary_conninfo = ''")?;
        self.standby.psql("postgres", "SELECT pg_reload_conf()")?;
        wait_until(
            "the standby's WAL receiver to stop",
            Duration::from_secs(30),
            || {
                self.standby
                    .psql("postgres", "SELECT count(*) FROM pg_stat_wal_receiver")
                    .is_ok_and(|s| s == "0")
            },
        )
    }

    /// The primary's current WAL position and the standby's last replayed one.
    pub fn positions(&self) -> Result<(String, String)> {
        Ok((
            self.primary
                .psql("postgres", "SELECT pg_current_wal_lsn()")?,
            self.standby
                .psql("postgres", "SELECT pg_last_wal_replay_lsn()")?,
        ))
    }
}

/// A port held by a listener that drops every connection at once: a client is turned away as from
/// a dead server, and no other server can take the port.
struct PortHold {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PortHold {
    fn bind(port: u16) -> Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => drop(stream),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for PortHold {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
