//! The Jobs' secrets as files, as the operator mounts them (operator/src/build/job.rs): `dlock
//! run` authenticates with `--credential-file` (and the registrar's
//! `--registrar-credential-file`) and `dlock reconcile` reads paydb's URL from `--paydb-file`,
//! against the real services of `dlock dev up` (every service checks tokens), with no dlock
//! variable in the processes' environment.

use super::*;

/// A batch of three payouts runs with both credentials from files (the services refuse a call
/// without one, and the environment holds none); the reconciler reads paydb's URL from its file,
/// also instead of a `--paydb` that leads nowhere, and a file that holds nothing or a URL that
/// leads nowhere fails naming the file, never printing what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlock_run_and_reconcile_read_their_secrets_from_files() {
    let stack = DevStack::up().await;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path.display().to_string()
    };
    let executor = file("executor.token", &format!("{}\n", stack.token("executor")));
    let registrar = file("registrar.token", &stack.token("registrar"));
    let paydb_url = stack.url("paydb");
    let paydb = file("paydb-url", &format!("{paydb_url}\n"));
    let batch = file(
        "batch.yaml",
        &batch_manifest(
            "secret-files",
            2,
            (0..3).map(|i| Item::numbered(i, format!("item-{i}"), "acct-sf", 100)),
        ),
    );
    open_account(&stack.treasury_payments(), "acct-sf", Some(10_000)).await;

    // Without a credential the services refuse the run (the control: the files are what
    // authenticates the run below).
    // `dlock run` of the batch against the stack as the executor, registering as the registrar.
    let run = |extra: &[&str]| {
        let mut args = stack.run_args(&batch, &["--registrar-identity", "registrar"]);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        dlock(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let (ok, _, said) = run(&["--settle-timeout-s", "5"]);
    assert!(!ok, "a run without credentials must fail: {said}");
    let (ok, out, said) = run(&[
        "--credential-file",
        &executor,
        "--registrar-credential-file",
        &registrar,
    ]);
    assert!(ok, "dlock run with credential files: {said}\n{out}");
    let pool = stack.pool("paydb").await;
    let posted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM payouts WHERE account_id = 'acct-sf' AND state = 'POSTED'",
    )
    .fetch_one(&pool)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(posted, 3, "{out}");

    let rail = stack.url("railStub");
    let (ok, out, said) = dlock(&[
        "reconcile",
        "--paydb-file",
        &paydb,
        "--rail",
        &rail,
        "--json",
    ]);
    assert!(ok, "dlock reconcile --paydb-file: {said}");
    let findings: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(findings["payoutsChecked"], 3, "{findings}");
    // The file wins over a --paydb that leads nowhere.
    let port = free_port().unwrap_or_else(|e| panic!("{e:#}"));
    let nowhere = format!("postgres://nobody@127.0.0.1:{port}/none");
    let (ok, out, said) = dlock(&[
        "reconcile",
        "--paydb",
        &nowhere,
        "--paydb-file",
        &paydb,
        "--rail",
        &rail,
        "--json",
    ]);
    assert!(ok, "the file's URL is used: {said}");
    assert!(out.contains("\"payoutsChecked\": 3"), "{out}");
    // A file that holds nothing, or a URL that leads nowhere, fails naming the file.
    let empty = file("empty", "\n");
    let (ok, _, said) = dlock(&["reconcile", "--paydb-file", &empty, "--rail", &rail]);
    assert!(!ok, "an empty file must fail");
    assert!(said.contains(&format!("{empty} is empty")), "{said}");
    let wrong = file("wrong-url", &nowhere);
    let (ok, _, said) = dlock(&["reconcile", "--paydb-file", &wrong, "--rail", &rail]);
    assert!(!ok, "a file whose URL leads nowhere must fail: {said}");
    let (ok, _, said) = dlock(&["reconcile", "--rail", &rail]);
    assert!(!ok && said.contains("--paydb"), "no paydb given: {said}");
    assert!(!said.contains(&paydb_url), "no URL printed: {said}");
}
