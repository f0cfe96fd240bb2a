-- paydb 0031: a payout's hold follows its state once per statement, not once per row.
--
-- payouts_holds (0026) was a row trigger: each payout whose state entered or left a holding
-- state ran its own UPDATE of its account's held_minor. It stayed a row trigger while the rail
-- proxy's writes were statements of one row, where a statement-level trigger costs more (68 us
-- per row against 128 us per statement, measured on this database). Since 0030 every step of a
-- batch (claim, admission, record, post) is one statement over the batch's payouts, so a payout
-- pays two row firings where a batch of k pays four statement firings: the holds now follow the
-- state per statement.
--
-- What does not change: the holds move in the same statement as the states (an AFTER STATEMENT
-- trigger runs before the statement returns), so held_minor is never out of step with the
-- payouts and the customer CHECK on accounts sees every hold before anything else runs. Several
-- payouts of one account in one statement move its held_minor once, by their sum; the CHECK
-- judges the account as the statement leaves it. The accounts are locked in key order before
-- they are written, so two statements that move the holds of the same accounts never wait on
-- each other in a cycle.
--
-- Can run again on a database that already has it (OR REPLACE, IF EXISTS).

CREATE OR REPLACE FUNCTION pay_payouts_holds_rows() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moved text[];
    deltas bigint[];
BEGIN
    SELECT array_agg(d.account_id ORDER BY d.account_id),
           array_agg(d.delta ORDER BY d.account_id)
      INTO moved, deltas
      FROM (SELECT n.account_id,
                   sum(CASE WHEN sn.holds THEN n.amount_minor ELSE -n.amount_minor END)::bigint
                       AS delta
              FROM old_payouts o
              JOIN new_payouts n ON n.payout_id = o.payout_id
              JOIN payout_states so ON so.state = o.state
              JOIN payout_states sn ON sn.state = n.state
             WHERE so.holds <> sn.holds
             GROUP BY n.account_id) d
     WHERE d.delta <> 0;
    IF moved IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM accounts a WHERE a.account_id = ANY (moved)
     ORDER BY a.account_id FOR UPDATE OF a;
    -- By the primary key (a join with the arrays would be planned as a scan of accounts).
    UPDATE accounts a
       SET held_minor = a.held_minor + deltas[array_position(moved, a.account_id)]
     WHERE a.account_id = ANY (moved);
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS payouts_holds ON payouts;
CREATE TRIGGER payouts_holds AFTER UPDATE ON payouts
    REFERENCING OLD TABLE AS old_payouts NEW TABLE AS new_payouts
    FOR EACH STATEMENT EXECUTE FUNCTION pay_payouts_holds_rows();
DROP FUNCTION IF EXISTS pay_payouts_holds();
