//! Group commit's queue (docs/design.md#group-commit): requests of one kind that arrive while a
//! transaction of their kind runs wait here, and the next transaction takes them together.
//!
//! No timer: a request that finds nothing running starts a batch once the tasks that are ready at
//! that moment have had their turn (a yield to the runtime), and again while a turn added requests,
//! up to [`GATHER_TURNS`] turns or a full batch: the requests one answer woke go together, a lone
//! request goes straight through after one turn, and the batch size follows the load. Without the
//! turns the runtime runs the new batch's task first and takes its request alone. Measured with
//! scripts/run-processes in alternated pairs (docs/benchmarks.md): one turn made a new user's run
//! 8–13 % faster with as much less CPU per payout, and turns while the queue grows took another
//! 0–12 % of the time and 6 % of the CPU (3.64 against 3.87 ms per payout, four pairs).
//!
//! A batch takes up to `max` waiting items in arrival order, none of which shares a key with an
//! item already taken (the others wait one round). The runner answers every item of its batch, in
//! order; no answer leaves before the runner returns, so no answer leaves before its batch's
//! transaction committed (or failed).
//!
//! A client's queue is [`GroupCommit::pipelined`]: a batch forms only while the tasks that are
//! ready to run have their turn, then leaves, and the next request starts the next batch
//! instead of waiting for the answer of the one in flight. Behind a slow answer (a rail taking
//! seconds) nothing queues, and the batch size still follows the load: the workers one answer
//! wakes reach their next step together.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// How many turns of the runtime a batch that finds nothing running waits at most for more
/// requests, while each turn adds some (the module's documentation).
const GATHER_TURNS: usize = 5;

/// What a batch does with its items: answers each, in order.
pub type Runner<C, I, O> = fn(C, Vec<I>) -> Pin<Box<dyn Future<Output = Vec<O>> + Send + 'static>>;

/// Told the queue's length after every change, and each batch's size as it starts.
pub trait Observer: Send + Sync {
    fn queued(&self, waiting: usize);
    fn batch(&self, size: usize);
}

/// A queue of requests of one kind and the one batch of them that runs at a time.
pub struct GroupCommit<C, I, O> {
    queue: Arc<Mutex<Queue<I, O>>>,
    max: usize,
    run: Runner<C, I, O>,
    /// The keys an item holds in its batch: two items sharing one never go in the same batch.
    keys: fn(&I) -> Vec<String>,
    observer: Arc<dyn Observer>,
    /// Batches leave without waiting for the answer of the one before ([`Self::pipelined`]).
    pipelined: bool,
}

impl<C, I, O> Clone for GroupCommit<C, I, O> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            max: self.max,
            run: self.run,
            keys: self.keys,
            observer: self.observer.clone(),
            pipelined: self.pipelined,
        }
    }
}

struct Queue<I, O> {
    running: bool,
    waiting: VecDeque<(I, oneshot::Sender<O>)>,
}

impl<C, I, O> GroupCommit<C, I, O>
where
    C: Clone + Send + 'static,
    I: Send + 'static,
    O: Send + 'static,
{
    pub fn new(
        max: usize,
        keys: fn(&I) -> Vec<String>,
        run: Runner<C, I, O>,
        observer: Arc<dyn Observer>,
    ) -> Self {
        Self {
            queue: Arc::new(Mutex::new(Queue {
                running: false,
                waiting: VecDeque::new(),
            })),
            max: max.max(1),
            run,
            keys,
            observer,
            pipelined: false,
        }
    }

    /// As a client's queue: batches form while the ready tasks have their turn and never wait
    /// for the answer of a batch in flight (see the module's documentation).
    pub fn pipelined(self) -> Self {
        Self {
            pipelined: true,
            ..self
        }
    }

    /// Queues `item` and waits for its answer, which comes after its batch ran. `None` when its
    /// batch's task died without answering (a bug; the caller answers it as a server fault).
    pub async fn submit(&self, context: C, item: I) -> Option<O> {
        let (tx, rx) = oneshot::channel();
        let start = match self.queue.lock() {
            Ok(mut queue) => {
                queue.waiting.push_back((item, tx));
                self.observer.queued(queue.waiting.len());
                !std::mem::replace(&mut queue.running, true)
            }
            Err(_) => return None,
        };
        if start {
            tokio::spawn(self.clone().drive(context));
        }
        rx.await.ok()
    }

    /// Runs batches until the queue is empty.
    async fn drive(self, context: C) {
        // The first batch forms while every task that is ready now has its turn: the others an
        // answer woke reach this step and queue. Again while a turn added requests (they may
        // have had a step of their own to take first), up to GATHER_TURNS turns or a full batch.
        // A lone request waits for no timer: one turn that adds nothing.
        let mut waiting = self.waiting();
        for _ in 0..GATHER_TURNS {
            tokio::task::yield_now().await;
            let now = self.waiting();
            if now <= waiting || now >= self.max {
                break;
            }
            waiting = now;
        }
        while let Some((items, answers)) = self.take() {
            self.observer.batch(items.len());
            // Its own task: a panic in a batch answers its items `None` and the queue goes on.
            let batch = tokio::spawn((self.run)(context.clone(), items));
            let answered = async move {
                if let Ok(outs) = batch.await {
                    for (answer, out) in answers.into_iter().zip(outs) {
                        let _ = answer.send(out);
                    }
                }
            };
            match self.pipelined {
                true => drop(tokio::spawn(answered)),
                false => answered.await,
            }
        }
    }

    /// How many requests wait.
    fn waiting(&self) -> usize {
        self.queue.lock().map_or(0, |queue| queue.waiting.len())
    }

    /// The next batch, or `None` (and the queue marked idle) when nothing waits.
    #[allow(clippy::type_complexity)]
    fn take(&self) -> Option<(Vec<I>, Vec<oneshot::Sender<O>>)> {
        let Ok(mut queue) = self.queue.lock() else {
            return None;
        };
        if queue.waiting.is_empty() {
            queue.running = false;
            return None;
        }
        let mut taken: HashSet<String> = HashSet::new();
        let (mut items, mut answers, mut later) = (Vec::new(), Vec::new(), VecDeque::new());
        while let Some((item, answer)) = queue.waiting.pop_front() {
            let keys = (self.keys)(&item);
            if items.len() < self.max && keys.iter().all(|k| !taken.contains(k)) {
                taken.extend(keys);
                items.push(item);
                answers.push(answer);
            } else {
                later.push_back((item, answer));
            }
        }
        queue.waiting = later;
        self.observer.queued(queue.waiting.len());
        Some((items, answers))
    }
}

/// The answers of a batch's `n` items in item order, from rows that name their item (1-based, as
/// the `*_many` functions number them); an item without a row is `None`. `Err` names a row whose
/// item is not one of the batch's.
pub fn by_item<T>(
    n: usize,
    rows: impl IntoIterator<Item = (i32, T)>,
) -> Result<Vec<Option<T>>, i32> {
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for (item, answer) in rows {
        let slot = usize::try_from(item - 1)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or(item)?;
        *slot = Some(answer);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_go_to_their_item_and_a_stranger_is_named() {
        assert_eq!(
            by_item(3, [(3, 'c'), (1, 'a')]),
            Ok(vec![Some('a'), None, Some('c')])
        );
        assert_eq!(by_item(2, [(1, 'a'), (3, 'c')]), Err(3));
        assert_eq!(by_item(2, [(0, 'z')]), Err(0));
    }

    /// (payout, account, n)
    type Item = (&'static str, &'static str, u32);
    type Test = GroupCommit<(), Item, u32>;

    struct Quiet;
    impl Observer for Quiet {
        fn queued(&self, _: usize) {}
        fn batch(&self, _: usize) {}
    }

    fn echo(_: (), items: Vec<Item>) -> Pin<Box<dyn Future<Output = Vec<u32>> + Send>> {
        Box::pin(async move { items.into_iter().map(|(_, _, n)| n).collect() })
    }

    /// Answers each item with its batch's size.
    fn echo_sizes(_: (), items: Vec<Item>) -> Pin<Box<dyn Future<Output = Vec<u32>> + Send>> {
        let n = u32::try_from(items.len()).unwrap_or(u32::MAX);
        Box::pin(async move { items.iter().map(|_| n).collect() })
    }

    fn keys(item: &Item) -> Vec<String> {
        vec![format!("payout:{}", item.0), format!("account:{}", item.1)]
    }

    fn queue(max: usize) -> Test {
        GroupCommit::new(max, keys, echo, Arc::new(Quiet))
    }

    /// Queues items without starting a batch, as if one were running.
    fn push(q: &Test, items: &[Item]) -> Vec<oneshot::Receiver<u32>> {
        let mut queue = q.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.running = true;
        items
            .iter()
            .map(|item| {
                let (tx, rx) = oneshot::channel();
                queue.waiting.push_back((*item, tx));
                rx
            })
            .collect()
    }

    fn taken(q: &Test) -> Vec<u32> {
        q.take()
            .map(|(items, _)| items.into_iter().map(|(_, _, n)| n).collect())
            .unwrap_or_default()
    }

    #[test]
    fn a_batch_takes_at_most_max_and_one_per_key_in_arrival_order() {
        let q = queue(3);
        let _answers = push(
            &q,
            &[
                ("p1", "a", 1),
                ("p1", "b", 2), // p1 taken
                ("p2", "a", 3), // account a taken
                ("p3", "b", 4),
                ("p4", "c", 5),
                ("p5", "d", 6), // max 3
            ],
        );
        assert_eq!(taken(&q), vec![1, 4, 5]);
        assert_eq!(taken(&q), vec![2, 3, 6]);
        // Empty: the queue is idle again, so the next request starts a batch at once.
        assert!(q.take().is_none());
        assert!(!q.queue.lock().unwrap_or_else(|e| e.into_inner()).running);
    }

    /// Answers after `n` ms: a batch's answer that takes its time.
    fn slow(_: (), items: Vec<Item>) -> Pin<Box<dyn Future<Output = Vec<u32>> + Send>> {
        Box::pin(async move {
            let n = items.first().map_or(0, |(_, _, n)| *n);
            tokio::time::sleep(std::time::Duration::from_millis(u64::from(n))).await;
            items.into_iter().map(|(_, _, n)| n).collect()
        })
    }

    /// Counts the batches that started.
    #[derive(Default)]
    struct Started(std::sync::atomic::AtomicUsize);
    impl Observer for Started {
        fn queued(&self, _: usize) {}
        fn batch(&self, _: usize) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_pipelined_queue_never_holds_a_request_behind_a_batch_in_flight() {
        for (pipelined, fast_first) in [(true, true), (false, false)] {
            let started = Arc::new(Started::default());
            let observer: Arc<dyn Observer> = started.clone();
            let q: Test = match pipelined {
                true => GroupCommit::new(8, keys, slow, observer).pipelined(),
                false => GroupCommit::new(8, keys, slow, observer),
            };
            let slow_one = tokio::spawn({
                let q = q.clone();
                async move { q.submit((), ("p1", "a", 500)).await }
            });
            // The slow batch has left: its request is in flight.
            while started.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
            tokio::task::yield_now().await;
            let fast_one = q.submit((), ("p2", "b", 1));
            let first = tokio::select! {
                biased;
                answer = fast_one => answer,
                answer = slow_one => answer.ok().flatten(),
            };
            // Pipelined, the fast request is answered first; serial (the positive control for
            // what this test can see), it waits for the slow batch's answer.
            assert_eq!(first == Some(1), fast_first, "pipelined: {pipelined}");
        }
    }

    /// Five requests p0..p4 of distinct keys, spawned by one task on the runtime, so all five
    /// are queued before any of them runs, whatever else the machine is doing; request n first
    /// takes `own_turns(n)` turns of its own. Each answer is the size of its batch.
    async fn five_requests(q: Test, own_turns: fn(u32) -> u32) -> Option<Vec<Option<u32>>> {
        tokio::spawn(async move {
            let calls: Vec<_> = ["p0", "p1", "p2", "p3", "p4"]
                .into_iter()
                .zip(0u32..)
                .map(|(payout, n)| {
                    let q = q.clone();
                    tokio::spawn(async move {
                        for _ in 0..own_turns(n) {
                            tokio::task::yield_now().await;
                        }
                        q.submit((), (payout, payout, n)).await
                    })
                })
                .collect();
            let mut sizes = Vec::new();
            for call in calls {
                sizes.push(call.await.ok().flatten());
            }
            sizes
        })
        .await
        .ok()
    }

    #[tokio::test]
    async fn a_pipelined_queue_batches_the_requests_that_are_ready_together() {
        let q: Test = GroupCommit::new(8, keys, echo_sizes, Arc::new(Quiet)).pipelined();
        let sizes = five_requests(q, |_| 0).await;
        assert_eq!(sizes, Some(vec![Some(5); 5]), "one batch of five");
    }

    /// The runtime's scheduler runs a task a worker has just spawned before the tasks already
    /// queued (its LIFO slot), so without the yield the first request's batch would leave with
    /// that request alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_serial_queue_batches_the_requests_that_are_ready_together() {
        let q: Test = GroupCommit::new(8, keys, echo_sizes, Arc::new(Quiet));
        let sizes = five_requests(q, |_| 0).await;
        assert_eq!(sizes, Some(vec![Some(5); 5]), "one batch of five");
    }

    /// Requests that reach the queue a turn later (their task had a step of its own first) join
    /// the batch too, as long as each turn adds some: p3 and p4 take one and two turns first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_batch_waits_while_each_turn_adds_requests() {
        let q: Test = GroupCommit::new(8, keys, echo_sizes, Arc::new(Quiet));
        let sizes = five_requests(q, |n| n.saturating_sub(2)).await;
        assert_eq!(sizes, Some(vec![Some(5); 5]), "one batch of five");
    }

    /// Holds each batch of [`gated`] until it gives a permit, and counts the batches that
    /// finished.
    #[derive(Clone)]
    struct Gate {
        permits: Arc<tokio::sync::Semaphore>,
        finished: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Default for Gate {
        fn default() -> Self {
            Self {
                permits: Arc::new(tokio::sync::Semaphore::new(0)),
                finished: Arc::default(),
            }
        }
    }

    type Gated = GroupCommit<Gate, Item, u32>;

    /// Answers each item with its `n` once the gate gives the batch a permit.
    fn gated(gate: Gate, items: Vec<Item>) -> Pin<Box<dyn Future<Output = Vec<u32>> + Send>> {
        Box::pin(async move {
            if let Ok(permit) = gate.permits.acquire().await {
                permit.forget();
            }
            gate.finished
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            items.into_iter().map(|(_, _, n)| n).collect()
        })
    }

    /// A request dropped while its batch runs (its client went away, its deadline passed) stops
    /// neither that batch nor the queue: the batch finishes and the request queued behind it is
    /// answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_request_stops_neither_its_batch_nor_the_queue() {
        let started = Arc::new(Started::default());
        let observer: Arc<dyn Observer> = started.clone();
        let gate = Gate::default();
        let q: Gated = GroupCommit::new(8, keys, gated, observer);
        let dropped = tokio::spawn({
            let (q, gate) = (q.clone(), gate.clone());
            async move { q.submit(gate, ("p1", "a", 1)).await }
        });
        while started.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // Queued behind the batch in flight.
        let behind = tokio::spawn({
            let (q, gate) = (q.clone(), gate.clone());
            async move { q.submit(gate, ("p2", "b", 2)).await }
        });
        while q.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        dropped.abort();
        assert!(dropped.await.is_err_and(|e| e.is_cancelled()));
        assert_eq!(gate.finished.load(std::sync::atomic::Ordering::SeqCst), 0);
        gate.permits.add_permits(2);
        let answer = tokio::time::timeout(std::time::Duration::from_secs(10), behind).await;
        assert!(
            matches!(answer, Ok(Ok(Some(2)))),
            "the answer of the request behind: {answer:?}"
        );
        assert_eq!(
            gate.finished.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "the dropped request's batch finished too"
        );
    }

    /// Panics on an item whose `n` is 0.
    fn panics_on_zero(_: (), items: Vec<Item>) -> Pin<Box<dyn Future<Output = Vec<u32>> + Send>> {
        Box::pin(async move {
            assert!(items.iter().all(|(_, _, n)| *n != 0), "a bug in a batch");
            items.into_iter().map(|(_, _, n)| n).collect()
        })
    }

    /// Without its task of its own, the panic would end the queue's task with the queue marked
    /// running, and the next request would wait for ever (here: 10 s, then fail).
    #[tokio::test]
    async fn a_batch_that_panics_answers_none_and_the_queue_goes_on() {
        let q = GroupCommit::new(8, keys, panics_on_zero, Arc::new(Quiet));
        let within = |request| tokio::time::timeout(std::time::Duration::from_secs(10), request);
        assert_eq!(within(q.submit((), ("p", "a", 0))).await, Ok(None));
        assert_eq!(within(q.submit((), ("p", "a", 4))).await, Ok(Some(4)));
    }

    #[tokio::test]
    async fn a_lone_request_is_answered_without_waiting_for_more() {
        let q = queue(32);
        assert_eq!(q.submit((), ("p", "a", 7)).await, Some(7));
        assert_eq!(q.submit((), ("p", "a", 8)).await, Some(8));
    }
}
