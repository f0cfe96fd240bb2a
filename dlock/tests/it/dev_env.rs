//! `dlock dev up --detach`, its env file and `dlock dev down`, as a user runs them: the env file
//! loads the stack into a shell, holds the credentials with mode 0600, and no log line shows them.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_dlock");

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

fn ready(url: &str) -> bool {
    let addr = url
        .trim_start_matches("http://")
        .parse()
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    dlock_devstack::http_status(addr, "/readyz") == Some(200)
}

/// Runs `dlock args…` in bash after sourcing `env`, so it sees what a user's shell sees.
fn in_shell(env: &Path, command: &str) -> std::process::Output {
    Command::new("bash")
        .args([
            "-c",
            &format!("set -euo pipefail; source '{}'; {command}", env.display()),
        ])
        .env("PATH", "/usr/bin:/bin")
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .unwrap_or_else(|e| panic!("bash: {e}"))
}

#[test]
fn dev_up_detached_hands_a_shell_the_stack_and_no_log_shows_a_credential() {
    // PostgreSQL runs as its own user and stages its data under TMPDIR.
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("{e}"));
    let (dir, stop, printed, said) = up_detached(tmp.path(), &[]);
    let env = dir.join("env");
    assert_eq!(printed, std::fs::read_to_string(&env).unwrap_or_default());
    let line: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("up.json")).unwrap_or_else(|e| panic!("{e}")),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let executor = line["credentials"]["executor"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(executor.len() >= 32, "{line}");
    assert_eq!(line["envFile"], env.display().to_string());
    assert_eq!(mode(&env), 0o600);
    assert_eq!(mode(&dir.join("up.json")), 0o600);
    assert_eq!(mode(&dir.join("tokens")), 0o600);

    // The shell that sources it reaches the stack as the README shows: the variables, the
    // binary on PATH, an authenticated curl as executor/alice, and dlock's own commands.
    let lock = line["lockServer"].as_str().unwrap_or_default().to_owned();
    assert!(ready(&lock));
    let out = in_shell(
        &env,
        "printf '%s %s %s\\n' \"$LS\" \"$DLOCK_CREDENTIAL\" \"$(command -v dlock)\"; \
         curl -sf -X POST \"$LS/v1/sessions\" -H 'content-type: application/json' \
           -H \"authorization: Bearer $TOKEN\" -H 'x-owner-id: executor/alice' \
           -d '{\"ownerId\":\"executor/alice\",\"ttlMillis\":15000}' >/dev/null; \
         dlock accounts fund -f examples/payoutbatch.yaml; \
         dlock accounts fund -f examples/payoutbatch.yaml",
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = stdout.lines().next().unwrap_or_default();
    assert_eq!(first, format!("{lock} {executor} {EXE}"));
    // Funded once although the command ran twice: the funding replays.
    let acct17: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("acct-17 "))
        .collect();
    assert_eq!(acct17.len(), 2, "{stdout}");
    for row in &acct17 {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cols,
            ["acct-17", "EUR", "223000", "223000", "223000"],
            "{stdout}"
        );
    }

    // No log line shows the executor's token; the env file does (positive control).
    assert!(
        std::fs::read_to_string(&env)
            .unwrap_or_default()
            .contains(&executor)
    );
    assert!(!said.contains(&executor), "dev up's stderr: {said}");
    let mut logs = 0;
    for entry in std::fs::read_dir(dir.join("logs")).unwrap_or_else(|e| panic!("{e}")) {
        let path = entry.unwrap_or_else(|e| panic!("{e}")).path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            !text.contains(&executor),
            "{} shows the credential",
            path.display()
        );
        logs += usize::from(!text.is_empty());
    }
    assert!(
        logs >= 4,
        "the services and dev up log to {}",
        dir.display()
    );

    // `dlock dev down` (DLOCK_DEV_DIR from the env file) stops the stack and removes the
    // directory `--detach` made.
    let out = in_shell(&env, "dlock dev down");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dir.exists(), "{} is still there", dir.display());
    assert!(!ready(&lock), "the lock server still answers");
    drop(stop);
}

/// Stops the stack if the test fails before `dlock dev down`.
fn scopeguard(dir: &Path) -> impl Drop + use<> {
    struct Stop(std::path::PathBuf);
    impl Drop for Stop {
        fn drop(&mut self) {
            if self.0.join("dev-up.pid").exists() {
                let _ = Command::new(EXE)
                    .args(["dev", "down", "--data-dir"])
                    .arg(&self.0)
                    .status();
            }
        }
    }
    Stop(dir.to_path_buf())
}

/// `dlock dev up --detach` with `extra` arguments and TMPDIR `tmp`: the stack's directory, a
/// guard that stops the stack when dropped, and what the command printed (stdout, stderr).
fn up_detached(
    tmp: &Path,
    extra: &[&str],
) -> (std::path::PathBuf, impl Drop + use<>, String, String) {
    let up = Command::new(EXE)
        .args(["dev", "up", "--detach"])
        .args(extra)
        .env("TMPDIR", tmp)
        .output()
        .unwrap_or_else(|e| panic!("dlock dev up --detach: {e}"));
    let said = String::from_utf8_lossy(&up.stderr).into_owned();
    assert!(
        up.status.success(),
        "dev up --detach {extra:?} failed: {said}"
    );
    let printed = String::from_utf8_lossy(&up.stdout).into_owned();
    let dir = printed
        .lines()
        .find_map(|l| l.strip_prefix("export DLOCK_DEV_DIR='"))
        .and_then(|l| l.strip_suffix('\''))
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("no DLOCK_DEV_DIR in {printed}"));
    let stop = scopeguard(&dir);
    (dir, stop, printed, said)
}

/// The values of the server settings `names` of the stack in `dir`, as psql in its shell reads
/// them from paydb, space-separated.
fn server_settings(dir: &Path, names: &[&str]) -> String {
    let select = names
        .iter()
        .map(|name| format!("current_setting($${name}$$)"))
        .collect::<Vec<_>>()
        .join(" || $$ $$ || ");
    let out = in_shell(
        &dir.join("env"),
        &format!("psql \"$DLOCK_PAYDB\" -Atc 'SELECT {select}'"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn dev_up_durable_runs_postgresql_with_productions_durability() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("{e}"));
    for (extra, want) in [(&["--durable"][..], "on on"), (&[][..], "off off")] {
        let (dir, stop, _, _) = up_detached(tmp.path(), extra);
        assert_eq!(
            server_settings(&dir, &["fsync", "full_page_writes"]),
            want,
            "fsync and full_page_writes of dev up {extra:?}"
        );
        drop(stop);
    }
}

#[test]
fn dev_up_passes_pg_settings_to_postgresql_and_refuses_a_malformed_one() {
    let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("{e}"));
    // What scripts/paydb-statements asks for, and one setting whose default (4MB) differs.
    let (dir, stop, _, _) = up_detached(
        tmp.path(),
        &[
            "--durable",
            "--pg-setting",
            "shared_preload_libraries=pg_stat_statements",
            "--pg-setting",
            "work_mem=7MB",
        ],
    );
    assert_eq!(
        server_settings(&dir, &["shared_preload_libraries", "work_mem", "fsync"]),
        "pg_stat_statements 7MB on",
        "the settings of dev up --pg-setting, beside --durable's"
    );
    drop(stop);

    let up = Command::new(EXE)
        .args(["dev", "up", "--detach", "--pg-setting", "work_mem 7MB"])
        .env("TMPDIR", tmp.path())
        .output()
        .unwrap_or_else(|e| panic!("dlock dev up: {e}"));
    let said = String::from_utf8_lossy(&up.stderr);
    assert!(
        !up.status.success(),
        "a malformed setting was taken: {said}"
    );
    assert!(
        said.contains("`work_mem 7MB` is not NAME=VALUE"),
        "the refusal names the setting and the form: {said}"
    );
    assert!(
        up.stdout.is_empty(),
        "nothing started, so nothing to export: {}",
        String::from_utf8_lossy(&up.stdout)
    );
}
