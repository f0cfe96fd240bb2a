//! A client of the lock server and one of the payment resource beside the executors, counting
//! what the faults made them refuse.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dlock_contract::client::{ClientError, LockClient};
use dlock_contract::payment_client::PaymentClient;
use tokio::sync::Mutex;

use crate::failover::{refusal_code, session_gone};

/// Calls a probe made and the codes of those refused (`transport` when no answer came).
#[derive(Default)]
pub(super) struct Seen {
    pub(super) calls: usize,
    pub(super) refused: BTreeMap<String, usize>,
}

impl Seen {
    fn record(&mut self, error: Option<&ClientError>) {
        self.calls += 1;
        if let Some(e) = error {
            *self.refused.entry(refusal_code(e)).or_default() += 1;
        }
    }
}

/// A client of the lock server and one of the payment resource, through the same fault proxies
/// as the executors, until `stop`.
pub(super) fn probe(
    lock_url: String,
    payment_url: String,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<(Seen, Seen)>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let lock = LockClient::new(&lock_url, "long-probe").unwrap_or_else(|e| panic!("{e}"));
        let payment =
            PaymentClient::new(&payment_url, "long-probe").unwrap_or_else(|e| panic!("{e}"));
        let mut session = None;
        while !stop.load(Ordering::SeqCst) {
            let sid = match session {
                Some(s) => Ok(s),
                None => lock
                    .create_session(Some(30_000))
                    .await
                    .map(|s| s.session_id),
            };
            let lock_result = match sid {
                Ok(sid) => {
                    session = Some(sid);
                    match lock
                        .acquire("long:probe", sid, Some(10_000), Some(500))
                        .await
                    {
                        Ok(grant) => {
                            let _ = lock.release("long:probe", sid, grant.fencing_token).await;
                            Ok(())
                        }
                        Err(e) => {
                            if session_gone(&e) {
                                session = None;
                            }
                            Err(e)
                        }
                    }
                }
                Err(e) => Err(e),
            };
            let pay_result = payment.get_account("long-00").await;
            {
                let mut seen = seen.lock().await;
                seen.0.record(lock_result.as_ref().err());
                seen.1.record(pay_result.as_ref().err());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}
