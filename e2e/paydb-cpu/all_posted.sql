-- Included by payouts.sql and batches.sql after their run: every one of the :N payouts must
-- have been posted, or the figures measured something else, and the run fails.
SELECT count(*) AS posted FROM payouts WHERE state = 'POSTED' \gset
SELECT :posted = :N AS all_posted \gset
\if :all_posted
\else
\echo 'not every payout was posted: the probe no longer matches the functions'
SELECT 1/0;
\endif
