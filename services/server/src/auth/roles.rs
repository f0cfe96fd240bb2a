//! Roles: what each authenticated identity may do, and the one table of which role each request
//! of every service needs (docs/threat-model.md#roles).
//!
//! An identity's roles come from configuration: the `auth.<role>-identities` lists, an optional
//! third column of the tokens file, and under TokenReview the ServiceAccount allow-list
//! `auth.tokenreview.service-accounts`. With `auth.mode` other than `none`, an identity with no
//! role is `403 FORBIDDEN` on every request that needs a credential (every write, every read
//! under `/v1/` but the API document); the probes stay open.

use std::fmt;

use axum::http::Method;

/// One role. An identity may hold several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Opens and funds accounts, sets their limits, approves a large funding.
    Treasury,
    /// Registers payouts (`POST /v1/payouts`).
    Registrar,
    /// Runs registered payouts: sessions and locks, claim, submit, post, release.
    Executor,
    /// Revokes locks, moves fences and marks, resolves and cancels payouts; may hold locks.
    Operator,
    /// Reads only.
    Reader,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Treasury,
        Role::Registrar,
        Role::Executor,
        Role::Operator,
        Role::Reader,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Treasury => "treasury",
            Role::Registrar => "registrar",
            Role::Executor => "executor",
            Role::Operator => "operator",
            Role::Reader => "reader",
        }
    }

    /// The configuration list that names this role's identities.
    pub fn config_key(self) -> &'static str {
        match self {
            Role::Treasury => "auth.treasury-identities",
            Role::Registrar => "auth.registrar-identities",
            Role::Executor => "auth.executor-identities",
            Role::Operator => "auth.operator-identities",
            Role::Reader => "auth.reader-identities",
        }
    }

    pub fn parse(text: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == text)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Roles(u8);

impl Roles {
    pub const NONE: Roles = Roles(0);

    pub fn of(roles: &[Role]) -> Roles {
        roles.iter().fold(Roles::NONE, |set, r| set.with(*r))
    }

    pub fn all() -> Roles {
        Roles::of(&Role::ALL)
    }

    #[must_use]
    pub fn with(self, role: Role) -> Roles {
        Roles(self.0 | role.bit())
    }

    #[must_use]
    pub fn union(self, other: Roles) -> Roles {
        Roles(self.0 | other.0)
    }

    pub fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    pub fn intersects(self, other: Roles) -> bool {
        self.0 & other.0 != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// `a, b` or `none`, for messages.
    pub fn names(self) -> String {
        if self.is_empty() {
            return "none".into();
        }
        self.iter().map(Role::as_str).collect::<Vec<_>>().join(", ")
    }

    /// Parses `role[,role…]` (or `+` between roles, the form a comma-separated list value
    /// needs); an unknown name is an error naming the known ones.
    pub fn parse_list(text: &str) -> Result<Roles, String> {
        let mut roles = Roles::NONE;
        for name in text
            .split([',', '+'])
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let role = Role::parse(name).ok_or_else(|| {
                format!(
                    "`{name}` is not a role; the roles are {}",
                    Roles::all().names()
                )
            })?;
            roles = roles.with(role);
        }
        if roles.is_empty() {
            return Err(format!(
                "names no role; the roles are {}",
                Roles::all().names()
            ));
        }
        Ok(roles)
    }
}

const TREASURY: &[Role] = &[Role::Treasury];
const REGISTRAR: &[Role] = &[Role::Registrar];
const EXECUTOR: &[Role] = &[Role::Executor];
/// Sessions and locks: the executor's cycle, and the operator's own grants (a fence lowering
/// and a cancel run under the operator's grant on `payout:{accountId}`).
const HOLDER: &[Role] = &[Role::Executor, Role::Operator];
const OPERATOR: &[Role] = &[Role::Operator];

/// The one table: the writes of the lock server, the payment resource and the rail proxy, by
/// method and path pattern (`*` is one path segment), and the roles that may make them. A read
/// (GET, HEAD) needs any role; a write the table does not list needs any role and then meets the
/// service's own 404 or 405 (every write the services route is listed: see the unit test
/// `every_write_of_the_contract_has_its_roles`).
pub const WRITES: &[(&str, &str, &[Role])] = &[
    // Lock server (docs/contract.md#lock-server).
    ("POST", "/v1/sessions", HOLDER),
    ("POST", "/v1/sessions/*/heartbeat", HOLDER),
    ("DELETE", "/v1/sessions/*", HOLDER),
    ("POST", "/v1/locks/*/acquire", HOLDER),
    ("POST", "/v1/locks/*/renew", HOLDER),
    ("DELETE", "/v1/locks/*", HOLDER),
    ("POST", "/v1/locks/*/revoke", OPERATOR),
    // Batches (docs/contract.md#batches): the roles of the single endpoint of their step.
    ("POST", "/v1/batches/acquire", HOLDER),
    ("POST", "/v1/batches/release", HOLDER),
    ("POST", "/v1/batches/claim", EXECUTOR),
    ("POST", "/v1/batches/post", EXECUTOR),
    ("POST", "/v1/batches/submit", EXECUTOR),
    // Payment resource (docs/contract.md#payment-resource).
    ("POST", "/v1/accounts", TREASURY),
    ("POST", "/v1/accounts/*/fund", TREASURY),
    ("POST", "/v1/accounts/*/limits", TREASURY),
    ("POST", "/v1/fundings/*/approve", TREASURY),
    ("POST", "/v1/accounts/*/fence", OPERATOR),
    ("POST", "/v1/accounts/*/fence/lower", OPERATOR),
    ("POST", "/v1/payouts", REGISTRAR),
    ("POST", "/v1/payouts/*/claim", EXECUTOR),
    ("POST", "/v1/payouts/*/post", EXECUTOR),
    ("POST", "/v1/payouts/*/resolve", OPERATOR),
    ("POST", "/v1/payouts/*/cancel", OPERATOR),
    // Rail proxy (docs/contract.md#rail-proxy).
    ("POST", "/v1/rail/submissions", EXECUTOR),
    ("POST", "/v1/rail/high-water/*", OPERATOR),
    ("POST", "/v1/rail/high-water/*/lower", OPERATOR),
];

fn matches(pattern: &str, path: &str) -> bool {
    let mut p = pattern.split('/');
    let mut s = path.split('/');
    loop {
        match (p.next(), s.next()) {
            (None, None) => return true,
            (Some("*"), Some(segment)) if !segment.is_empty() => {}
            (Some(a), Some(b)) if a == b => {}
            _ => return false,
        }
    }
}

/// The roles that may make `method path`: a listed write's, else every role.
pub fn roles_for(method: &Method, path: &str) -> Roles {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return Roles::all();
    }
    WRITES
        .iter()
        .find(|(m, pattern, _)| *m == method.as_str() && matches(pattern, path))
        .map_or_else(Roles::all, |(_, _, roles)| Roles::of(roles))
}

/// Where identities get their roles: the `auth.<role>-identities` lists, the tokens file's third
/// column, and the ServiceAccount allow-list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoleMap {
    entries: Vec<(String, Roles)>,
}

impl RoleMap {
    pub fn grant(&mut self, identity: &str, roles: Roles) {
        match self.entries.iter_mut().find(|(name, _)| name == identity) {
            Some((_, held)) => *held = held.union(roles),
            None => self.entries.push((identity.to_owned(), roles)),
        }
    }

    pub fn roles_of(&self, identity: &str) -> Roles {
        self.entries
            .iter()
            .find(|(name, _)| name == identity)
            .map_or(Roles::NONE, |(_, roles)| *roles)
    }

    /// The identities holding `role`.
    pub fn holders(&self, role: Role) -> Vec<&str> {
        self.entries
            .iter()
            .filter(|(_, roles)| roles.contains(role))
            .map(|(name, _)| name.as_str())
            .collect()
    }
}

/// Parses one `auth.tokenreview.service-accounts` entry, `<namespace>/<name>=<role>[+<role>…]`,
/// into the identity TokenReview names it by (`system:serviceaccount:<namespace>:<name>`) and
/// its roles.
pub fn parse_service_account(entry: &str) -> Result<(String, Roles), String> {
    let shape = || {
        format!(
            "`{entry}` must be `<namespace>/<service-account>=<role>[+<role>…]`, e.g. \
             `payments/executor=executor`"
        )
    };
    let (account, roles) = entry.split_once('=').ok_or_else(shape)?;
    let (namespace, name) = account.trim().split_once('/').ok_or_else(shape)?;
    let dns = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if !dns(namespace) || !dns(name) {
        return Err(shape());
    }
    let roles = Roles::parse_list(roles).map_err(|e| format!("`{entry}`: {e}"))?;
    Ok((format!("system:serviceaccount:{namespace}:{name}"), roles))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_needs_the_roles_of_its_single_endpoint() {
        use dlock_contract::batch::{
            AcquireItem, ClaimItem, Item, PostItem, ReleaseItem, SubmitItem,
        };
        fn check<I: Item>(item: I) {
            let single = item.single();
            assert_eq!(
                roles_for(&Method::POST, I::PATH),
                roles_for(&single.method, &single.path),
                "{} and {}",
                I::PATH,
                I::SINGLE
            );
            assert_ne!(
                roles_for(&Method::POST, I::PATH),
                Roles::all(),
                "{}",
                I::PATH
            );
        }
        let (session_id, payout_id) = (uuid::Uuid::nil(), uuid::Uuid::nil());
        let key = "payout:a-1".to_owned();
        check(AcquireItem {
            key: key.clone(),
            session_id,
            ttl_millis: None,
            wait_millis: None,
            traceparent: None,
        });
        check(ReleaseItem {
            key,
            session_id,
            fencing_token: 1,
            traceparent: None,
        });
        check(ClaimItem {
            payout_id,
            fencing_token: 1,
            fencing_proof: None,
            idempotency_key: "k".into(),
            expected_state: dlock_contract::payment::PayoutState::Pending,
            traceparent: None,
        });
        check(PostItem {
            payout_id,
            fencing_token: 1,
            fencing_proof: None,
            idempotency_key: "k".into(),
            rail_reference: "r".into(),
            submission_id: payout_id,
            rail_outcome: dlock_contract::payment::RailOutcome::Acked,
            traceparent: None,
        });
        check(SubmitItem {
            fencing_token: 1,
            fencing_proof: None,
            idempotency_key: "k".into(),
            submission: dlock_contract::rail::SubmissionRequest {
                payout_id,
                account_id: "a-1".into(),
                amount_minor: 1,
                currency: "EUR".into(),
                beneficiary_ref: "b".into(),
            },
            traceparent: None,
        });
    }

    #[test]
    fn every_write_of_the_contract_has_its_roles() {
        let post = Method::POST;
        // Each role's writes, all POSTs; the one DELETE (L6, a release) is the holder's too.
        let cases: &[(&[Role], &[&str])] = &[
            (
                TREASURY,
                &[
                    "/v1/accounts",
                    "/v1/accounts/a-1/fund",
                    "/v1/accounts/a-1/limits",
                    "/v1/fundings/0195e3b4-0000-7000-8000-000000000001/approve",
                ],
            ),
            (REGISTRAR, &["/v1/payouts"]),
            (
                EXECUTOR,
                &[
                    "/v1/payouts/p/claim",
                    "/v1/payouts/p/post",
                    "/v1/rail/submissions",
                ],
            ),
            (
                OPERATOR,
                &[
                    "/v1/payouts/p/cancel",
                    "/v1/payouts/p/resolve",
                    "/v1/accounts/a/fence",
                    "/v1/accounts/a/fence/lower",
                    "/v1/rail/high-water/a",
                    "/v1/rail/high-water/a/lower",
                    "/v1/locks/payout:a/revoke",
                ],
            ),
            (HOLDER, &["/v1/locks/payout:a/acquire", "/v1/sessions"]),
        ];
        for (roles, paths) in cases {
            for path in *paths {
                assert_eq!(roles_for(&post, path), Roles::of(roles), "POST {path}");
            }
        }
        assert_eq!(
            roles_for(&Method::DELETE, "/v1/locks/payout:a"),
            Roles::of(HOLDER)
        );
        assert_eq!(roles_for(&Method::GET, "/v1/payouts/p"), Roles::all());
        assert!(!roles_for(&post, "/v1/payouts").contains(Role::Executor));
        assert!(!roles_for(&post, "/v1/payouts/p/claim").contains(Role::Registrar));
        assert!(!roles_for(&post, "/v1/accounts/a/fund").contains(Role::Reader));
        // A segment matches one segment only.
        assert_eq!(roles_for(&post, "/v1/payouts//claim"), Roles::all());
    }

    #[test]
    fn service_accounts_and_role_lists_parse_or_say_why_not() {
        assert_eq!(
            parse_service_account("payments/executor=executor+registrar"),
            Ok((
                "system:serviceaccount:payments:executor".to_owned(),
                Roles::of(&[Role::Executor, Role::Registrar])
            ))
        );
        for bad in [
            "payments/executor",
            "executor=executor",
            "payments/exec=admin",
            "Payments/x=reader",
            "payments/x=",
        ] {
            assert!(parse_service_account(bad).is_err(), "{bad}");
        }
        assert_eq!(Roles::parse_list("reader"), Ok(Roles::of(&[Role::Reader])));
        assert!(Roles::parse_list("root").is_err());
    }
}
