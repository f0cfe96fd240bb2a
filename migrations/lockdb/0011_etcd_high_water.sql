-- lockdb 0011: the highest fencing token a lock server on etcd has answered, kept outside etcd
-- (docs/design.md#d-12-etcd).
--
-- On etcd a token is the revision of the grant's create. A restore of etcd (a snapshot, an older
-- data directory put back) takes the revision back, and with it anything kept in etcd, so the
-- tokens etcd hands out next may be ones the lock server already answered. With
-- `lock.etcd.high-water.url` set, every replica records each token here before answering it and
-- answers it only if it is above every token recorded before; `name` is the etcd prefix
-- (`lock.etcd.prefix`), one row per key space. Used by no lock server on PostgreSQL.
-- Written to run again harmlessly (dlock/tests/it/squash.rs applies migrations twice).

CREATE TABLE IF NOT EXISTS etcd_high_water (
    name       text PRIMARY KEY,
    token      bigint NOT NULL CHECK (token >= 0),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Records `p_token` as answered under `p_name` if it is above the high-water, and returns the
-- high-water as it was before (0 for a name never seen). The row lock orders every replica's
-- records, so a caller that gets back less than its token knows that its token is above every
-- token any replica recorded before; one that gets back as much or more must not answer its
-- token (a restore of etcd, or a concurrent grant that recorded a later revision first).
CREATE OR REPLACE FUNCTION dlock_etcd_high_water(p_name text, p_token bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_previous bigint;
BEGIN
    SELECT token INTO v_previous FROM etcd_high_water WHERE name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO etcd_high_water (name, token) VALUES (p_name, p_token)
        ON CONFLICT (name) DO NOTHING;
        IF FOUND THEN
            RETURN 0;
        END IF;
        SELECT token INTO v_previous FROM etcd_high_water WHERE name = p_name FOR UPDATE;
    END IF;
    IF p_token > v_previous THEN
        UPDATE etcd_high_water SET token = p_token, updated_at = clock_timestamp()
        WHERE name = p_name;
    END IF;
    RETURN v_previous;
END
$$;
