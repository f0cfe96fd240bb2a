//! dlock's fencing protocol as a [stateright] model (docs/model.md).
//!
//! One account (one lock key, `payout:{accountId}`), a few payouts of it, a few workers running the
//! executor's cycle (acquire → claim → submit → rail → post, docs/design.md#executor), the lock
//! server's token sequence in lockdb, the account fence and the rail mark in paydb
//! (docs/design.md#enforcement-points), a rail that may lose a request or its answer
//! (docs/design.md#rail-ambiguous), and two databases that may fail over to a standby that had
//! stopped replicating, losing the last writes (docs/design.md#d-12).
//!
//! Every step is one atomic transition, so the checker tries every interleaving: a worker that
//! "pauses past its lease" is a worker that takes no step while the lease expires and others act.
//! The database decides each write in one step, as paydb's functions do under their row locks.
//!
//! [`Variant`] switches single defences off; the positive controls in `tests/protocol.rs` check
//! that each switch lets the checker find a counterexample.

use std::fmt::Write as _;

use stateright::{Model, Property};

/// A fencing token, or 0 for "none yet". Small numbers: the model issues only a few.
pub type Token = u8;

/// At most this many workers and payouts: the state is fixed-size arrays (no heap per state), the
/// slots past the bounds stay as they started.
pub const MAX_WORKERS: usize = 3;
pub const MAX_PAYOUTS: usize = 3;

/// Which defences the protocol runs with. [`Variant::DLOCK`] is dlock as designed; every other
/// value takes one defence away (a positive control) or probes which defence carries which load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// A revocation's floor goes through lockdb's epoch guard as a grant's token does, as
    /// `dlock_revoke` does since lockdb 0010; `false`: L8 draws its floor from the sequence
    /// directly, as it did before.
    pub revoke_checks_epoch: bool,
    /// A revocation pushes its floor to the account fence and then to the rail mark before it is
    /// complete (docs/design.md#d-3); `false`: L8 alone, complete at once.
    pub revocation_pushes_floor: bool,
    /// After lockdb fails over to a new epoch, its first grant moves the sequence past
    /// `Bounds::safety_gap` before it takes its token (lockdb's epoch guard).
    pub lock_epoch_jump: bool,
    /// After paydb fails over to a new epoch, the payment resource and the rail proxy refuse every
    /// write until an operator's recovery has run.
    pub pay_epoch_refusal: bool,
    /// The recovery raises the account fence and the rail mark to the newest token the lock
    /// server has issued.
    pub recovery_raises_fences: bool,
    /// The recovery's token floor is read from lockdb after lockdb's epoch guard has run (so it
    /// includes the gap when lockdb is on a new epoch no grant has seen yet); `false`: the
    /// sequence's value as it is, which is what `dlock recover paydb-epoch` read before lockdb 0010.
    pub recovery_floor_checks_epoch: bool,
    /// The recovery reads the rail's record of the requests it received and quarantines
    /// (RAIL_AMBIGUOUS) every payout the rail saw that paydb no longer shows as presented.
    pub recovery_reads_rail: bool,
    /// The rail mark admits `token > mark` (strict); `false` admits `token >= mark`.
    pub strict_mark: bool,
    /// The rail proxy's per-payout checks: the replay of an attempt under the same token, one
    /// presented attempt per payout (DUPLICATE_SUBMISSION), and the payout CLAIMED under this very
    /// token (docs/contract.md#admission-order).
    pub per_payout_guards: bool,
}

impl Variant {
    /// The code as it stands: lockdb's epoch check runs before a grant, a revocation's floor and
    /// the recovery's token floor (migrations/lockdb/0016_baseline.sql), and the recovery
    /// quarantines every payout the rail's statement holds that paydb no longer shows as
    /// presented, in the confirmation's transaction
    /// (migrations/paydb/0039_baseline_payment_writes.sql, `dlock recover paydb-epoch --lockdb
    /// --rail`): every defence of [`Variant::DLOCK`].
    pub const CODE: Variant = Variant {
        recovery_floor_checks_epoch: true,
        revoke_checks_epoch: true,
        recovery_reads_rail: true,
        ..Variant::DLOCK
    };
    /// The protocol with every defence docs/design.md#d-12 asks for: no token, floor included, is
    /// drawn on a new lockdb epoch before the sequence has moved past the gap.
    pub const DLOCK: Variant = Variant {
        recovery_floor_checks_epoch: true,
        revoke_checks_epoch: true,
        revocation_pushes_floor: true,
        lock_epoch_jump: true,
        pay_epoch_refusal: true,
        recovery_raises_fences: true,
        recovery_reads_rail: true,
        strict_mark: true,
        per_payout_guards: true,
    };
}

/// How big the checked world is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Workers running the executor's cycle (`dlock run` processes), 1 to 3.
    pub workers: u8,
    /// Payouts of the one account, 1 to 3.
    pub payouts: u8,
    /// Grants the lock server makes in one run (each acquire is one fresh token).
    pub grants: u8,
    /// Revocations an operator makes (L8, then the floor pushed to the account fence, then to the
    /// rail mark: docs/design.md#floors), at most one under way at a time.
    pub revocations: u8,
    /// Failovers of lockdb that lose writes.
    pub lockdb_failovers: u8,
    /// Failovers of paydb that lose writes.
    pub paydb_failovers: u8,
    /// How far the lock server moves its sequence on a new lockdb epoch. Safe when it is more than
    /// the lock server could have issued since the standby stopped replicating: here, `grants`
    /// plus `revocations` (a revocation's floor is a token too).
    pub safety_gap: Token,
    /// A worker whose submission got no answer may send the same submission again once (a client
    /// or network retry; the executor itself never retries a submit, the proxy must not rely on it).
    pub client_retries: bool,
}

impl Bounds {
    /// The bounds the test suite checks exhaustively (docs/model.md#bounds).
    pub const CHECKED: Bounds = Bounds {
        workers: 2,
        payouts: 2,
        grants: 3,
        revocations: 0,
        lockdb_failovers: 1,
        paydb_failovers: 1,
        safety_gap: 3,
        client_retries: true,
    };
}

/// A grant as the worker holding it knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Grant {
    pub token: Token,
    /// The grant's place in the order the lock server made grants (1, 2, …). A ghost: it is not in
    /// any database and never goes back, so it tells grants apart even when a token repeats.
    pub issued: u8,
}

/// A payout's state in paydb (docs/design.md#payouts), with the token of its claim or attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Payout {
    Pending,
    /// CLAIMED under this token.
    Claimed(Token),
    /// SUBMITTING: an intent (an attempt row) under this token, its forward not yet recorded.
    Submitting(Token),
    /// RAIL_ACKED by the attempt under this token.
    Acked(Token),
    Posted,
    /// RAIL_AMBIGUOUS: quarantined, never submitted again.
    Ambiguous,
}

impl Payout {
    /// Whether paydb holds a presented (non-FENCED) attempt for the payout.
    fn has_attempt(self) -> bool {
        !matches!(self, Payout::Pending | Payout::Claimed(_))
    }
    /// The token of the payout's attempt, if it still carries it.
    fn attempt_token(self) -> Option<Token> {
        match self {
            Payout::Submitting(t) | Payout::Acked(t) => Some(t),
            _ => None,
        }
    }
}

/// lockdb: the token sequence and the one key's grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LockDb {
    /// The last token issued (`fencing_token_seq`).
    pub seq: Token,
    /// The live grant on the key: (worker, token). Expiry removes it.
    pub holder: Option<(u8, Token)>,
    /// lockdb is on a new epoch (timeline) that no grant has seen yet: the next grant moves the
    /// sequence past the gap first (migrations/lockdb/0016_baseline.sql).
    pub epoch_pending: bool,
}

/// paydb: the account fence, the rail mark and the payouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PayDb {
    /// `accounts.fence`.
    pub fence: Token,
    /// `rail_high_water.highest_token`.
    pub mark: Token,
    pub payouts: [Payout; MAX_PAYOUTS],
}

/// Where a worker is in its cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Worker {
    Idle,
    /// Acquired; next it re-reads the payouts and claims, posts, or lets go.
    Holding(Grant),
    /// Its claim of payout `.1` was admitted.
    Claimed(Grant, u8),
    /// Its submission of payout `.1` was admitted; the proxy's forward is in flight. `.2`: this
    /// is the retried submission.
    Forwarding(Grant, u8, bool),
    /// The rail acknowledged payout `.1` and the proxy recorded it; next it posts.
    Acked(Grant, u8),
    /// Its submission of payout `.1` got no usable answer (the rail's answer was lost, or the
    /// proxy could not record it). `.2`: it already retried once.
    NoAnswer(Grant, u8, bool),
}

impl Worker {
    fn grant(self) -> Option<Grant> {
        match self {
            Worker::Idle => None,
            Worker::Holding(g)
            | Worker::Claimed(g, _)
            | Worker::Forwarding(g, _, _)
            | Worker::Acked(g, _)
            | Worker::NoAnswer(g, _, _) => Some(g),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// How many of the worker and payout slots are in use.
    pub n_workers: u8,
    pub n_payouts: u8,
    pub lock: LockDb,
    /// lockdb's standby: `None` while it replicates every commit (a failover then loses nothing);
    /// `Some(copy)` once it stopped replicating at `copy`.
    pub lock_standby: Option<LockDb>,
    pub lock_failovers: u8,
    pub pay: PayDb,
    pub pay_standby: Option<PayDb>,
    pub pay_failovers: u8,
    /// paydb is in a new epoch and no recovery has run yet (with `pay_epoch_refusal`, every write
    /// of the payment resource and the rail proxy is refused meanwhile).
    pub pay_recovering: bool,
    pub workers: [Worker; MAX_WORKERS],
    /// The rail's record: how many times each payout's request reached the rail (capped at 2).
    /// The rail is a third party: nothing of dlock's failing over changes it.
    pub rail: [u8; MAX_PAYOUTS],
    /// Ghost: grants made so far.
    pub grants_made: u8,
    /// The revocation under way: its floor, and whether the floor has reached the account fence
    /// (the flow's second step; the third, the rail mark, completes it).
    pub revocation: Option<(Token, bool)>,
    pub revocations_made: u8,
    /// Ghost: the highest floor of a completed revocation (0: none).
    pub revoked_floor: Token,
    /// Ghost: a write with a token at or below a completed revocation's floor was admitted.
    pub revoked_write: Option<Token>,
    /// Ghost: the latest-issued grant that had a payment-side write admitted (0: none yet).
    pub newest_writer: u8,
    /// Ghost: a write of a grant was admitted after a write of a grant issued later.
    pub stale_write: Option<(u8, u8)>,
}

impl State {
    /// The payouts in use, as paydb has them now.
    pub fn payouts(&self) -> &[Payout] {
        &self.pay.payouts[..self.n_payouts as usize]
    }
    /// The workers in use.
    pub fn workers(&self) -> &[Worker] {
        &self.workers[..self.n_workers as usize]
    }
    /// The rail's count of received requests per payout in use.
    pub fn rails(&self) -> &[u8] {
        &self.rail[..self.n_payouts as usize]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Worker acquires the key (L4): a fresh token.
    Acquire(u8),
    /// The grant's lease runs out (the worker does not know: it may be paused).
    Expire,
    /// Worker claims payout (P2, strict at the account fence).
    Claim(u8, u8),
    /// Worker submits its claimed payout to the rail proxy (S1), or sends it again after no answer.
    Submit(u8),
    /// The rail receives the forward and its answer comes back.
    RailAck(u8),
    /// The rail receives the forward, the answer is lost (RAIL_AMBIGUOUS).
    RailAnswerLost(u8),
    /// The forward is lost before the rail (RAIL_AMBIGUOUS too: the proxy cannot tell).
    RailRequestLost(u8),
    /// Worker posts payout (P3, `fence <= token`).
    Post(u8, u8),
    /// Worker ends its cycle: releases its grant if it is still the live one.
    Release(u8),
    /// The operator revokes the key's grant (L8): the grant ends, a fresh floor is issued.
    Revoke,
    /// The revocation flow advances the account fence to the floor.
    RevokeFence,
    /// The revocation flow advances the rail mark to the floor: the revocation is complete.
    RevokeMark,
    /// lockdb's standby stops replicating (its copy is now the state to fail over to).
    LockStandbyLags,
    /// lockdb fails over to its standby.
    LockFailover,
    PayStandbyLags,
    PayFailover,
    /// The operator's recovery after paydb's new epoch (`dlock recover`).
    PayRecover,
}

/// The model: bounds and a variant.
#[derive(Clone, Debug)]
pub struct Fencing {
    pub bounds: Bounds,
    pub variant: Variant,
}

/// "No payout is presented to the rail twice".
pub const PAID_ONCE: &str = "no payout is presented to the rail twice";
/// "No two workers write with a live grant at once": see [`State::stale_write`].
pub const GRANT_ORDER: &str = "no write of an older grant is admitted after a newer grant wrote";
/// A completed revocation (its floor at both fences) keeps every token at or below the floor out.
pub const REVOKED_STAYS_OUT: &str =
    "no write at or below a completed revocation's floor is admitted";
pub const SOME_REVOKED: &str = "sometimes a revocation completes and a payout is posted after it";
pub const SOME_POSTED: &str = "sometimes a payout is posted";
pub const ALL_POSTED: &str = "sometimes every payout is posted";
pub const POSTED_AFTER_FAILOVERS: &str =
    "sometimes a payout is posted after both databases failed over";

impl Fencing {
    pub fn new(bounds: Bounds, variant: Variant) -> Self {
        Fencing { bounds, variant }
    }

    /// lockdb's epoch guard: on the first use of a new epoch, the sequence moves past the gap.
    fn epoch_check(state: &mut State, gap: Token) {
        if state.lock.epoch_pending {
            state.lock.seq = state.lock.seq.saturating_add(gap);
            state.lock.epoch_pending = false;
        }
    }

    fn write(state: &mut State, grant: Grant) {
        if grant.token <= state.revoked_floor && state.revoked_write.is_none() {
            state.revoked_write = Some(grant.token);
        }
        if grant.issued < state.newest_writer && state.stale_write.is_none() {
            state.stale_write = Some((grant.issued, state.newest_writer));
        }
        state.newest_writer = state.newest_writer.max(grant.issued);
    }

    fn release(state: &mut State, worker: u8, grant: Grant) {
        if state.lock.holder == Some((worker, grant.token)) {
            state.lock.holder = None;
        }
        state.workers[worker as usize] = Worker::Idle;
    }

    /// The rail proxy's admission (docs/contract.md#admission-order), one paydb transaction.
    /// Returns whether the submission was admitted (the intent committed, the forward starts).
    fn admit(&self, state: &mut State, grant: Grant, p: u8) -> bool {
        let v = self.variant;
        if state.pay_recovering && v.pay_epoch_refusal {
            return false; // 503 RAIL_UNAVAILABLE: nothing recorded, nothing forwarded
        }
        let t = grant.token;
        let payout = state.pay.payouts[p as usize];
        if v.per_payout_guards && payout.attempt_token() == Some(t) {
            return false; // the identical request: the first attempt's answer, never forwarded
        }
        let above_mark = if v.strict_mark {
            t > state.pay.mark
        } else {
            t >= state.pay.mark
        };
        if !above_mark {
            return false; // 409 FENCED_OUT, resourceType rail
        }
        let claim = match payout {
            Payout::Claimed(c) => c,
            _ => 0,
        };
        if t < state.pay.fence || t < claim {
            return false; // 409 FENCED_OUT, resourceType account
        }
        if v.per_payout_guards && (payout.has_attempt() || payout != Payout::Claimed(t)) {
            return false; // 409 DUPLICATE_SUBMISSION or PAYOUT_NOT_CLAIMABLE
        }
        state.pay.mark = t;
        state.pay.payouts[p as usize] = Payout::Submitting(t);
        Self::write(state, grant);
        true
    }

    /// The proxy records the forward's outcome on the attempt (not a fenced write: the attempt is
    /// its own). Returns whether the record committed.
    fn record(&self, state: &mut State, grant: Grant, p: u8, outcome: Payout) -> bool {
        if state.pay_recovering && self.variant.pay_epoch_refusal {
            return false;
        }
        let slot = &mut state.pay.payouts[p as usize];
        if *slot == Payout::Submitting(grant.token) {
            *slot = outcome;
            true
        } else {
            false // the attempt row was lost with a failover: nothing to record on
        }
    }
}

impl Model for Fencing {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let b = self.bounds;
        vec![State {
            n_workers: b.workers.min(MAX_WORKERS as u8),
            n_payouts: b.payouts.min(MAX_PAYOUTS as u8),
            lock: LockDb {
                seq: 0,
                holder: None,
                epoch_pending: false,
            },
            lock_standby: None,
            lock_failovers: 0,
            pay: PayDb {
                fence: 0,
                mark: 0,
                payouts: [Payout::Pending; MAX_PAYOUTS],
            },
            pay_standby: None,
            pay_failovers: 0,
            pay_recovering: false,
            workers: [Worker::Idle; MAX_WORKERS],
            rail: [0; MAX_PAYOUTS],
            grants_made: 0,
            revocation: None,
            revocations_made: 0,
            revoked_floor: 0,
            revoked_write: None,
            newest_writer: 0,
            stale_write: None,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let b = self.bounds;
        if s.stale_write.is_some() || s.revoked_write.is_some() || s.rails().iter().any(|&n| n > 1)
        {
            // A violation ends the run here, so the checker reports the shortest path to it.
            return;
        }
        for (w, worker) in s.workers().iter().enumerate() {
            let w = w as u8;
            match *worker {
                Worker::Idle => {
                    if s.lock.holder.is_none() && s.grants_made < b.grants {
                        actions.push(Action::Acquire(w));
                    }
                }
                Worker::Holding(_) => {
                    // The re-read after the acquire decides: claim a PENDING or CLAIMED payout,
                    // post a RAIL_ACKED one, or let go. (paydb refuses the write anyway if the
                    // payout moved; with the read folded into the write the checker loses no
                    // interleaving that changes an outcome.)
                    for (p, payout) in s.payouts().iter().enumerate() {
                        match payout {
                            Payout::Pending | Payout::Claimed(_) => {
                                actions.push(Action::Claim(w, p as u8))
                            }
                            Payout::Acked(_) => actions.push(Action::Post(w, p as u8)),
                            _ => {}
                        }
                    }
                    actions.push(Action::Release(w));
                }
                Worker::Claimed(_, _) => {
                    actions.push(Action::Submit(w));
                    actions.push(Action::Release(w));
                }
                Worker::Forwarding(_, _, _) => {
                    actions.push(Action::RailAck(w));
                    actions.push(Action::RailAnswerLost(w));
                    actions.push(Action::RailRequestLost(w));
                }
                Worker::Acked(_, p) => {
                    actions.push(Action::Post(w, p));
                    actions.push(Action::Release(w));
                }
                Worker::NoAnswer(_, _, retried) => {
                    if b.client_retries && !retried {
                        actions.push(Action::Submit(w));
                    }
                    actions.push(Action::Release(w));
                }
            }
        }
        if s.lock.holder.is_some() {
            actions.push(Action::Expire);
            if s.revocation.is_none() && s.revocations_made < b.revocations {
                actions.push(Action::Revoke);
            }
        }
        // Each step of the flow is an authenticated write to paydb: refused, and retried later,
        // while paydb awaits its recovery.
        let pay_open = !(s.pay_recovering && self.variant.pay_epoch_refusal);
        match s.revocation {
            Some((_, false)) if pay_open => actions.push(Action::RevokeFence),
            Some((_, true)) if pay_open => actions.push(Action::RevokeMark),
            _ => {}
        }
        if s.lock_failovers < b.lockdb_failovers {
            match s.lock_standby {
                None => actions.push(Action::LockStandbyLags),
                Some(_) => actions.push(Action::LockFailover),
            }
        }
        if s.pay_failovers < b.paydb_failovers {
            match s.pay_standby {
                None => actions.push(Action::PayStandbyLags),
                Some(_) => actions.push(Action::PayFailover),
            }
        }
        let forwarding = s
            .workers()
            .iter()
            .any(|w| matches!(w, Worker::Forwarding(..)));
        if s.pay_recovering && !forwarding {
            actions.push(Action::PayRecover);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = *last;
        let v = self.variant;
        let pay_open = !(s.pay_recovering && v.pay_epoch_refusal);
        match action {
            Action::Acquire(w) => {
                Self::epoch_check(&mut s, self.bounds.safety_gap);
                s.lock.seq += 1;
                s.lock.holder = Some((w, s.lock.seq));
                s.grants_made += 1;
                s.workers[w as usize] = Worker::Holding(Grant {
                    token: s.lock.seq,
                    issued: s.grants_made,
                });
            }
            Action::Expire => s.lock.holder = None,
            Action::Claim(w, p) => {
                let Worker::Holding(g) = s.workers[w as usize] else {
                    return None;
                };
                let payout = s.pay.payouts[p as usize];
                let claimable = matches!(payout, Payout::Pending | Payout::Claimed(_));
                if pay_open && claimable && s.pay.fence < g.token {
                    s.pay.fence = g.token;
                    s.pay.payouts[p as usize] = Payout::Claimed(g.token);
                    Self::write(&mut s, g);
                    s.workers[w as usize] = Worker::Claimed(g, p);
                } else {
                    // FENCED_OUT (or the payout moved, or paydb refuses): the cycle ends.
                    Self::release(&mut s, w, g);
                }
            }
            Action::Submit(w) => {
                let (g, p, retry) = match s.workers[w as usize] {
                    Worker::Claimed(g, p) => (g, p, false),
                    Worker::NoAnswer(g, p, false) => (g, p, true),
                    _ => return None,
                };
                if self.admit(&mut s, g, p) {
                    s.workers[w as usize] = Worker::Forwarding(g, p, retry);
                } else {
                    Self::release(&mut s, w, g);
                }
            }
            Action::RailAck(w) | Action::RailAnswerLost(w) | Action::RailRequestLost(w) => {
                let Worker::Forwarding(g, p, retried) = s.workers[w as usize] else {
                    return None;
                };
                if action != Action::RailRequestLost(w) {
                    let seen = &mut s.rail[p as usize];
                    *seen = (*seen + 1).min(2);
                }
                let outcome = if matches!(action, Action::RailAck(_)) {
                    Payout::Acked(g.token)
                } else {
                    Payout::Ambiguous
                };
                let recorded = self.record(&mut s, g, p, outcome);
                s.workers[w as usize] = if recorded && outcome != Payout::Ambiguous {
                    Worker::Acked(g, p)
                } else {
                    Worker::NoAnswer(g, p, retried)
                };
            }
            Action::Post(w, p) => {
                let g = match s.workers[w as usize] {
                    Worker::Holding(g) => g,
                    Worker::Acked(g, q) if q == p => g,
                    _ => return None,
                };
                let acked = matches!(s.pay.payouts[p as usize], Payout::Acked(_));
                if pay_open && acked && s.pay.fence <= g.token {
                    // pay_post: `fence <= token` admits, and the fence rises to the token.
                    s.pay.fence = g.token;
                    s.pay.payouts[p as usize] = Payout::Posted;
                    Self::write(&mut s, g);
                }
                Self::release(&mut s, w, g);
            }
            Action::Release(w) => {
                let g = s.workers[w as usize].grant()?;
                Self::release(&mut s, w, g);
            }
            Action::Revoke => {
                if v.revoke_checks_epoch {
                    Self::epoch_check(&mut s, self.bounds.safety_gap);
                }
                s.lock.seq += 1;
                s.lock.holder = None;
                s.revocation = Some((s.lock.seq, false));
                s.revocations_made += 1;
                if !v.revocation_pushes_floor {
                    s.revoked_floor = s.revoked_floor.max(s.lock.seq);
                    s.revocation = None;
                }
            }
            Action::RevokeFence => {
                let (floor, _) = s.revocation?;
                s.pay.fence = s.pay.fence.max(floor);
                s.revocation = Some((floor, true));
            }
            Action::RevokeMark => {
                let (floor, _) = s.revocation.take()?;
                s.pay.mark = s.pay.mark.max(floor);
                s.revoked_floor = s.revoked_floor.max(floor);
            }
            Action::LockStandbyLags => s.lock_standby = Some(s.lock),
            Action::LockFailover => {
                let standby = s.lock_standby.take()?;
                s.lock = standby;
                s.lock_failovers += 1;
                s.lock.epoch_pending = v.lock_epoch_jump;
            }
            Action::PayStandbyLags => s.pay_standby = Some(s.pay),
            Action::PayFailover => {
                let standby = s.pay_standby.take()?;
                s.pay = standby;
                s.pay_failovers += 1;
                s.pay_recovering = v.pay_epoch_refusal;
            }
            Action::PayRecover => {
                // The forwards in flight have ended (the recovery waits out the rail read timeout).
                // The fences rise to the newest token the lock server has issued, read from it, so
                // no grant made before the failover can claim or submit again.
                if v.recovery_raises_fences {
                    if v.recovery_floor_checks_epoch {
                        Self::epoch_check(&mut s, self.bounds.safety_gap);
                    }
                    let issued = s.lock.seq;
                    s.pay.fence = s.pay.fence.max(issued);
                    s.pay.mark = s.pay.mark.max(issued);
                }
                let n = s.n_payouts as usize;
                for (p, payout) in s.pay.payouts[..n].iter_mut().enumerate() {
                    match *payout {
                        // An intent whose forward is over and whose outcome was lost: the sweep
                        // of docs/design.md#d-5.
                        Payout::Submitting(_) => *payout = Payout::Ambiguous,
                        // The rail saw it, paydb forgot it: quarantined for the operator's resolve.
                        Payout::Pending | Payout::Claimed(_)
                            if v.recovery_reads_rail && s.rail[p] > 0 =>
                        {
                            *payout = Payout::Ambiguous
                        }
                        _ => {}
                    }
                }
                s.pay_recovering = false;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(PAID_ONCE, |_, s: &State| s.rails().iter().all(|&n| n <= 1)),
            Property::always(GRANT_ORDER, |_, s: &State| s.stale_write.is_none()),
            Property::always(REVOKED_STAYS_OUT, |_, s: &State| s.revoked_write.is_none()),
            Property::sometimes(SOME_POSTED, |_, s: &State| {
                s.payouts().contains(&Payout::Posted)
            }),
            Property::sometimes(SOME_REVOKED, |_, s: &State| {
                s.revoked_floor > 0
                    && s.pay.fence > s.revoked_floor
                    && s.payouts().contains(&Payout::Posted)
            }),
            Property::sometimes(ALL_POSTED, |_, s: &State| {
                s.payouts().iter().all(|p| *p == Payout::Posted)
            }),
            Property::sometimes(POSTED_AFTER_FAILOVERS, |m: &Fencing, s: &State| {
                s.lock_failovers == m.bounds.lockdb_failovers
                    && s.pay_failovers == m.bounds.paydb_failovers
                    && s.payouts().contains(&Payout::Posted)
            }),
        ]
    }
}

/// One line per state: lockdb, paydb, the rail, the workers.
pub fn describe(s: &State) -> String {
    let mut out = String::new();
    let holder = match s.lock.holder {
        Some((w, t)) => format!("w{w}/t{t}"),
        None => "-".into(),
    };
    let _ = write!(out, "lockdb seq={} grant={holder}", s.lock.seq);
    if s.lock_standby.is_some() {
        out.push_str(" (standby lagging)");
    }
    match s.revocation {
        Some((floor, false)) => {
            let _ = write!(out, " (revocation t{floor}: fence next)");
        }
        Some((floor, true)) => {
            let _ = write!(out, " (revocation t{floor}: mark next)");
        }
        None => {}
    }
    let _ = write!(out, " | paydb fence={} mark={}", s.pay.fence, s.pay.mark);
    for (p, payout) in s.payouts().iter().enumerate() {
        let _ = write!(out, " P{p}={}", payout_name(*payout));
    }
    if s.pay_standby.is_some() {
        out.push_str(" (standby lagging)");
    }
    if s.pay_recovering {
        out.push_str(" (new epoch, awaiting recovery)");
    }
    out.push_str(" | rail");
    for (p, n) in s.rails().iter().enumerate() {
        let _ = write!(out, " P{p}x{n}");
    }
    out.push_str(" |");
    for (w, worker) in s.workers().iter().enumerate() {
        let _ = write!(out, " w{w}:{}", worker_name(*worker));
    }
    out
}

fn payout_name(p: Payout) -> String {
    match p {
        Payout::Pending => "PENDING".into(),
        Payout::Claimed(t) => format!("CLAIMED@t{t}"),
        Payout::Submitting(t) => format!("SUBMITTING@t{t}"),
        Payout::Acked(t) => format!("RAIL_ACKED@t{t}"),
        Payout::Posted => "POSTED".into(),
        Payout::Ambiguous => "RAIL_AMBIGUOUS".into(),
    }
}

fn worker_name(w: Worker) -> String {
    match w {
        Worker::Idle => "idle".into(),
        Worker::Holding(g) => format!("holds t{} (grant #{})", g.token, g.issued),
        Worker::Claimed(g, p) => format!("claimed P{p} t{}", g.token),
        Worker::Forwarding(g, p, _) => format!("forwarding P{p} t{}", g.token),
        Worker::Acked(g, p) => format!("acked P{p} t{}", g.token),
        Worker::NoAnswer(g, p, _) => format!("no answer P{p} t{}", g.token),
    }
}

/// One step in words, with what the database answered where a write was tried.
pub fn narrate(before: &State, action: Action, after: &State) -> String {
    let idle = |w: u8| after.workers[w as usize] == Worker::Idle;
    match action {
        Action::Acquire(w) => format!("w{w} acquires the key: token t{}", after.lock.seq),
        Action::Expire => "the grant's lease runs out (its holder is not told)".into(),
        Action::Claim(w, p) => format!(
            "w{w} claims P{p}{}",
            if idle(w) { ": refused" } else { ": admitted" }
        ),
        Action::Submit(w) => format!(
            "w{w} {} the rail proxy{}",
            if matches!(before.workers[w as usize], Worker::NoAnswer(..)) {
                "sends its submission again to"
            } else {
                "submits its payout to"
            },
            if idle(w) {
                ": refused"
            } else {
                ": admitted, intent committed, forward starts"
            }
        ),
        Action::RailAck(w) => format!("the rail receives w{w}'s forward and its answer comes back"),
        Action::RailAnswerLost(w) => {
            format!("the rail receives w{w}'s forward; the answer is lost (timeout)")
        }
        Action::RailRequestLost(w) => {
            format!("w{w}'s forward is lost before the rail (the proxy sees a timeout)")
        }
        Action::Post(w, p) => format!(
            "w{w} posts P{p}{}",
            if after.pay.payouts[p as usize] == Payout::Posted
                && before.pay.payouts[p as usize] != Payout::Posted
            {
                ": admitted"
            } else {
                ": refused"
            }
        ),
        Action::Release(w) => format!("w{w} ends its cycle and releases"),
        Action::Revoke => format!("the operator revokes the grant: floor t{}", after.lock.seq),
        Action::RevokeFence => "the revocation's floor reaches the account fence".into(),
        Action::RevokeMark => {
            "the revocation's floor reaches the rail mark: the revocation is complete".into()
        }
        Action::LockStandbyLags => "lockdb's standby stops replicating".into(),
        Action::LockFailover => {
            "lockdb fails over to its standby: the writes since are lost".into()
        }
        Action::PayStandbyLags => "paydb's standby stops replicating".into(),
        Action::PayFailover => "paydb fails over to its standby: the writes since are lost".into(),
        Action::PayRecover => {
            "the operator's recovery of paydb runs (the forwards in flight have ended)".into()
        }
    }
}

/// A discovery path, one numbered step per line: the action, then the state it led to.
pub fn render_path(path: &stateright::Path<State, Action>) -> String {
    let mut out = String::new();
    let steps = path.clone().into_vec();
    if let Some((first, _)) = steps.first() {
        let _ = writeln!(out, "  start: {}", describe(first));
    }
    // Each state is paired with the action taken from it; the last has none.
    for (i, window) in steps.windows(2).enumerate() {
        if let [(before, Some(action)), (after, _)] = window {
            let _ = writeln!(
                out,
                "  {:>2}. {}\n      {}",
                i + 1,
                narrate(before, *action, after),
                describe(after)
            );
        }
    }
    out
}
