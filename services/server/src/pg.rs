//! The PostgreSQL pool every service opens (lockdb and paydb alike).

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;

/// A pooled connection idle this long is pinged before it is used.
pub const IDLE_PING_AFTER: Duration = Duration::from_secs(1);

/// Pool options with at most `max_connections`, waiting at most `acquire_timeout` for one;
/// a connection is pinged before use only when it was idle for IDLE_PING_AFTER or longer.
pub fn pool_options(max_connections: u32, acquire_timeout: Duration) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        // sqlx pings a connection before handing it out: one more round trip in front of
        // every call (0.2 ms of a 0.25 ms `SELECT 1` here). It pings again when the
        // connection comes back, which catches one broken in use. What is left to catch is a
        // connection cut while idle (a restarted or failed-over primary): only one idle for
        // longer than IDLE_PING_AFTER is pinged. A cut one that slips through fails its call
        // with an I/O error, NOT_LEADER from the lock server and the payment resource (nothing
        // happened, retry), and is dropped.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= IDLE_PING_AFTER {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}
