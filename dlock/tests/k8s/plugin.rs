//! `kubectl dlock` for real: the `dlock` binary symlinked as `kubectl-dlock` on PATH, found and
//! run by the real kubectl's plugin discovery, on a kubeconfig whose context names the
//! namespace. Against the stack, a batch on a rail that redirects (every payout RAIL_AMBIGUOUS)
//! and a lock held at the real lock server: `status`, `batch`, `revoke` (both fences, checked at
//! the services with the revoked token) and `resolve`, and the errors a person meets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dlock_contract::payment::PayoutState;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::locks::table;
use crate::shared::accounts::open_account;
use crate::shared::process::Ran;
use crate::stack::{Held, Stale, hold};
use crate::world::{EXE, World, condition};

const NS: &str = "oncall";
const BATCH: &str = "payroll-2026-12";
const HELD_ACCOUNT: &str = "acct-held";

/// kubectl with `kubectl-dlock` (a symlink to the dlock binary) first on PATH.
struct Plugin {
    path: String,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl Plugin {
    fn install(world: &World) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(EXE, bin.join("kubectl-dlock"))
            .unwrap_or_else(|e| panic!("{e}"));
        let kubectl_dir = world
            .cluster
            .kubectl_path()
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let path = format!(
            "{}:{}:{}",
            bin.display(),
            kubectl_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        // A copy of the admin kubeconfig whose current context names the namespace, as
        // `kubectl config set-context --current --namespace` leaves it.
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::copy(world.cluster.kubeconfig(), &kubeconfig).unwrap_or_else(|e| panic!("{e}"));
        let plugin = Self {
            path,
            kubeconfig,
            _dir: dir,
        };
        let set = plugin.run_blocking(
            &[
                "config",
                "set-context",
                "--current",
                &format!("--namespace={NS}"),
            ],
            &[],
        );
        assert_eq!(set.code, Some(0), "{set}");
        let listed = plugin.run_blocking(&["plugin", "list"], &[]);
        assert!(
            listed
                .out
                .contains(&bin.join("kubectl-dlock").display().to_string()),
            "kubectl finds the plugin: {listed}"
        );
        plugin
    }

    fn command(&self, args: &[&str], env: &[(&str, &str)]) -> std::process::Command {
        let mut command = std::process::Command::new("kubectl");
        command
            .args(args)
            .env("PATH", &self.path)
            .env("KUBECONFIG", &self.kubeconfig)
            .env_remove("DLOCK_SERVICE_ADDRESSES")
            .env_remove("DLOCK_OPERATOR_TOKEN")
            .env_remove("DLOCK_CREDENTIAL_FILE");
        for (k, v) in env {
            command.env(k, v);
        }
        command
    }

    fn run_blocking(&self, args: &[&str], env: &[(&str, &str)]) -> Ran {
        let output = self
            .command(args, env)
            .env("PATH", &self.path)
            .output()
            .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}"));
        Ran::from(output)
    }

    /// `kubectl dlock ARGS` with `env`.
    async fn dlock(&self, args: &[&str], env: &[(&str, &str)]) -> Ran {
        let mut all = vec!["dlock"];
        all.extend_from_slice(args);
        let command = self.command(&all, env);
        let output = tokio::process::Command::from(command)
            .output()
            .await
            .unwrap_or_else(|e| panic!("kubectl dlock {args:?}: {e}"));
        Ran::from(output)
    }

    /// `kubectl dlock ARGS` with `env`, which must fail saying every one of `words` on stderr.
    async fn refuses(&self, args: &[&str], env: &[(&str, &str)], words: &[&str]) {
        let ran = self.dlock(args, env).await;
        assert!(
            ran.code != Some(0) && words.iter().all(|w| ran.err.contains(w)),
            "kubectl dlock {args:?} fails saying {words:?}: {ran}"
        );
    }

    async fn json(&self, args: &[&str]) -> Value {
        let ran = self.dlock(args, &[]).await;
        assert_eq!(ran.code, Some(0), "{ran}");
        serde_json::from_str(&ran.out).unwrap_or_else(|e| panic!("{e}: {ran}"))
    }
}

/// The tables of a `kubectl dlock` output (separated by blank lines) as rows of column → value;
/// sentences between them are left out.
fn sections(text: &str) -> Vec<Vec<BTreeMap<String, String>>> {
    text.split("\n\n")
        .filter(|s| {
            let header = s.lines().next().unwrap_or_default();
            !header.is_empty() && header == header.to_uppercase()
        })
        .map(table)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_dlock_shows_the_stack_revokes_through_both_fences_and_resolves_an_ambiguous_payout()
 {
    // Every transfer is taken by the rail and answered `307`: each payout ends RAIL_AMBIGUOUS.
    let mut world = World::with_operator(NS, &["--rail-redirect-rate", "1"]).await;
    world.start_kubelet(&[NS]);
    let services = world.services();
    let payment = services.payments_as("executor/setup");
    let executor = services.token("executor");
    let operator_token = services.token("operator");
    let lock_url = services.url("lockServer");
    let rail_url = services.url("railStub");
    for account in ["acct-17", "acct-18", HELD_ACCOUNT] {
        open_account(&services.treasury_payments(), account, Some(1_000_000)).await;
    }
    world.apply_stack_ready(NS);
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: executor-credential\nstringData:\n  token: {executor}\n"
    );
    world.apply(NS, &secret).unwrap_or_else(|e| panic!("{e:#}"));

    // A holder at the real lock server (a wedged worker, say), mirrored as a Lock.
    let key = format!("payout:{HELD_ACCOUNT}");
    let Held {
        client: holder,
        session,
        grant,
    } = hold(&lock_url, &executor, "executor/wedged", &key).await;

    // kubectl apply -f examples/payoutbatch.yaml; its Job runs and leaves 4 RAIL_AMBIGUOUS.
    // `kubectl dlock batch -w` follows it from the start until its Job has ended.
    let plugin = Plugin::install(&world);
    let example = crate::world::example_batch_with_executor_credential();
    world
        .apply(NS, &example)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let watching = tokio::process::Command::from(
        plugin.command(&["dlock", "batch", BATCH, "-w", "-o", "json"], &[]),
    )
    .kill_on_drop(true)
    .output();
    let watching = tokio::spawn(watching);
    let object = world.wait_for(
        "the batch is Degraded with 4 ambiguous payouts",
        Duration::from_secs(120),
        || world.get_json(&["payoutbatch", BATCH, "-n", NS]),
        |object| {
            condition(object, "Degraded").is_some_and(|c| c["status"] == "True")
                && object["status"]["ambiguous"]
                    .as_array()
                    .is_some_and(|a| a.len() == 4)
        },
    );
    let watched = tokio::time::timeout(Duration::from_secs(60), watching)
        .await
        .unwrap_or_else(|_| panic!("batch -w did not end with its Job"))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let lines: Vec<Value> = String::from_utf8_lossy(&watched.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(watched.status.success(), "{watched:?}");
    let last = lines.last().cloned().unwrap_or_default();
    assert_eq!(last["job"]["state"], "Complete", "{lines:?}");
    assert!(
        lines.len() >= 2 && lines[0]["job"]["state"] != "Complete",
        "batch -w printed the batch before its Job ended, and again after: {lines:?}"
    );
    let ambiguous: Vec<String> = object["status"]["ambiguous"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    world.wait_kubectl(
        "the held lock in the Lock mirror",
        Duration::from_secs(60),
        &["get", "locks", "-n", NS, "-o", "json"],
        |t| t.contains(&format!("\"key\": \"{key}\"")),
    );
    // The grant outlives the rest of the scenario.
    holder
        .heartbeat(session.session_id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    holder
        .renew(&key, session.session_id, grant.fencing_token, Some(60_000))
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let started = std::time::Instant::now();

    // status: the namespace comes from the context.
    let ran = plugin.dlock(&["status"], &[]).await;
    assert_eq!(ran.code, Some(0), "{ran}");
    let parts = sections(&ran.out);
    assert_eq!(parts.len(), 3, "resources, locks, ambiguous payouts: {ran}");
    let row = |kind: &str, name: &str| {
        parts[0]
            .iter()
            .find(|r| r["KIND"] == kind && r["NAME"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} {name} row: {ran}"))
    };
    for (kind, name) in [
        ("LockServer", "lock-server"),
        ("PaymentResource", "payment-resource"),
        ("RailProxy", "rail-proxy"),
    ] {
        let r = row(kind, name);
        assert_eq!(
            (r["READY"].as_str(), r["DEGRADED"].as_str()),
            ("True", "False"),
            "{r:?}"
        );
    }
    let batch_row = row("PayoutBatch", BATCH);
    assert_eq!(
        (batch_row["DEGRADED"].as_str(), batch_row["REASON"].as_str()),
        ("True", "RailAmbiguous"),
        "{batch_row:?}"
    );
    let lock_row = parts[1]
        .iter()
        .find(|r| r["KEY"] == key)
        .unwrap_or_else(|| panic!("the held lock: {ran}"));
    assert_eq!(lock_row["HOLDER"], "executor/wedged", "{lock_row:?}");
    assert_eq!(
        lock_row["TOKEN"],
        grant.fencing_token.to_string(),
        "{lock_row:?}"
    );
    assert!(!lock_row["EXPIRES"].is_empty() && lock_row["EXPIRES"] != "<none>");
    let mut listed: Vec<String> = parts[2].iter().map(|r| r["PAYOUT"].clone()).collect();
    let mut expected = ambiguous.clone();
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected, "every ambiguous payout: {ran}");
    eprintln!("{}", ran.out);

    let status = plugin.json(&["status", "-o", "json", "-n", NS]).await;
    assert_eq!(status["namespace"], NS);
    let resources = status["resources"].as_array().cloned().unwrap_or_default();
    let batch_resource = resources
        .iter()
        .find(|r| r["kind"] == "PayoutBatch" && r["name"] == BATCH)
        .unwrap_or_else(|| panic!("{status}"));
    let degraded = condition(&json!({"status": batch_resource}), "Degraded")
        .cloned()
        .unwrap_or_default();
    assert_eq!(degraded["reason"], "RailAmbiguous", "{batch_resource}");
    assert!(
        resources
            .iter()
            .filter(|r| r["kind"] == "LockServer")
            .all(|r| r["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready"))),
        "{status}"
    );
    let lock = status["locks"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["key"] == key)
        .unwrap_or_else(|| panic!("{status}"));
    assert_eq!(lock["token"], grant.fencing_token, "{lock}");
    assert_eq!(lock["accountId"], HELD_ACCOUNT, "{lock}");
    assert_eq!(
        status["ambiguousPayouts"].as_array().map(Vec::len),
        Some(4),
        "{status}"
    );
    // The same document as YAML, on the context named with --context.
    let current = plugin.run_blocking(&["config", "current-context"], &[]);
    assert_eq!(current.code, Some(0), "{current}");
    let ran = plugin
        .dlock(
            &["status", "--context", current.out.trim(), "-o", "yaml"],
            &[],
        )
        .await;
    assert_eq!(ran.code, Some(0), "{ran}");
    let yaml: Value = serde_yaml_ng::from_str(&ran.out).unwrap_or_else(|e| panic!("{e}: {ran}"));
    assert_eq!(yaml["namespace"], NS, "the context's namespace: {ran}");
    assert_eq!(yaml["locks"], status["locks"], "{ran}");
    plugin
        .refuses(
            &["status", "--context", "no-such-context"],
            &[],
            &["kubectl config get-contexts"],
        )
        .await;

    // batch: the counts add up to the batch's size.
    let batch = plugin.json(&["batch", BATCH, "-o", "json"]).await;
    let counts = batch["counts"].as_object().cloned().unwrap_or_default();
    let total: i64 = counts.values().filter_map(Value::as_i64).sum();
    assert_eq!(total, 4, "{batch}");
    assert_eq!(batch["payouts"], 4, "{batch}");
    assert_eq!(counts.get("RAIL_AMBIGUOUS"), Some(&json!(4)), "{batch}");
    assert_eq!(batch["phase"], "Degraded", "{batch}");
    assert_eq!(batch["job"]["state"], "Complete", "{batch}");
    assert_eq!(batch["job"]["name"], format!("{BATCH}-executor"), "{batch}");
    let ran = plugin.dlock(&["batch", BATCH], &[]).await;
    assert_eq!(ran.code, Some(0), "{ran}");
    let parts = sections(&ran.out);
    assert_eq!(parts[0][0]["PHASE"], "Degraded", "{ran}");
    assert_eq!(parts[0][0]["JOB-STATE"], "Complete", "{ran}");
    assert!(
        parts[1]
            .iter()
            .any(|r| r["STATE"] == "RAIL_AMBIGUOUS" && r["PAYOUTS"] == "4"),
        "{ran}"
    );
    eprintln!("{}", ran.out);

    // The errors a person meets say what happened and what to do.
    plugin
        .refuses(
            &["batch", "no-such-batch"],
            &[],
            &["not found in namespace oncall"],
        )
        .await;
    plugin
        .refuses(
            &["status"],
            &[
                ("KUBECONFIG", "/nonexistent/kubeconfig"),
                ("HOME", "/nonexistent"),
            ],
            &["no usable kubeconfig"],
        )
        .await;
    world.kubectl(&["create", "serviceaccount", "nobody", "-n", NS]);
    let nobody = world.service_account_kubeconfig(NS, "nobody", "nobody.kubeconfig");
    plugin
        .refuses(
            &["status", "-n", NS],
            &[("KUBECONFIG", &nobody.display().to_string())],
            &["forbidden: you may not list", "kubectl auth can-i"],
        )
        .await;
    plugin
        .refuses(
            &[
                "revoke",
                "payout:acct-nobody",
                "--reason",
                "e2e: nobody holds it",
            ],
            &[],
            &["no Lock in namespace oncall mirrors"],
        )
        .await;
    plugin
        .refuses(
            &["revoke", &key, "--reason", "short"],
            &[],
            &["at least 8 characters"],
        )
        .await;
    let revocations = world.get_json(&["lockrevocations", "-n", NS]);
    assert_eq!(
        revocations["items"].as_array().map(Vec::len),
        Some(0),
        "refused before creating: {revocations}"
    );

    // revoke: a LockRevocation guarded by the holder's token, watched until both fences.
    let ran = plugin
        .dlock(
            &[
                "revoke",
                &key,
                "--reason",
                "e2e: the worker looks wedged",
                "--operator",
                "oncall-ana",
                "--timeout",
                "60s",
            ],
            &[],
        )
        .await;
    assert_eq!(ran.code, Some(0), "{ran}{}", world.diagnostics());
    for step in [
        "lockrevocation.dlock.io/revoke-payout-acct-held-",
        &format!("grant with token {} revoked", grant.fencing_token),
        &format!("payment resource: account {HELD_ACCOUNT} fenced"),
        &format!("rail proxy: high-water mark of {HELD_ACCOUNT} advanced"),
        "done: ",
    ] {
        assert!(ran.out.contains(step), "{step:?} in {ran}");
    }
    eprintln!("{}", ran.out);
    let revocations = world.get_json(&["lockrevocations", "-n", NS]);
    let created = &revocations["items"][0];
    assert_eq!(
        created["spec"]["expectedToken"], grant.fencing_token,
        "{created}"
    );
    assert_eq!(created["spec"]["revokedBy"], "oncall-ana", "{created}");
    assert_eq!(
        created["status"]["result"]["outcome"], "Complete",
        "{created}"
    );
    let floor = created["status"]["result"]["newTokenFloor"]
        .as_i64()
        .unwrap_or_else(|| panic!("{created}"));
    assert!(floor > grant.fencing_token);
    // The revoked token, with the proof its grant carried, is FENCED_OUT at both points.
    let wedged = Stale {
        owner: "executor/wedged",
        token: grant.fencing_token,
        proof: grant.fencing_proof.clone(),
    };
    wedged
        .is_fenced_out_at_both_points(world.services(), HELD_ACCOUNT)
        .await;

    // resolve: the payment resource found from the PaymentResource, reached through the
    // address map, called with the operator credential.
    let statement = dlock_contract::rail::read_statement(&rail_url, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let target = &ambiguous[0];
    let reference = statement
        .transfers
        .iter()
        .find(|t| &t.client_ref == target)
        .map(|t| t.rail_reference.clone())
        .unwrap_or_else(|| panic!("{target} on the rail's statement"));
    // The payout's attempt has no recorded answer (a redirect): its resolution stands on the
    // reconciler's finding in paydb (docs/contract.md#resolve-evidence).
    let paydb = world.services().url("paydb");
    crate::shared::process::reconcile(&paydb, &rail_url, 0, &[]);
    let addresses = world.service_addresses(&[NS]);
    let resolve = [
        "resolve",
        target.as_str(),
        "--posted",
        "--rail-reference",
        reference.as_str(),
    ];
    // Without the operator credential.
    plugin
        .refuses(
            &resolve,
            &[("DLOCK_SERVICE_ADDRESSES", &addresses)],
            &["DLOCK_OPERATOR_TOKEN"],
        )
        .await;
    // Without the address map the in-cluster address is unreachable here.
    plugin
        .refuses(
            &resolve,
            &[("DLOCK_OPERATOR_TOKEN", &operator_token)],
            &["kubectl port-forward", "DLOCK_SERVICE_ADDRESSES"],
        )
        .await;
    let ran = plugin
        .dlock(
            &resolve,
            &[
                ("DLOCK_SERVICE_ADDRESSES", &addresses),
                ("DLOCK_OPERATOR_TOKEN", &operator_token),
            ],
        )
        .await;
    assert!(
        ran.code == Some(0) && ran.out.contains("is POSTED"),
        "{ran}"
    );
    let id: Uuid = target.parse().unwrap_or_else(|e| panic!("{e}"));
    let resolved = payment
        .get_payout(id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resolved.state, PayoutState::Posted, "{resolved:?}");
    assert!(
        ran.out
            .contains(&format!("payoutbatch.dlock.io/{BATCH} asked to count")),
        "{ran}"
    );
    // The batch counts again at once: the resolved payout leaves the ambiguous list.
    let mut counts = Value::Null;
    for _ in 0..100 {
        let batch = plugin.json(&["batch", BATCH, "-o", "json"]).await;
        counts = batch["counts"].clone();
        if counts["POSTED"] == 1 && counts["RAIL_AMBIGUOUS"] == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        (counts["POSTED"].as_i64(), counts["RAIL_AMBIGUOUS"].as_i64()),
        (Some(1), Some(3)),
        "{counts}"
    );
    let status = plugin.json(&["status", "-o", "json"]).await;
    let still: Vec<&Value> = status["ambiguousPayouts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| &a["payoutId"])
        .collect();
    assert_eq!(still.len(), 3, "{status}");
    assert!(!still.contains(&&json!(target)), "{status}");
    // --failed needs evidence.
    plugin
        .refuses(
            &["resolve", &ambiguous[1], "--failed"],
            &[
                ("DLOCK_SERVICE_ADDRESSES", &addresses),
                ("DLOCK_OPERATOR_TOKEN", &operator_token),
            ],
            &["--evidence"],
        )
        .await;
    let other = payment
        .get_payout(ambiguous[1].parse().unwrap_or_else(|e| panic!("{e}")))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(other.state, PayoutState::RailAmbiguous, "{other:?}");

    eprintln!(
        "revoked token {}, floor {floor}; plugin steps in {} ms; scenario done in {} ms",
        grant.fencing_token,
        started.elapsed().as_millis(),
        world.elapsed_ms()
    );
}
