//! The payment resource's configuration: one TOML file plus `DLOCK_*` overrides, validated whole
//! at start (docs/design.md#configuration).

use dlock_server::config::{ConfigError, RawConfig};
use dlock_server::http::Served;
use dlock_server::pg::PgSettings;
use dlock_server::proof::ProofKeys;

/// The shortest operator credential accepted: a guessable one would let anyone move a fence.
pub const OPERATOR_TOKEN_LEN_MIN: usize = 16;

#[derive(Debug, Clone)]
pub struct IdempotencySettings {
    /// `payment.idempotency.payout-retention-ms`: payout writes (72 h, docs/design.md#idempotency).
    pub payout_retention_ms: i64,
    /// `payment.idempotency.ledger-retention-ms`: ledger postings (7 days,
    /// docs/design.md#idempotency).
    pub ledger_retention_ms: i64,
    /// `payment.idempotency.sweep-interval-ms`: how often expired records are deleted.
    pub sweep_interval_ms: u64,
    /// `payment.idempotency.in-progress-wait-ms`: how long a duplicate waits for the identical
    /// request in progress before it is told to retry.
    pub in_progress_wait_ms: i32,
}

#[derive(Debug, Clone)]
pub struct PaymentConfig {
    /// `server.*` and `auth.*`; `payment.operator.token` is one more operator credential.
    pub served: Served,
    pub pg: PgSettings,
    /// `payment.operator.token`: the credential of fence advances and resolutions. Without it,
    /// those endpoints refuse everybody.
    pub operator_token: Option<String>,
    pub idempotency: IdempotencySettings,
    /// `payment.payout.max-attempts`: how many claims a payout gets. A claim that finds it
    /// claimed this many times abandons it instead (ABANDONED, docs/design.md#payouts).
    pub max_attempts: i32,
    /// `payment.batch.max`: the most registrations, claims, posts or reads one transaction takes
    /// when requests of that kind queue behind a running one (docs/design.md#group-commit). 1
    /// runs every request in its own transaction.
    pub batch_max: usize,
    /// `fencing.proof-keys-file` (docs/design.md#d-8): when set, claim and post need the lock
    /// server's `X-Fencing-Proof` of the token on `payout:{accountId}`, and fence recovery is
    /// possible.
    pub proof_keys: Option<ProofKeys>,
    /// `auth.treasury.dual-approval-above` (minor units): a funding above it waits for a second,
    /// different treasury identity (docs/contract.md#dual-approval). `None`: every funding
    /// applies at once.
    pub dual_approval_above: Option<i64>,
}

impl PaymentConfig {
    pub fn from_raw(raw: &mut RawConfig) -> Result<Self, ConfigError> {
        let listen = raw.socket_addr("server.listen", "127.0.0.1:7071")?;
        // Fencing is what this service exists for (docs/design.md#configuration). There is no
        // configuration in which a payout may be written without its token being checked, so
        // `false` stops the start.
        if !raw.boolean("payment.fencing.enabled", true)? {
            return Err(ConfigError::new(
                "payment.fencing.enabled",
                "cannot be false: the payment resource never accepts unfenced writes \
                 (docs/design.md#configuration); remove the key or set it to true",
            ));
        }
        let pg = PgSettings::from_raw(
            raw,
            "payment.pg",
            32,
            "is required (postgres://user@host:port/paydb)",
        )?;
        let operator_token = raw.secret("payment.operator.token")?;
        if let Some(token) = &operator_token
            && (token.len() < OPERATOR_TOKEN_LEN_MIN
                || !token.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(ConfigError::new(
                "payment.operator.token",
                format!(
                    "must be at least {OPERATOR_TOKEN_LEN_MIN} visible ASCII characters without spaces"
                ),
            ));
        }
        let hour_ms = 3_600_000;
        let idempotency = IdempotencySettings {
            payout_retention_ms: raw.integer(
                "payment.idempotency.payout-retention-ms",
                72 * hour_ms,
                1_000..=90 * 24 * hour_ms,
            )?,
            ledger_retention_ms: raw.integer(
                "payment.idempotency.ledger-retention-ms",
                7 * 24 * hour_ms,
                1_000..=90 * 24 * hour_ms,
            )?,
            sweep_interval_ms: raw.integer(
                "payment.idempotency.sweep-interval-ms",
                60_000,
                10..=hour_ms,
            )? as u64,
            in_progress_wait_ms: raw.integer(
                "payment.idempotency.in-progress-wait-ms",
                2_000,
                10..=30_000,
            )? as i32,
        };
        let max_attempts = raw.integer("payment.payout.max-attempts", 20, 1..=1_000)? as i32;
        let batch_max = raw.integer("payment.batch.max", 32, 1..=256)? as usize;
        let request_timeout = raw.millis("server.request-timeout-ms", 10_000, 1_000..=120_000)?;
        let served = Served::from_raw(raw, listen, request_timeout, operator_token.as_deref())?;
        let proof_keys = ProofKeys::from_raw(raw)?;
        // -1, the default, is "not set": every funding applies at once.
        let dual_approval_above = raw.integer(
            "auth.treasury.dual-approval-above",
            -1,
            -1..=dlock_contract::payment::AMOUNT_MINOR_MAX,
        )?;
        let dual_approval_above = (dual_approval_above >= 0).then_some(dual_approval_above);
        Ok(Self {
            served,
            pg,
            operator_token,
            idempotency,
            max_attempts,
            batch_max,
            proof_keys,
            dual_approval_above,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn load(env: &[(&str, &str)]) -> Result<PaymentConfig, ConfigError> {
        let env: BTreeMap<String, String> = env
            .iter()
            .map(|(k, v)| (dlock_server::config::env_name(k), (*v).to_owned()))
            .collect();
        let mut raw = RawConfig::from_parts(None, env)?;
        PaymentConfig::from_raw(&mut raw)
    }

    /// The key a configuration of `env` is refused for, `None` when it loads.
    fn refused_key(env: &[(&str, &str)]) -> Option<String> {
        load(env).err().map(|e| e.key)
    }

    const URL: (&str, &str) = ("payment.pg.url", "postgres://x/paydb");

    #[test]
    fn fencing_cannot_be_turned_off() {
        assert_eq!(
            refused_key(&[URL, ("payment.fencing.enabled", "false")]).as_deref(),
            Some("payment.fencing.enabled")
        );
        // Without proofs, said by name: the service refuses to start otherwise.
        let no_proofs = ("fencing.insecure-no-proofs", "true");
        assert!(load(&[URL, ("payment.fencing.enabled", "true"), no_proofs]).is_ok());
    }

    #[test]
    fn url_is_required_and_a_short_operator_token_is_refused() {
        assert_eq!(refused_key(&[]).as_deref(), Some("payment.pg.url"));
        assert_eq!(
            refused_key(&[URL, ("payment.operator.token", "short")]).as_deref(),
            Some("payment.operator.token")
        );
    }
}
