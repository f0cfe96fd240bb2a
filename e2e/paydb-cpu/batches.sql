-- The paydb statements of N payouts as the batching services run them (see scripts/paydb-cpu
-- --batch): K payouts of K accounts at a time, the payment resource's claim (pay_claim_many and
-- its stored answers in one commit), the rail proxy's admissions and records (rail_admit_many,
-- rail_record_many) in batches of R, and the post (pay_post_many and its answers in one
-- commit), in one backend. Printed: that backend's CPU (user + system, from /proc) per payout
-- for each step and in all, beside the raw baseline in the same backend: one conditional UPDATE
-- per commit, and K of them per commit.
\pset footer off
SELECT pay_create_account('acct-' || i, 'EUR') FROM generate_series(1, 1000) i \g /dev/null
SELECT pay_fund('acct-' || i, 1000000000, 'fund-' || i) FROM generate_series(1, 1000) i \g /dev/null
SELECT pay_create_payout(md5('p' || i)::uuid, 'acct-' || ((i - 1) % 1000 + 1), 100, 'EUR',
                         'ben-' || i)
  FROM generate_series(1, :N) i \g /dev/null
CREATE TABLE raw_rows (id integer PRIMARY KEY, v bigint NOT NULL);
INSERT INTO raw_rows SELECT i, 0 FROM generate_series(1, 1000) i;

\ir probe.sql

CREATE TABLE probe_steps (pos integer PRIMARY KEY, step text NOT NULL, ms numeric NOT NULL DEFAULT 0);
INSERT INTO probe_steps (pos, step) VALUES
    (1, 'claim (pay_claim_many)'), (2, 'claim''s answers and commit'),
    (3, 'admissions (rail_admit_many)'), (4, 'records (rail_record_many)'),
    (5, 'post (pay_post_many)'), (6, 'post''s answers and commit');

-- Adds this backend's CPU since `since` to step `pos`; returns the CPU now, where the next
-- step starts (the UPDATE itself counted in neither).
CREATE FUNCTION probe_lap(pos integer, since numeric) RETURNS numeric LANGUAGE plpgsql AS $$
BEGIN
    UPDATE probe_steps SET ms = ms + probe_cpu_ms() - since WHERE probe_steps.pos = probe_lap.pos;
    RETURN probe_cpu_ms();
END $$;

-- The stored answers of a batch of `route` (claim or post), as the payment resource stores them
-- after the batch's function: status 200 and its body for each key. Returns how many it stored.
CREATE FUNCTION probe_answers(route text, keys text[], tokens bigint[]) RETURNS integer
LANGUAGE sql AS $$
    SELECT pay_idempotency_finish_many(array_fill(route, ARRAY[cardinality(keys)]), keys, tokens,
                                       array_fill(200::smallint, ARRAY[cardinality(keys)]),
                                       array_fill('\x7b7d'::bytea, ARRAY[cardinality(keys)]))
$$;

CREATE PROCEDURE probe_batches(n integer, k integer, r integer) LANGUAGE plpgsql AS $$
DECLARE
    c0 numeric;
    ids integer[]; payouts uuid[]; accounts text[]; tokens bigint[]; keys text[];
    hashes bytea[]; subs uuid[]; owners text[]; ret bigint[];
    refused integer := 0;
BEGIN
    owners := array_fill('owner'::text, ARRAY[k]);
    ret := array_fill(86400000::bigint, ARRAY[k]);
    FOR b IN 0 .. n / k - 1 LOOP
        ids := ARRAY(SELECT g FROM generate_series(b * k + 1, b * k + k) g);
        payouts := ARRAY(SELECT md5('p' || g)::uuid FROM unnest(ids) g);
        accounts := ARRAY(SELECT 'acct-' || ((g - 1) % 1000 + 1) FROM unnest(ids) g);
        tokens := ARRAY(SELECT 1000 + g::bigint FROM unnest(ids) g);
        keys := ARRAY(SELECT 'key-' || g FROM unnest(ids) g);
        hashes := ARRAY(SELECT sha256(('key-' || g)::bytea) FROM unnest(ids) g);
        subs := ARRAY(SELECT gen_random_uuid() FROM unnest(ids) g);

        c0 := probe_cpu_ms();
        SELECT count(*) FILTER (WHERE outcome IS DISTINCT FROM 'claimed') INTO refused
          FROM pay_claim_many(array_fill('claim'::text, ARRAY[k]), keys, tokens, owners, hashes,
                              ret, 1000, payouts, array_fill('PENDING'::text, ARRAY[k]), 5, true);
        c0 := probe_lap(1, c0);
        refused := refused + k - probe_answers('claim', keys, tokens);
        COMMIT;
        c0 := probe_lap(2, c0);

        FOR j IN 0 .. k / r - 1 LOOP
            SELECT refused + count(*) FILTER (WHERE outcome IS DISTINCT FROM 'admitted')
              INTO refused
              FROM rail_admit_many(payouts[j*r+1 : j*r+r], accounts[j*r+1 : j*r+r],
                                   array_fill(100::bigint, ARRAY[r]),
                                   array_fill('EUR'::text, ARRAY[r]),
                                   ARRAY(SELECT 'ben-' || g FROM unnest(ids[j*r+1 : j*r+r]) g),
                                   tokens[j*r+1 : j*r+r], keys[j*r+1 : j*r+r],
                                   subs[j*r+1 : j*r+r],
                                   ARRAY(SELECT '{"payoutId":"' || md5('p' || g)::uuid || '"}'
                                           FROM unnest(ids[j*r+1 : j*r+r]) g), true);
            COMMIT;
        END LOOP;
        c0 := probe_lap(3, c0);
        FOR j IN 0 .. k / r - 1 LOOP
            PERFORM 1 FROM rail_record_many(subs[j*r+1 : j*r+r], array_fill('ACKED'::text, ARRAY[r]),
                                            ARRAY(SELECT 'ref-' || g
                                                    FROM unnest(ids[j*r+1 : j*r+r]) g));
            COMMIT;
        END LOOP;
        c0 := probe_lap(4, c0);

        SELECT refused + count(*) FILTER (WHERE outcome IS DISTINCT FROM 'posted') INTO refused
          FROM pay_post_many(array_fill('post'::text, ARRAY[k]), keys, tokens, owners, hashes,
                             ret, 1000, payouts,
                             ARRAY(SELECT 'ref-' || g FROM unnest(ids) g), subs, true);
        c0 := probe_lap(5, c0);
        refused := refused + k - probe_answers('post', keys, tokens);
        COMMIT;
        c0 := probe_lap(6, c0);
        IF refused > 0 THEN
            RAISE EXCEPTION '% items of batch % were not claimed, answered, admitted or posted: the probe '
                            'no longer matches the functions', refused, b;
        END IF;
    END LOOP;
END $$;

-- The raw baseline: m conditional UPDATEs of rows of their own per commit, n times.
CREATE PROCEDURE probe_raw(n integer, m integer) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        UPDATE raw_rows SET v = v + 1
         WHERE id BETWEEN (i * m) % 1000 + 1 AND (i * m) % 1000 + m AND v >= 0;
        COMMIT;
    END LOOP;
END $$;

CALL probe_batches(:N, :K, :R);
SELECT probe_cpu_ms() AS c1 \gset
CALL probe_raw(:N, 1);
SELECT probe_cpu_ms() AS c2 \gset
CALL probe_raw(:N / :K, :K);
SELECT probe_cpu_ms() AS c3 \gset
\ir all_posted.sql
\echo :N 'payouts; claims and posts in batches of' :K 'and admissions and records of' :R
SELECT step, round(ms / :N, 3) AS "paydb CPU ms per payout" FROM probe_steps ORDER BY pos;
SELECT round(sum(ms) / :N, 3) AS "paydb CPU ms per payout, in all",
       round((:c2 - :c1) / :N, 3) AS "raw: 1 update per commit, ms",
       round((:c3 - :c2) / :N, 3) AS "raw: K updates per commit, ms per update",
       round((sum(ms) / :N) / nullif((:c2 - :c1) / :N, 0), 1) AS "payout / raw commit"
  FROM probe_steps;
