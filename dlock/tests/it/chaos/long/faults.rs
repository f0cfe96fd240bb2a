//! The faults of the long run and how each strikes the running stack.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dlock_devstack::faultproxy::{AfterMatch, Direction, FaultProxy, Mode};
use dlock_devstack::{ManagedChild, Signal};

use super::stack::{LEASE_MS, READ_TIMEOUT_MS, Run};

/// The fault kinds, in the order they strike within a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Fault {
    PausedExecutor,
    LockLinkSlowThenReset,
    PaymentLinkSlowThenReset,
    RailAnswerLost,
    RailAnswerLate,
    KillLockServer,
    KillPaymentResource,
    KillRailProxy,
    DatabaseFailover,
}

pub(super) const ROTATION: [Fault; 8] = [
    Fault::PausedExecutor,
    Fault::LockLinkSlowThenReset,
    Fault::KillLockServer,
    Fault::RailAnswerLost,
    Fault::PaymentLinkSlowThenReset,
    Fault::KillPaymentResource,
    Fault::RailAnswerLate,
    Fault::KillRailProxy,
];

impl Run {
    /// A link slowed (200 ms each way) until `step` more payouts settle, then every connection
    /// reset until the proxy has reset one, then healed.
    async fn slow_then_reset(
        &self,
        link: &FaultProxy,
        step: usize,
        executors: &mut [(ManagedChild, PathBuf)],
    ) {
        link.set_latency(Direction::Upstream, Duration::from_millis(200));
        link.set_latency(Direction::Downstream, Duration::from_millis(200));
        let from = self.settled();
        self.settled_at_least(from + step, executors).await;
        link.set_latency(Direction::Upstream, Duration::ZERO);
        link.set_latency(Direction::Downstream, Duration::ZERO);
        let resets = link.stats().reset;
        link.set_mode(Mode::Reset);
        let began = Instant::now();
        while link.stats().reset == resets && began.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        link.set_mode(Mode::Forward);
    }

    /// Arms the rail link for one transfer and waits until it fired (or 30 s passed: a batch
    /// near its end may send none).
    async fn rail_answer(&self, then: AfterMatch) -> bool {
        let fired = self.rail_link.fired();
        self.rail_link.after_request(b"POST ", 0, then);
        let began = Instant::now();
        while self.rail_link.fired() == fired {
            if began.elapsed() > Duration::from_secs(30) {
                self.rail_link.after_request(b"", 0, then);
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    pub(super) async fn strike(
        &mut self,
        fault: Fault,
        batch: usize,
        executors: &mut [(ManagedChild, PathBuf)],
    ) {
        let step = (batch / 50).max(5);
        let struck = match fault {
            Fault::PausedExecutor => {
                let running = executors.iter_mut().position(|(e, _)| !e.exited());
                match running {
                    Some(i) => {
                        let (paused, _) = &executors[i];
                        paused
                            .signal(Signal::SIGSTOP)
                            .unwrap_or_else(|e| panic!("{e}"));
                        let stopped = Instant::now();
                        let from = self.settled();
                        self.settled_at_least(from + step, executors).await;
                        // Its lease lapses while it sleeps: that is the fault.
                        let past = Duration::from_millis(LEASE_MS + 1_000);
                        if let Some(left) = past.checked_sub(stopped.elapsed()) {
                            tokio::time::sleep(left).await;
                        }
                        executors[i]
                            .0
                            .signal(Signal::SIGCONT)
                            .unwrap_or_else(|e| panic!("{e}"));
                        true
                    }
                    None => false,
                }
            }
            Fault::LockLinkSlowThenReset => {
                let from = self.lock_link.stats().reset;
                self.slow_then_reset(&self.lock_link, step, executors).await;
                self.lock_link.stats().reset > from
            }
            Fault::PaymentLinkSlowThenReset => {
                let from = self.payment_link.stats().reset;
                self.slow_then_reset(&self.payment_link, step, executors)
                    .await;
                self.payment_link.stats().reset > from
            }
            Fault::RailAnswerLost => self.rail_answer(AfterMatch::CutAnswer).await,
            Fault::RailAnswerLate => {
                self.rail_answer(AfterMatch::StallAnswer(Duration::from_millis(
                    3 * READ_TIMEOUT_MS,
                )))
                .await
            }
            Fault::KillLockServer => {
                tokio::task::block_in_place(|| self.lock.kill_and_restart());
                true
            }
            Fault::KillPaymentResource => {
                tokio::task::block_in_place(|| self.payment.kill_and_restart());
                true
            }
            Fault::KillRailProxy => {
                tokio::task::block_in_place(|| self.proxy.kill_and_restart());
                true
            }
            Fault::DatabaseFailover => {
                let took = tokio::task::block_in_place(|| {
                    self.pair.kill_primary().unwrap_or_else(|e| panic!("{e:#}"));
                    self.failed_over = true;
                    self.pair.promote().unwrap_or_else(|e| panic!("{e:#}"))
                });
                self.failover_ms = Some(took.as_millis());
                true
            }
        };
        if struck {
            *self.struck.entry(fault).or_default() += 1;
        }
    }
}
