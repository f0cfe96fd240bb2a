-- Two functions that nothing runs any more. The schema keeps what runs; a function left behind
-- reads as a path the payouts still take.
--
-- pay_ledger_apply (0038_baseline_guards.sql): the ledger's trigger as it was before it was made
-- statement-level (pay_ledger_apply_rows runs now). No trigger has run it since; the payouts
-- bench put it back on a second database to compare the two, and that comparison is retired
-- (docs/benchmarks.md#running-the-benchmarks).
--
-- pay_request_funding (0039_baseline_payment_writes.sql): recorded a funding that waits for a
-- second treasury approval. pay_fund_as records it itself, in the transaction of its checks, and
-- is the only way the payment resource records one.
--
-- IF EXISTS: a database that was built with both already gone takes this as done.
DROP FUNCTION IF EXISTS pay_ledger_apply();
DROP FUNCTION IF EXISTS pay_request_funding(uuid, text, bigint, text, text);
