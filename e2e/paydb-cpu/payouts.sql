-- One payout's paydb statements, N times, in one backend (see scripts/paydb-cpu). The arguments
-- are the ones the payment resource and the rail proxy pass; each step commits on its own.
\pset footer off
SELECT pay_create_account('acct-' || i, 'EUR') FROM generate_series(1, 100) i \g /dev/null
SELECT pay_fund('acct-' || i, 1000000000, 'fund-' || i) FROM generate_series(1, 100) i \g /dev/null
SELECT pay_create_payout(md5('p' || i)::uuid, 'acct-' || (i % 100 + 1), 100, 'EUR', 'ben-' || i)
  FROM generate_series(1, :N) i \g /dev/null
CREATE TABLE raw_rows (id integer PRIMARY KEY, v bigint NOT NULL);
INSERT INTO raw_rows SELECT i, 0 FROM generate_series(1, 100) i;

CREATE PROCEDURE probe_payouts(n integer) LANGUAGE plpgsql AS $$
DECLARE
    payout uuid; account text; submission uuid; token bigint := 1000; r record; k text;
BEGIN
    FOR i IN 1..n LOOP
        payout := md5('p' || i)::uuid;
        account := 'acct-' || (i % 100 + 1);
        token := token + 1;
        k := 'key-' || i;
        -- P2: the payment resource's claim and its stored answer.
        SELECT * INTO r FROM pay_claim_once('claim', k, token, 'owner', sha256(k::bytea),
                                            86400000, 1000, payout, 'PENDING', 5);
        UPDATE idempotency_records SET status = 'succeeded', response_status = 200,
               response_body = '\x7b7d'
         WHERE route = 'claim' AND idempotency_key = k AND fencing_token = token
           AND status = 'in_progress';
        COMMIT;
        -- The rail proxy: admission, then the rail's acknowledgement.
        submission := gen_random_uuid();
        SELECT * INTO r FROM rail_admit(payout, account, 100, 'EUR', 'ben-' || i, token, k,
                                        submission, '{"payoutId":"' || payout || '"}', true);
        COMMIT;
        SELECT * INTO r FROM rail_record(submission, 'ACKED', 'ref-' || i);
        COMMIT;
        -- P3: the post with its two entries, and its stored answer.
        SELECT * INTO r FROM pay_post_once('post', k, token, 'owner', sha256(k::bytea), 86400000,
                                           1000, payout, 'ref-' || i, submission);
        UPDATE idempotency_records SET status = 'succeeded', response_status = 200,
               response_body = '\x7b7d'
         WHERE route = 'post' AND idempotency_key = k AND fencing_token = token
           AND status = 'in_progress';
        COMMIT;
    END LOOP;
END $$;

CREATE PROCEDURE probe_raw(n integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        UPDATE raw_rows SET v = v + 1 WHERE id = i % 100 + 1 AND v >= 0;
        COMMIT;
    END LOOP;
END $$;

\ir probe.sql

SELECT probe_cpu_ms() AS c0 \gset
CALL probe_payouts(:N);
SELECT probe_cpu_ms() AS c1 \gset
CALL probe_raw(:N * 4);
SELECT probe_cpu_ms() AS c2 \gset
\ir all_posted.sql
SELECT :N AS payouts,
       round((:c1 - :c0) / :N, 3) AS "paydb CPU ms per payout",
       round((:c2 - :c1) / (:N * 4), 3) AS "raw commit CPU ms",
       round(((:c1 - :c0) / :N) / nullif((:c2 - :c1) / (:N * 4), 0), 1) AS "payout / raw commit";
