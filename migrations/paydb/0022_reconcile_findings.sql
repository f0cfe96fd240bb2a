-- paydb 0022: an attempt whose outcome nobody recorded is resolved on the reconciler's finding,
-- and a POSTED reference belongs to one payout (docs/contract.md#resolve-evidence).
--
-- 1. reconcile_findings: what `dlock reconcile` found for each RAIL_AMBIGUOUS payout it
--    classified against the rail's statement, append-only: present on the statement under the
--    rail's reference, or absent from a statement read at statement_read_at, with the
--    settlement window the reconciler ran with. Written through pay_record_finding.
-- 2. pay_resolve, as in 0014, and when the rail proxy recorded the attempt but no answer (a
--    timeout, a reset, a proxy that died): FAILED needs an absent finding read at least the
--    settlement window after the attempt was submitted (and no present finding); POSTED needs a
--    present finding under the same reference.
-- 3. A POSTED resolution's reference is refused when the rail acknowledged it for another
--    payout, another payout holds it, or a resolution recorded it for another payout
--    (resolution_references, unique by reference).
--
-- Can run again on a database that already has its changes (IF NOT EXISTS, OR REPLACE).

CREATE TABLE IF NOT EXISTS reconcile_findings (
    finding_id           bigserial PRIMARY KEY,
    payout_id            uuid NOT NULL REFERENCES payouts,
    verdict              text NOT NULL CHECK (verdict IN ('present', 'absent')),
    rail_reference       text CHECK (char_length(rail_reference) BETWEEN 1 AND 128),
    -- paydb's clock when the reconciler started reading the statement: not in the future.
    statement_read_at    timestamptz NOT NULL,
    settlement_window_ms bigint NOT NULL CHECK (settlement_window_ms >= 0),
    recorded_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    CHECK ((verdict = 'present') = (rail_reference IS NOT NULL)),
    CHECK (statement_read_at <= recorded_at)
);
CREATE INDEX IF NOT EXISTS reconcile_findings_payout ON reconcile_findings (payout_id);

-- Findings are evidence: nothing rewrites or removes one.
CREATE OR REPLACE FUNCTION pay_findings_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'reconcile_findings is append-only: % refused', TG_OP
        USING ERRCODE = 'check_violation';
END $$;
DROP TRIGGER IF EXISTS reconcile_findings_append_only ON reconcile_findings;
CREATE TRIGGER reconcile_findings_append_only BEFORE UPDATE OR DELETE ON reconcile_findings
    FOR EACH ROW EXECUTE FUNCTION pay_findings_append_only();
DROP TRIGGER IF EXISTS reconcile_findings_no_truncate ON reconcile_findings;
CREATE TRIGGER reconcile_findings_no_truncate BEFORE TRUNCATE ON reconcile_findings
    FOR EACH STATEMENT EXECUTE FUNCTION pay_findings_append_only();

-- The reconciler's record of one classification. A payout that is no longer RAIL_AMBIGUOUS
-- records nothing (finding_id NULL): it was resolved meanwhile.
CREATE OR REPLACE FUNCTION pay_record_finding(p_payout_id uuid, p_rail_reference text,
                                              p_statement_read_at timestamptz,
                                              p_settlement_window_ms bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO reconcile_findings (payout_id, verdict, rail_reference, statement_read_at,
                                    settlement_window_ms)
    SELECT p.payout_id, CASE WHEN p_rail_reference IS NULL THEN 'absent' ELSE 'present' END,
           p_rail_reference, p_statement_read_at, p_settlement_window_ms
      FROM payouts p WHERE p.payout_id = p_payout_id AND p.state = 'RAIL_AMBIGUOUS'
    RETURNING finding_id INTO v_id;
    RETURN v_id;
END $$;

-- The references resolutions recorded: one payout each.
CREATE TABLE IF NOT EXISTS resolution_references (
    rail_reference text PRIMARY KEY,
    payout_id      uuid NOT NULL UNIQUE REFERENCES payouts,
    recorded_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- As in 0014, with the outcomes:
--   reference_taken (POSTED under a reference the rail acknowledged for, or a resolution
--     recorded for, another payout),
--   no_absent_finding (FAILED of an attempt nobody recorded, without an absent finding read the
--     settlement window after the attempt, or with a present finding),
--   no_present_finding (POSTED of an attempt nobody recorded, without a present finding under
--     that reference).
CREATE OR REPLACE FUNCTION pay_resolve(p_payout_id uuid, p_outcome text, p_rail_reference text,
                                       p_operator text, p_evidence text, p_owner_id text,
                                       p_identity text)
RETURNS TABLE (outcome text, state text, account_id text, balance_minor bigint,
               recorded_outcome text, recorded_reference text, submission_id uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    p payouts%ROWTYPE;
    s rail_submission%ROWTYPE;
    v_balance bigint;
    v_acked text;
    v_rejected boolean;
    v_refusal text;
    v_found text;
BEGIN
    SELECT * INTO p FROM payouts x WHERE x.payout_id = p_payout_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::text, NULL::text, NULL::bigint, NULL::text,
                            NULL::text, NULL::uuid;
        RETURN;
    END IF;
    SELECT a.balance_minor INTO v_balance FROM accounts a WHERE a.account_id = p.account_id
       FOR UPDATE;
    IF p.state <> 'RAIL_AMBIGUOUS' THEN
        RETURN QUERY SELECT 'not_claimable'::text, p.state, p.account_id, v_balance, NULL::text,
                            NULL::text, NULL::uuid;
        RETURN;
    END IF;
    SELECT * INTO s FROM rail_submission r
     WHERE r.payout_id = p_payout_id AND r.outcome <> 'FENCED';
    v_acked := coalesce(CASE WHEN s.outcome = 'ACKED' THEN s.rail_reference END,
                        CASE WHEN s.late_outcome = 'ACKED' THEN s.late_rail_reference END,
                        p.rail_reference);
    v_rejected := coalesce(s.outcome = 'REJECTED' OR s.late_outcome = 'REJECTED', false);
    -- The latest present finding's reference, for the refusal's message.
    SELECT f.rail_reference INTO v_found FROM reconcile_findings f
     WHERE f.payout_id = p_payout_id AND f.verdict = 'present'
     ORDER BY f.finding_id DESC LIMIT 1;
    IF p_outcome = 'POSTED' AND v_acked IS NOT NULL AND v_acked <> p_rail_reference THEN
        v_refusal := 'reference_mismatch';
    ELSIF p_outcome = 'POSTED' AND v_rejected THEN
        v_refusal := 'rail_rejected';
    ELSIF p_outcome = 'FAILED' AND v_acked IS NOT NULL THEN
        v_refusal := 'rail_acked';
    ELSIF p_outcome = 'POSTED' AND (
            EXISTS (SELECT 1 FROM payouts o
                     WHERE o.rail_reference = p_rail_reference AND o.payout_id <> p_payout_id)
            OR EXISTS (SELECT 1 FROM rail_submission r
                        WHERE r.payout_id <> p_payout_id
                          AND (r.rail_reference = p_rail_reference
                               OR r.late_rail_reference = p_rail_reference))
            OR EXISTS (SELECT 1 FROM resolution_references q
                        WHERE q.rail_reference = p_rail_reference
                          AND q.payout_id <> p_payout_id)) THEN
        v_refusal := 'reference_taken';
    ELSIF (s.submission_id IS NOT NULL AND v_acked IS NULL AND NOT v_rejected)
          OR EXISTS (SELECT 1 FROM pay_epoch_quarantined q WHERE q.payout_id = p_payout_id) THEN
        -- The proxy recorded the attempt but nobody recorded the rail's answer, or the
        -- store-epoch recovery quarantined the payout because the rail has it while paydb lost
        -- its attempt (0021): the reconciler's finding decides.
        IF p_outcome = 'FAILED' AND (v_found IS NOT NULL OR NOT EXISTS (
                SELECT 1 FROM reconcile_findings f
                 WHERE f.payout_id = p_payout_id AND f.verdict = 'absent'
                   AND f.statement_read_at >= coalesce(s.submitted_at, p.updated_at)
                                              + f.settlement_window_ms * interval '1 millisecond'))
        THEN
            v_refusal := 'no_absent_finding';
        ELSIF p_outcome = 'POSTED' AND NOT EXISTS (
                SELECT 1 FROM reconcile_findings f
                 WHERE f.payout_id = p_payout_id AND f.verdict = 'present'
                   AND f.rail_reference = p_rail_reference) THEN
            v_refusal := 'no_present_finding';
        END IF;
    END IF;
    IF v_refusal IS NOT NULL THEN
        RETURN QUERY SELECT v_refusal, p.state, p.account_id, v_balance,
                            coalesce(s.late_outcome, s.outcome),
                            CASE WHEN v_refusal IN ('no_absent_finding', 'no_present_finding')
                                 THEN v_found ELSE v_acked END,
                            s.submission_id;
        RETURN;
    END IF;
    UPDATE payouts x SET state = p_outcome,
                         rail_reference = coalesce(p_rail_reference, x.rail_reference)
     WHERE x.payout_id = p_payout_id AND x.state = 'RAIL_AMBIGUOUS';
    IF p_outcome = 'POSTED' THEN
        -- Unique by reference: two resolutions racing for one reference, one of them fails.
        INSERT INTO resolution_references (rail_reference, payout_id)
        VALUES (p_rail_reference, p_payout_id);
        PERFORM pay_write_payout_posting(p, p.claim_token, 'resolution');
    END IF;
    INSERT INTO audit_log (action, account_id, payout_id, operator, identity, owner_id, reason,
                           outcome, rail_reference)
    VALUES ('ambiguous_resolved', p.account_id, p_payout_id, p_operator, p_identity, p_owner_id,
            p_evidence, p_outcome, p_rail_reference);
    RETURN QUERY SELECT 'resolved'::text, p_outcome, p.account_id, a.balance_minor,
                        coalesce(s.late_outcome, s.outcome), v_acked, s.submission_id
                   FROM accounts a WHERE a.account_id = p.account_id;
END $$;
