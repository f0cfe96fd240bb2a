use super::*;
use std::os::unix::fs::PermissionsExt;

fn line(dir: &Path, executor: &str) -> UpLine {
    UpLine {
        lock_server: "http://127.0.0.1:40123".into(),
        payment_resource: Some("http://127.0.0.1:40124".into()),
        rail_proxy: Some("http://127.0.0.1:40125".into()),
        rail_stub: Some("http://127.0.0.1:40126".into()),
        backend: "pg",
        pids: Pids {
            lock_server: Some(1),
            payment_resource: None,
            rail_proxy: None,
            rail_stub: None,
        },
        paydb: "postgres://postgres@127.0.0.1:40001/paydb".into(),
        lockdb: "postgres://postgres@127.0.0.1:40001/lockdb".into(),
        etcd: None,
        tokens_file: dir.join("tokens").display().to_string(),
        proof_keys_file: dir.join("fencing-proof-keys").display().to_string(),
        data_dir: dir.display().to_string(),
        env_file: dir.join(ENV_FILE).display().to_string(),
        credentials: Credentials {
            executor: executor.into(),
            operator: DEV_OPERATOR_TOKEN.into(),
            treasury: "treasury-token-for-the-test".into(),
            registrar: "registrar-token-for-the-test".into(),
        },
    }
}

/// Sources `file` in bash and prints each of `names` on a line of its own.
fn sourced(file: &Path, names: &[&str]) -> Vec<String> {
    let script = format!(
        "set -eu; PATH=/usr/bin:/bin; source {}; for n in {}; do printf '%s\\n' \"${{!n}}\"; done; \
         printf '%s\\n' \"$PATH\"",
        shell_quote(&file.display().to_string()),
        names.join(" ")
    );
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .unwrap_or_else(|e| panic!("bash: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_env_file_gives_a_shell_every_variable_the_readme_uses_and_is_private() {
    let temp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    // A directory with a quote and a space still round-trips through the shell.
    let dir = temp.path().join("it's a dir");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let up = line(&dir, "exec-token-0123456789abcdef");
    let bin = Path::new("/opt/dlock bin");
    let env = Path::new(&up.env_file);
    // A file that was readable by others is narrowed before the secrets go in.
    std::fs::write(env, "old").unwrap_or_else(|e| panic!("{e}"));
    std::fs::set_permissions(env, std::fs::Permissions::from_mode(0o644))
        .unwrap_or_else(|e| panic!("{e}"));
    write_private(env, &env_file_text(&up, 1_500, Some(bin))).unwrap_or_else(|e| panic!("{e}"));
    let mode = std::fs::metadata(env)
        .unwrap_or_else(|e| panic!("{e}"))
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    let names = [
        "DLOCK_DEV_DIR",
        "DLOCK_LOCK_SERVER",
        "DLOCK_PAYMENT_RESOURCE",
        "DLOCK_RAIL_PROXY",
        "DLOCK_RAIL_READ_TIMEOUT_MS",
        "DLOCK_IDENTITY",
        "DLOCK_CREDENTIAL",
        "DLOCK_TREASURY_IDENTITY",
        "DLOCK_TREASURY_CREDENTIAL",
        "DLOCK_OPERATOR_TOKEN",
        "DLOCK_PAYDB",
        "DLOCK_RAIL",
        "LS",
        "PR",
        "RP",
        "RAIL",
        "TOKEN",
        "TRTOKEN",
        "RGTOKEN",
        "OPTOKEN",
    ];
    let values = sourced(env, &names);
    let expected = [
        dir.display().to_string().as_str(),
        "http://127.0.0.1:40123",
        "http://127.0.0.1:40124",
        "http://127.0.0.1:40125",
        "1500",
        "executor",
        "exec-token-0123456789abcdef",
        "treasury",
        "treasury-token-for-the-test",
        DEV_OPERATOR_TOKEN,
        "postgres://postgres@127.0.0.1:40001/paydb",
        "http://127.0.0.1:40126",
        "http://127.0.0.1:40123",
        "http://127.0.0.1:40124",
        "http://127.0.0.1:40125",
        "http://127.0.0.1:40126",
        "exec-token-0123456789abcdef",
        "treasury-token-for-the-test",
        "registrar-token-for-the-test",
        DEV_OPERATOR_TOKEN,
    ]
    .map(str::to_owned);
    assert_eq!(values[..names.len()], expected[..]);
    // The binary that runs the stack comes first on PATH, once.
    assert_eq!(values[names.len()], "/opt/dlock bin:/usr/bin:/bin");
    // Without a binary directory PATH is left alone.
    write_private(env, &env_file_text(&up, 8_000, None)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sourced(env, &[]), vec!["/usr/bin:/bin".to_owned()]);
}

#[test]
fn what_dev_up_writes_for_people_names_no_secret() {
    let temp = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (tokens, proxy, credentials) = write_tokens(temp.path()).unwrap_or_else(|e| panic!("{e}"));
    for file in [&tokens, &proxy] {
        let mode = std::fs::metadata(file)
            .unwrap_or_else(|e| panic!("{e}"))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{}: {mode:o}", file.display());
    }
    // Positive control: the tokens file does hold the executor's token.
    let text = std::fs::read_to_string(&tokens).unwrap_or_else(|e| panic!("{e}"));
    assert!(text.contains(&credentials.executor));
    let up = line(temp.path(), &credentials.executor);
    let env_text = env_file_text(&up, 8_000, None);
    assert!(env_text.contains(&credentials.executor));
    // The env file's own comment lines (what `head` or a reviewer sees) hold no secret.
    for comment in env_text.lines().filter(|l| l.starts_with('#')) {
        assert!(!comment.contains(&credentials.executor), "{comment}");
    }
}
