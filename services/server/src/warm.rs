//! The connections a service's single-statement writes reuse, the last one to finish first, in
//! front of its sqlx pool.
//!
//! sqlx's pool hands its idle connections out first in, first out, and pings each one as it comes
//! back. At light load that spreads consecutive calls over every connection the pool ever opened,
//! each a PostgreSQL backend whose caches have gone cold, with one more round trip per call on
//! the side. In the lock bench (services/lock-server/benches/lock.rs, "one hop";
//! docs/benchmarks.md#warm-connections), a ping and `dlock_acquire` took 0.69-0.90 ms on the next
//! connection of a pool of 32 and 0.56-0.66 ms through [`Warm`].
//!
//! [`Warm::acquire`] takes the connection that came back last; [`WarmConnection`] goes back here
//! on drop, with no ping, unless it was discarded or the pool has none to spare (callers may
//! be waiting on it). Nothing stays out of the pool long: a connection that has been out of it
//! for [`WARM_FOR`], or has sat here unused that long, goes back to the pool instead of being
//! handed out or kept, and at most `keep` wait here. So every connection still passes the
//! pool's own checks (its lifetime, the idle ping, a failover's switch of host:
//! services/server/src/pg.rs) at least once every [`WARM_FOR`] and one call.
//!
//! For single statements outside a transaction. A statement whose future is dropped before its
//! answer leaves the answer unread; sqlx reads it before the connection's next command, so the
//! next user is not confused by it. A connection that failed in a way that may have broken it
//! (an I/O or protocol error) is [`WarmConnection::discard`]ed by its user.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

/// How long a connection may stay out of the pool, and sit unused here, before it goes back.
pub const WARM_FOR: Duration = Duration::from_millis(100);

/// A connection out of the pool: since when, and since when it waits here unused.
struct Held {
    connection: PoolConnection<Postgres>,
    out_since: Instant,
    idle_since: Instant,
}

/// A pool with a stack of recently used connections in front of it (see the module's text).
#[derive(Clone)]
pub struct Warm {
    pool: PgPool,
    held: Arc<Mutex<Vec<Held>>>,
    keep: usize,
    warm_for: Duration,
}

impl Warm {
    /// In front of `pool`, keeping at most a quarter of its connections (at least one, at most
    /// four): the rest always serve the pool's other users.
    pub fn new(pool: PgPool) -> Self {
        let keep = (pool.options().get_max_connections() as usize / 4).clamp(1, 4);
        Self::with(pool, keep, WARM_FOR)
    }

    /// At most `keep` waiting, each back to the pool after `warm_for` (out of it, or unused).
    pub fn with(pool: PgPool, keep: usize, warm_for: Duration) -> Self {
        Self {
            pool,
            held: Arc::new(Mutex::new(Vec::with_capacity(keep))),
            keep,
            warm_for,
        }
    }

    /// The connection that came back last, when it is fresh; else one from the pool.
    pub async fn acquire(&self) -> Result<WarmConnection, sqlx::Error> {
        let now = Instant::now();
        let (fresh, stale) = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            // The stalest sit at the bottom: they all go back to the pool at once.
            let stale_below = held
                .iter()
                .rposition(|h| now.duration_since(h.idle_since) >= self.warm_for)
                .map_or(0, |i| i + 1);
            let mut stale: Vec<Held> = held.drain(..stale_below).collect();
            let mut fresh = held.pop();
            // Out of the pool for the warm time already: back to it as well.
            if let Some(out) = fresh.take_if(|h| now.duration_since(h.out_since) >= self.warm_for) {
                stale.push(out);
            }
            (fresh, stale)
        };
        // Dropped outside the lock: each goes back to the pool (its ping runs on a task of its own).
        drop(stale);
        let (connection, out_since) = match fresh {
            Some(held) => (held.connection, held.out_since),
            None => (self.pool.acquire().await?, Instant::now()),
        };
        Ok(WarmConnection {
            connection: Some(connection),
            out_since,
            home: self.clone(),
        })
    }

    fn put_back(&self, connection: PoolConnection<Postgres>, out_since: Instant) {
        let now = Instant::now();
        if now.duration_since(out_since) >= self.warm_for || !self.pool_has_spare() {
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.len() < self.keep {
            held.push(Held {
                connection,
                out_since,
                idle_since: now,
            });
        }
    }

    /// Whether the pool can hand out a connection without waiting: one idle, or room to open
    /// one. When it cannot, callers may be queued on it, and a connection kept here would make
    /// them wait while the warm ones go round (up to `warm_for`, measured as a 115 ms p99 at 64
    /// clients on a pool of 32): it goes back to the pool instead. Under such load every
    /// connection is busy, so none goes cold anyway.
    fn pool_has_spare(&self) -> bool {
        self.pool.num_idle() > 0 || self.pool.size() < self.pool.options().get_max_connections()
    }
}

/// A connection from [`Warm::acquire`]; back to it on drop (or to the pool: see [`Warm`]).
pub struct WarmConnection {
    connection: Option<PoolConnection<Postgres>>,
    out_since: Instant,
    home: Warm,
}

impl WarmConnection {
    /// Closes the connection instead of reusing it: it failed in a way that may have broken it.
    /// The others waiting in [`Warm`] go back to the pool, which checks each as it comes back:
    /// what broke one (a restarted primary) has likely broken them all.
    pub fn discard(mut self) {
        if let Some(mut connection) = self.connection.take() {
            connection.close_on_drop();
        }
        let held: Vec<Held> = {
            let mut held = self.home.held.lock().unwrap_or_else(|p| p.into_inner());
            held.drain(..).collect()
        };
        drop(held);
    }
}

/// Only `discard` and `drop` take the connection out, and both consume the `WarmConnection`.
const HELD_UNTIL_DROPPED: &str = "a WarmConnection holds its connection until it is dropped";

impl Deref for WarmConnection {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self.connection.as_deref() {
            Some(connection) => connection,
            None => unreachable!("{HELD_UNTIL_DROPPED}"),
        }
    }
}

impl DerefMut for WarmConnection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self.connection.as_deref_mut() {
            Some(connection) => connection,
            None => unreachable!("{HELD_UNTIL_DROPPED}"),
        }
    }
}

impl Drop for WarmConnection {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            if std::thread::panicking() {
                return;
            }
            self.home.put_back(connection, self.out_since);
        }
    }
}
