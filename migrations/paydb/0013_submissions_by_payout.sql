-- A payout's read (P4, GET /v1/payouts/{id}: the executor's re-read after every acquire, FR-14)
-- lists the payout's attempts, FENCED ones included, in the order they were presented. The only
-- index on rail_submission.payout_id is FR-18's partial unique index, which leaves FENCED
-- attempts out, so that read scanned the whole table: 0.77 ms per read with about 6 000
-- attempts in the payouts bench, and linear in the table's size.
--
-- The build holds writes to rail_submission (new submissions wait) while it runs. On a large
-- database, build the same index beforehand without blocking, under the same name:
--   CREATE INDEX CONCURRENTLY rail_submission_payout_idx
--       ON rail_submission (payout_id, submitted_at, submission_id);
-- and this migration finds it and does nothing. (If that build fails, drop the INVALID index it
-- leaves before starting the services.)
CREATE INDEX IF NOT EXISTS rail_submission_payout_idx
    ON rail_submission (payout_id, submitted_at, submission_id);
