-- Issue 14: the lock server's functions parsed and planned three helpers on every call.
--
-- dlock_session_state, dlock_waiter_count and dlock_holder were LANGUAGE sql. A SQL function
-- whose body has a FROM clause is not inlined into its caller, and PostgreSQL (before 18) parses
-- and plans such a body again on every call from PL/pgSQL, because the caller's expression state
-- lives for one transaction only. Every acquire paid that three times: 0.75 ms of its 0.88 ms in
-- the database were the parser and the planner, not the reads and writes. In PL/pgSQL the same
-- queries are planned once per connection and the plans are kept.
--
-- Same arguments, same result, same queries, same volatility (STABLE: they read with the snapshot
-- of the statement that calls them, as before), so every caller is unchanged.

CREATE OR REPLACE FUNCTION dlock_session_state(p_session uuid, p_owner text, p_now timestamptz)
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT CASE
                WHEN s.session_id IS NULL OR s.owner_id <> p_owner THEN 'session_unknown'
                WHEN s.expires_at <= p_now THEN 'session_expired'
                ELSE 'live'
            END
            FROM (SELECT 1) AS one
            LEFT JOIN sessions s ON s.session_id = p_session);
END $$;

CREATE OR REPLACE FUNCTION dlock_waiter_count(p_key text, p_now timestamptz)
RETURNS bigint LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT count(*) FROM lock_waiters w JOIN sessions s ON s.session_id = w.session_id
            WHERE w.lock_key = p_key AND w.deadline > p_now AND s.expires_at > p_now);
END $$;

CREATE OR REPLACE FUNCTION dlock_holder(p_key text, p_outcome text, p_now timestamptz)
RETURNS dlock_result LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT ROW(p_outcome, l.fencing_token, l.owner_id, l.session_id, l.acquired_at,
                       l.expires_at, dlock_waiter_count(p_key, p_now), p_now)::dlock_result
            FROM (SELECT 1) AS one
            LEFT JOIN (locks l JOIN sessions s ON s.session_id = l.session_id AND s.expires_at > p_now)
                   ON l.lock_key = p_key AND l.expires_at > p_now);
END $$;
