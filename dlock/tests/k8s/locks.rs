//! `kubectl get locks` against a real lock server: the operator mirrors what is held.

use std::time::Duration;

use dlock_devstack::wait_until;

use crate::world::World;

/// The rows of a `kubectl get` table as column → value maps.
pub fn table(text: &str) -> Vec<std::collections::BTreeMap<String, String>> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let Some(header) = lines.next() else {
        return Vec::new();
    };
    // Columns start where a header word starts; values are sliced at the same offsets.
    let mut starts = Vec::new();
    let bytes = header.as_bytes();
    for i in 0..bytes.len() {
        if bytes[i] != b' ' && (i == 0 || bytes[i - 1] == b' ') {
            starts.push(i);
        }
    }
    let names: Vec<String> = starts
        .iter()
        .enumerate()
        .map(|(n, &s)| {
            let end = starts.get(n + 1).copied().unwrap_or(header.len());
            header[s..end].trim().to_owned()
        })
        .collect();
    lines
        .map(|line| {
            names
                .iter()
                .enumerate()
                .map(|(n, name)| {
                    let start = starts[n].min(line.len());
                    let end = starts
                        .get(n + 1)
                        .copied()
                        .unwrap_or(line.len())
                        .min(line.len());
                    (name.clone(), line[start..end].trim().to_owned())
                })
                .collect()
        })
        .collect()
}

/// The rows of `kubectl get locks -n NS` (none while kubectl fails).
pub fn lock_rows(world: &World, ns: &str) -> Vec<std::collections::BTreeMap<String, String>> {
    table(
        &world
            .try_kubectl(&["get", "locks", "-n", ns])
            .unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_get_locks_shows_the_real_holders_with_a_readable_expiry() {
    let ns = "locks";
    let mut world = World::with_operator(ns, &[]).await;
    world.apply_stack_ready(ns);

    // Two locks held through the real lock server, as the executor identity would hold them.
    let services = world.services();
    let lock = services.executor_locks();
    let session = lock
        .create_session(Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut grants = Vec::new();
    for account in ["acct-1", "acct-2"] {
        grants.push(
            lock.acquire(
                &format!("payout:{account}"),
                session.session_id,
                Some(60_000),
                None,
            )
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        );
    }

    // The mirror shows both, with the lock server's own tokens.
    let mut rows = Vec::new();
    let seen = wait_until(
        "both locks in kubectl get locks",
        Duration::from_secs(60),
        || {
            rows = lock_rows(&world, ns);
            grants.iter().all(|g| {
                rows.iter().any(|r| {
                    r.get("KEY") == Some(&g.key)
                        && r.get("TOKEN") == Some(&g.fencing_token.to_string())
                })
            })
        },
    );
    if let Err(e) = seen {
        panic!("{e:#}: rows {rows:?}{}", world.diagnostics());
    }
    for grant in &grants {
        let row = rows
            .iter()
            .find(|r| r.get("KEY") == Some(&grant.key))
            .unwrap_or_else(|| panic!("no row for {}", grant.key));
        assert_eq!(row.get("HOLDER").map(String::as_str), Some("executor/e2e"));
        let expires = row.get("EXPIRES").cloned().unwrap_or_default();
        assert!(
            !expires.is_empty() && expires != "<invalid>" && expires != "<none>",
            "EXPIRES must be readable for a lock that expires in the future: {row:?}"
        );
        assert!(
            row.get("AGE")
                .is_some_and(|a| !a.is_empty() && a != "<invalid>"),
            "{row:?}"
        );
    }
    eprintln!("kubectl get locks rows: {rows:?}");
    lock.end_session(session.session_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // Released locks leave the mirror: the positive control that the view follows the server.
    world.wait_kubectl(
        "the mirror drops released locks",
        Duration::from_secs(60),
        &["get", "locks", "-n", ns, "-o", "name"],
        |text| text.trim().is_empty(),
    );
    eprintln!("scenario done in {} ms", world.elapsed_ms());
}
