//! `kubectl dlock revoke`: a LockRevocation, watched until both fences are advanced.

use super::*;

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RevokeView {
    pub name: String,
    pub namespace: String,
    pub key: String,
    pub expected_token: Option<i64>,
    pub result: Option<RevocationResult>,
}

/// A LockRevocation name prefix from a key: `payout:acct-17` → `revoke-payout-acct-17-`.
pub fn revocation_prefix(key: &str) -> String {
    let mut name: String = key
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    name.truncate(40);
    let name = name.trim_matches('-');
    format!("revoke-{name}-")
}

/// The lines that say what changed between two results of the same revocation.
pub fn revocation_steps(
    before: Option<&RevocationResult>,
    now: &RevocationResult,
    account: &str,
) -> Vec<String> {
    let mut lines = Vec::new();
    let floor = now
        .new_token_floor
        .map(|f| f.to_string())
        .unwrap_or_else(|| "?".into());
    if now.new_token_floor.is_some() && before.and_then(|b| b.new_token_floor).is_none() {
        match now.revoked_token {
            Some(token) => lines.push(format!(
                "lock server: grant with token {token} revoked, new token floor {floor}"
            )),
            None => lines.push(format!("lock server: revoked, new token floor {floor}")),
        }
    }
    if now.payment_fenced && !before.is_some_and(|b| b.payment_fenced) {
        lines.push(format!(
            "payment resource: account {account} fenced at {floor}"
        ));
    }
    if now.rail_fenced && !before.is_some_and(|b| b.rail_fenced) {
        lines.push(format!(
            "rail proxy: high-water mark of {account} advanced to {floor}"
        ));
    }
    let changed = before.is_none_or(|b| b.outcome != now.outcome || b.summary != now.summary);
    if changed && now.outcome == "Incomplete" {
        lines.push(format!(
            "incomplete, the operator retries: {}",
            now.summary.clone().unwrap_or_default()
        ));
    }
    // L8's answer was lost and the key could not be read: not a failure; the operator's retry
    // reads the key first (docs/contract.md#outcome-unknown).
    if changed && now.outcome == "OutcomeUnknown" {
        lines.push(format!(
            "outcome unknown, the operator reads the key before anything else and retries: {}",
            now.summary.clone().unwrap_or_default()
        ));
    }
    lines
}

pub(super) async fn revoke(kube: &Kube, args: RevokeArgs, output: Output) -> Result<()> {
    let ns = kube.namespace.clone();
    let operator = kube.operator(args.operator.as_deref()).await;
    // The contract's own checks (key, account, reason length), before anything is created.
    let order = dlock_contract::revoke::RevokeOrder::for_key(
        &args.key,
        &operator,
        &args.reason,
        args.expected_token,
    )
    .map_err(|e| anyhow!("{e}; nothing was created"))?;
    let locks = kube.list::<Lock>("locks.dlock.io").await?;
    let mirrored = locks.iter().find(|l| l.spec.key == args.key);
    let expected_token = expected_token(&args, mirrored, &ns)?;
    let revocation = revocation(&ns, &order, mirrored, expected_token);
    let account = revocation.spec.account_id.clone();
    let api = kube.api::<LockRevocation>();
    let created = api
        .create(&PostParams::default(), &revocation)
        .await
        .map_err(|e| kube.explain(e, "create", "lockrevocations.dlock.io", None))?;
    let name = created.name_any();
    // Steps go to stderr when stdout carries a document for a script.
    let say = |line: &str| {
        if output == Output::Table {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
    };
    let guard = match expected_token {
        Some(t) => format!("only the grant with token {t}"),
        None => "whichever grant holds it".to_owned(),
    };
    say(&format!(
        "lockrevocation.dlock.io/{name} created: {} by {}, {guard}",
        args.key, order.operator,
    ));
    let watched = Watched {
        name: &name,
        ns: &ns,
        timeout: args.timeout,
    };
    let (verdict, last) = watch_until_settled(api, &watched, &account, say).await;
    if output != Output::Table {
        print_document(
            output,
            &RevokeView {
                name,
                namespace: ns,
                key: args.key.clone(),
                expected_token,
                result: last,
            },
        )?;
    }
    verdict
}

/// The token the revocation is guarded by: `--expected-token`, none with `--any-holder`, else
/// the token of the Lock that mirrors the key (an error when there is none to take).
fn expected_token(args: &RevokeArgs, mirrored: Option<&Lock>, ns: &str) -> Result<Option<i64>> {
    Ok(match (args.expected_token, args.any_holder, mirrored) {
        (Some(token), _, _) => Some(token),
        (None, true, _) => None,
        (None, false, Some(lock)) => Some(lock.status.as_ref().and_then(|s| s.token).ok_or_else(|| {
            anyhow!(
                "Lock {} mirrors {} but shows no token yet; give --expected-token N or --any-holder",
                lock.name_any(),
                args.key
            )
        })?),
        (None, false, None) => bail!(
            "no Lock in namespace {ns} mirrors {}: the operator saw nobody holding it (it mirrors held locks \
             every 15 s; `kubectl get locks -n {ns}`). Give --expected-token N to revoke that grant only, or \
             --any-holder to revoke whichever grant holds it",
            args.key
        ),
    })
}

/// The LockRevocation to create for `order`, on the lock server of the mirrored Lock if any.
fn revocation(
    ns: &str,
    order: &dlock_contract::revoke::RevokeOrder,
    mirrored: Option<&Lock>,
    expected_token: Option<i64>,
) -> LockRevocation {
    LockRevocation {
        metadata: ObjectMeta {
            generate_name: Some(revocation_prefix(&order.key)),
            namespace: Some(ns.to_owned()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                PLUGIN_NAME.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: LockRevocationSpec {
            key: order.key.clone(),
            account_id: mirrored
                .map_or_else(|| order.account_id.clone(), |l| l.spec.account_id.clone()),
            reason: order.reason.clone(),
            revoked_by: order.operator.clone(),
            expected_token,
            lock_server: mirrored.map(|l| l.spec.lock_server.clone()),
            payment_resource: None,
            rail_proxy: None,
        },
        status: None,
    }
}

/// The LockRevocation being watched, for messages.
struct Watched<'a> {
    name: &'a str,
    ns: &'a str,
    timeout: Duration,
}

/// Watches the LockRevocation and says each step until it is Complete (Ok), Refused, deleted
/// or out of time; with the last result the operator wrote.
async fn watch_until_settled(
    api: Api<LockRevocation>,
    watched: &Watched<'_>,
    account: &str,
    say: impl Fn(&str),
) -> (Result<()>, Option<RevocationResult>) {
    let Watched { name, ns, .. } = *watched;
    let mut last: Option<RevocationResult> = None;
    let watch = kube::runtime::watcher::watch_object(api, name).default_backoff();
    let mut watch = std::pin::pin!(watch);
    let mut failures = 0;
    let deadline = tokio::time::Instant::now() + watched.timeout;
    let verdict: Result<()> = loop {
        let event = match tokio::time::timeout_at(deadline, watch.next()).await {
            Err(_) => break Err(timed_out(watched, last.as_ref())),
            Ok(None) => break Err(anyhow!("the watch on LockRevocation {name} ended")),
            Ok(Some(Err(e))) => {
                failures += 1;
                if failures >= WATCH_FAILURES_MAX {
                    break Err(anyhow!(
                        "watching LockRevocation {name} in namespace {ns}: {e} ({failures} times in a row)"
                    ));
                }
                eprintln!("note: watching LockRevocation {name} again after: {e}");
                continue;
            }
            Ok(Some(Ok(None))) => {
                break Err(anyhow!(
                    "LockRevocation {name} was deleted before it completed"
                ));
            }
            Ok(Some(Ok(Some(object)))) => {
                failures = 0;
                object
            }
        };
        let Some(result) = event.status.and_then(|s| s.result) else {
            continue;
        };
        for line in revocation_steps(last.as_ref(), &result, account) {
            say(&line);
        }
        let settled = settled(&result, watched, &say);
        last = Some(result);
        if let Some(verdict) = settled {
            break verdict;
        }
    };
    (verdict, last)
}

/// The verdict on a Complete (said) or Refused revocation; `None` while it goes on.
fn settled(
    result: &RevocationResult,
    watched: &Watched<'_>,
    say: impl Fn(&str),
) -> Option<Result<()>> {
    let Watched { name, ns, .. } = *watched;
    let summary = result.summary.clone().unwrap_or_default();
    match result.outcome.as_str() {
        "Complete" => {
            say(&format!("done: {summary}"));
            Some(Ok(()))
        }
        "Refused" => Some(Err(anyhow!(
            "the revocation was refused: {summary} (LockRevocation {name} stays as the record; \
             `kubectl describe lockrevocation {name} -n {ns}`)"
        ))),
        _ => None,
    }
}

/// What a revocation that did not settle in time is: where it stands, or that the operator has
/// not answered.
fn timed_out(watched: &Watched<'_>, last: Option<&RevocationResult>) -> anyhow::Error {
    let Watched { name, ns, timeout } = *watched;
    match last {
        Some(r) => anyhow!(
            "timed out after {:?}: the revocation is {} ({}); the operator keeps retrying, watch it with \
             `kubectl get lockrevocation {name} -n {ns} -w`",
            timeout,
            r.outcome,
            r.summary.clone().unwrap_or_default()
        ),
        None => anyhow!(
            "timed out after {:?}: the operator has not answered LockRevocation {name}; is it running, \
             and does it watch namespace {ns}? (`kubectl get pods -n dlock-system`, \
             `kubectl describe lockrevocation {name} -n {ns}`)",
            timeout
        ),
    }
}
