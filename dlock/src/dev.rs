//! `dlock dev up`: the whole stack on one machine, for people and tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use dlock_devstack::stack::{LockBackend, Role, Stack};
use dlock_devstack::{Durability, EtcdServer, pg_setting, wait_until};
use serde::Serialize;

mod env;

#[cfg(test)]
use env::shell_quote;
pub use env::{ENV_FILE, PID_FILE};
pub(crate) use env::{env_file_text, write_private};

/// The one line `dev up` prints on stdout, in the documented field order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct UpLine {
    pub(crate) lock_server: String,
    pub(crate) payment_resource: Option<String>,
    pub(crate) rail_proxy: Option<String>,
    pub(crate) rail_stub: Option<String>,
    pub(crate) backend: &'static str,
    pub(crate) pids: Pids,
    pub(crate) paydb: String,
    pub(crate) lockdb: String,
    pub(crate) etcd: Option<String>,
    /// Every service runs with `auth.mode = "tokens"` on this file.
    pub(crate) tokens_file: String,
    /// The lock server, payment resource and rail proxy prove fencing tokens with this file
    /// (`fencing.proof-keys-file`, docs/design.md#d-8).
    pub(crate) proof_keys_file: String,
    /// The data directory: databases, logs, the env file and `dev-up.pid`.
    pub(crate) data_dir: String,
    /// The env file `dev up` writes (mode 0600): `source` it, and the shell has the stack.
    pub(crate) env_file: String,
    pub(crate) credentials: Credentials,
}

/// The local stack's bearer tokens: `executor` for `dlock run`'s payout cycles (owner ids
/// `executor/…`), `registrar` for its registration of the payouts, `operator` for revocations,
/// fence advances and resolutions (docs/threat-model.md#roles).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Credentials {
    pub(crate) executor: String,
    pub(crate) operator: String,
    /// The treasury's: the only identity that may open and fund accounts.
    pub(crate) treasury: String,
    /// The registrar's: the only identity that may register payouts.
    pub(crate) registrar: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Pids {
    lock_server: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payment_resource: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rail_proxy: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rail_stub: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    Pg,
    Etcd,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// The lock server's backend.
    #[arg(long, value_enum, default_value = "pg")]
    pub backend: BackendArg,
    /// The rail stub's fixed delay before answering, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub rail_latency_ms: u64,
    /// The share of rail calls that fail (5xx or a dropped connection), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    pub rail_failure_rate: f64,
    /// The share of repeated clientRefs the rail accepts again under a new reference, 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    pub rail_duplicate_ack_rate: f64,
    /// The share of rail calls that take the transfer and then answer `307` (a gateway that
    /// redirects): the rail proxy follows no redirect, so each such payout is RAIL_AMBIGUOUS.
    #[arg(long, default_value_t = 0.0)]
    pub rail_redirect_rate: f64,
    /// The rail proxy's read timeout towards the rail, in milliseconds.
    #[arg(long, default_value_t = 8_000)]
    pub rail_read_timeout_ms: u64,
    /// A funding above this many minor units waits for a second treasury identity's approval
    /// (the payment resource's `auth.treasury.dual-approval-above`). Unset: none waits.
    #[arg(long)]
    pub treasury_dual_approval_above: Option<i64>,
    /// Run PostgreSQL with production's durability (fsync and full-page writes on, each commit
    /// waiting for its WAL flush) instead of the local stack's fast mode (both off): slower
    /// commits, the figures a production database would show.
    #[arg(long)]
    pub durable: bool,
    /// One more PostgreSQL server setting, `NAME=VALUE` as for `postgres -c` (repeat for more):
    /// for instance `shared_preload_libraries=pg_stat_statements` and
    /// `pg_stat_statements.track=all` to see which statements a run spends its time in
    /// (scripts/paydb-statements).
    #[arg(long = "pg-setting", value_name = "NAME=VALUE", value_parser = pg_setting)]
    pub pg_settings: Vec<String>,
    /// Keep the databases and logs here (and reuse them next time) instead of a temp dir.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Start the stack in the background and return once it is ready, printing its env file
    /// on stdout (for `eval "$(dlock dev up --detach)"`) instead of the JSON line. Stop it with
    /// `dlock dev down`.
    #[arg(long)]
    pub detach: bool,
    /// Remove the data directory when the stack stops (set by `--detach` for the directory it
    /// makes itself).
    #[arg(long, hide = true)]
    pub remove_data_dir: bool,
}

#[derive(Debug, Args)]
pub struct DownArgs {
    /// The data directory of the stack to stop (the env file sets DLOCK_DEV_DIR).
    #[arg(long, env = "DLOCK_DEV_DIR")]
    pub data_dir: PathBuf,
}

/// The operator credential of the local stack (revocation floors, resolutions). Local only.
pub const DEV_OPERATOR_TOKEN: &str = "dev-operator-token";
/// The rail proxy's identity towards the rail stub on the local stack: the one identity the
/// stub takes transfers from (`rail.stub.submitter-identities`' default).
pub const DEV_RAIL_PROXY_IDENTITY: &str = dlock_rail_stub::DEFAULT_SUBMITTER;
/// The identity `dlock run` and the demo write as on the local stack.
pub const DEV_EXECUTOR_IDENTITY: &str = "executor";
/// The identity `dlock run` and the demo register payouts as on the local stack.
pub const DEV_REGISTRAR_IDENTITY: &str = dlock_server::auth::DEFAULT_REGISTRAR_IDENTITY;
/// The identity that opens and funds accounts on the local stack (`auth.treasury-identities`'
/// default).
pub const DEV_TREASURY_IDENTITY: &str = dlock_server::auth::DEFAULT_TREASURY_IDENTITY;

fn random_token() -> String {
    use rand::Rng;
    let bytes: [u8; 24] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the stack's tokens file (and the proxy's own credential towards the rail).
fn write_tokens(dir: &Path) -> Result<(PathBuf, PathBuf, Credentials)> {
    let executor = random_token();
    let treasury = random_token();
    let registrar = random_token();
    let proxy = random_token();
    let tokens = dir.join("tokens");
    write_private(
        &tokens,
        &format!(
            "# written by `dlock dev up`: <identity> <token> [roles]; each identity has the role \
             of its name (auth.<role>-identities' defaults), and the operator also registers \
             (the dlock operator registers a PayoutBatch's payouts itself)\n\
             {DEV_EXECUTOR_IDENTITY} {executor}\n\
             {DEV_TREASURY_IDENTITY} {treasury}\n\
             {DEV_REGISTRAR_IDENTITY} {registrar}\n\
             operator {DEV_OPERATOR_TOKEN} registrar\n\
             {DEV_RAIL_PROXY_IDENTITY} {proxy}\n"
        ),
    )
    .with_context(|| format!("writing {}", tokens.display()))?;
    let proxy_credential = dir.join("rail-proxy.credential");
    write_private(&proxy_credential, &format!("{proxy}\n"))?;
    Ok((
        tokens,
        proxy_credential,
        Credentials {
            executor,
            operator: DEV_OPERATOR_TOKEN.to_owned(),
            treasury,
            registrar,
        },
    ))
}

/// Writes the stack's fencing-proof keys (`<key-id> <secret>`; the first line signs), readable
/// by this user only. A fresh secret every start: proofs of an earlier run prove nothing.
fn write_proof_keys(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("fencing-proof-keys");
    let secret = format!("{}{}", random_token(), random_token());
    write_private(
        &path,
        &format!(
            "# written by `dlock dev up`: <key-id> <secret>, the first line signs\ndev {secret}\n"
        ),
    )?;
    Ok(path)
}

pub async fn up(args: UpArgs) -> Result<()> {
    for (name, rate) in [
        ("--rail-failure-rate", args.rail_failure_rate),
        ("--rail-duplicate-ack-rate", args.rail_duplicate_ack_rate),
        ("--rail-redirect-rate", args.rail_redirect_rate),
    ] {
        if !(0.0..=1.0).contains(&rate) {
            bail!("{name} must be between 0 and 1, got {rate}");
        }
    }
    if args.detach {
        return tokio::task::spawn_blocking(move || detach(&args)).await?;
    }
    let read_timeout = args.rail_read_timeout_ms;
    let remove_data_dir = args
        .remove_data_dir
        .then(|| args.data_dir.clone())
        .flatten();
    let (stack, line) = tokio::task::spawn_blocking(move || start_stack(&args)).await??;
    let env_file = PathBuf::from(&line.env_file);
    let pid_file = Path::new(&line.data_dir).join(PID_FILE);
    let bin_dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf));
    write_private(
        &env_file,
        &env_file_text(&line, read_timeout, bin_dir.as_deref()),
    )?;
    std::fs::write(&pid_file, format!("{}\n", std::process::id()))
        .with_context(|| format!("writing {}", pid_file.display()))?;
    println!("{}", serde_json::to_string(&line)?);
    use std::io::Write;
    let _ = std::io::stdout().flush();
    eprintln!(
        "dlock dev up: the stack is running; load it into a shell with\n  source {}\n\
         stop it with Ctrl-C (SIGINT), SIGTERM or `dlock dev down`",
        env_file.display()
    );
    dlock_server::http::shutdown_signal().await;
    eprintln!("dlock dev up: stopping");
    tokio::task::spawn_blocking(move || drop(stack)).await?;
    // The env file's addresses and credentials die with the stack.
    // `dev down` waits for the pid file to go: it goes last (with the directory, if it is ours).
    let _ = std::fs::remove_file(&env_file);
    match remove_data_dir {
        Some(dir) => remove_pid_file_last(&dir),
        None => {
            let _ = std::fs::remove_file(&pid_file);
        }
    }
    Ok(())
}

/// Removes `dir` with its pid file last, so that `dev down` returns when it is all gone.
fn remove_pid_file_last(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_name() == PID_FILE {
                continue;
            }
            let _ = match entry.file_type() {
                Ok(kind) if kind.is_dir() => std::fs::remove_dir_all(&path),
                _ => std::fs::remove_file(&path),
            };
        }
    }
    let _ = std::fs::remove_file(dir.join(PID_FILE));
    let _ = std::fs::remove_dir(dir);
}

/// `dev up --detach`: the same command again in the background (its own process group, so a
/// Ctrl-C in this shell does not stop it), stdout to `up.json` and stderr to `logs/dev-up.log`
/// in the data directory; returns once the stack's line is written, and prints the env file.
fn detach(args: &UpArgs) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let (dir, made) = match &args.data_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            tempfile::Builder::new()
                .prefix("dlock-dev-")
                .tempdir()
                .context("making the data directory")?
                .keep(),
            true,
        ),
    };
    std::fs::create_dir_all(dir.join("logs"))
        .with_context(|| format!("making {}", dir.join("logs").display()))?;
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--detach")
        .collect();
    if args.data_dir.is_none() {
        argv.push("--data-dir".into());
        argv.push(dir.clone().into());
        argv.push("--remove-data-dir".into());
    }
    let line_path = dir.join("up.json");
    let log_path = dir.join("logs").join("dev-up.log");
    let _ = std::fs::remove_file(&line_path);
    // The line carries the credentials, like the env file.
    write_private(&line_path, "")?;
    let stdout = std::fs::OpenOptions::new()
        .write(true)
        .open(&line_path)
        .with_context(|| format!("writing {}", line_path.display()))?;
    let stderr = std::fs::File::create(&log_path)
        .with_context(|| format!("writing {}", log_path.display()))?;
    let exe = std::env::current_exe().context("locating the dlock binary")?;
    let mut child = std::process::Command::new(exe)
        .args(&argv)
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0)
        .spawn()
        .context("starting dlock dev up in the background")?;
    let mut exited = None;
    let ready = wait_until("dlock dev up", Duration::from_secs(180), || {
        if let Ok(Some(status)) = child.try_wait() {
            exited = Some(status);
            return true;
        }
        std::fs::read_to_string(&line_path).is_ok_and(|text| text.ends_with('\n'))
    });
    if ready.is_err() || exited.is_some() {
        if exited.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(8).collect();
        if made {
            let _ = std::fs::remove_dir_all(&dir);
        }
        bail!(
            "the stack did not start ({}); last lines of its log:\n{}",
            match exited {
                Some(status) => format!("dlock dev up exited: {status}"),
                None => "not ready after 180 s".to_owned(),
            },
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let env_file = dir.join(ENV_FILE);
    let text = std::fs::read_to_string(&env_file)
        .with_context(|| format!("reading {}", env_file.display()))?;
    print!("{text}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    eprintln!(
        "dlock dev up: the stack runs in the background (pid {}); data, logs and env file in {}; \
         stop it with `dlock dev down` (it reads DLOCK_DEV_DIR, which the env file sets)",
        child.id(),
        dir.display()
    );
    Ok(())
}

/// `dev down`: SIGTERM to the `dev up` of a data directory, then waits until it has stopped
/// its services (it removes its pid file last).
pub fn down(args: &DownArgs) -> Result<()> {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let pid_file = args.data_dir.join(PID_FILE);
    let text = match std::fs::read_to_string(&pid_file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "dlock dev down: no stack runs in {} (no {PID_FILE})",
                args.data_dir.display()
            );
            return Ok(());
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", pid_file.display())),
    };
    let pid: i32 = text
        .trim()
        .parse()
        .with_context(|| format!("{} holds no pid", pid_file.display()))?;
    let pid = Pid::from_raw(pid);
    let gone = |pid| kill(pid, None).is_err();
    if !gone(pid) {
        kill(pid, Signal::SIGTERM).with_context(|| format!("stopping dlock dev up ({pid})"))?;
    }
    // The pid file goes last but for the directory itself, when `dev up` removes that: an
    // empty directory is one about to go.
    let settled = || match std::fs::read_dir(&args.data_dir) {
        Ok(mut entries) => entries.next().is_some() && !pid_file.exists(),
        Err(_) => true,
    };
    wait_until("dlock dev up to stop", Duration::from_secs(60), || {
        settled() || gone(pid)
    })
    .with_context(|| format!("dlock dev up ({pid}) did not stop within 60 s"))?;
    // A `dev up` that died without cleaning up leaves its pid file behind.
    let _ = std::fs::remove_file(&pid_file);
    eprintln!(
        "dlock dev down: stopped the stack in {}",
        args.data_dir.display()
    );
    Ok(())
}

/// Starts the stack of `dev up` (and `dlock demo`) in its data directory: the four services
/// with the tokens file's authentication and fencing proofs on, and the line describing it.
pub(crate) fn start_stack(args: &UpArgs) -> Result<(Stack, UpLine)> {
    let exe = std::env::current_exe().context("locating the dlock binary")?;
    let (builder, dir) = match &args.data_dir {
        Some(dir) => (Stack::builder(exe).data_dir(dir), dir.clone()),
        None => {
            let temp = tempfile::Builder::new().prefix("dlock-dev-").tempdir()?;
            let dir = temp.path().to_path_buf();
            (Stack::builder(exe).in_dir(temp), dir)
        }
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("making {}", dir.display()))?;
    eprintln!("dlock dev up: data and logs in {}", dir.display());
    // The services read both as i64.
    i64::try_from(args.rail_latency_ms).context("--rail-latency-ms is too large")?;
    i64::try_from(args.rail_read_timeout_ms).context("--rail-read-timeout-ms is too large")?;
    let (tokens_file, proxy_credential, credentials) = write_tokens(&dir)?;
    let proof_keys_file = write_proof_keys(&dir)?;
    let mut builder = builder
        .lock_backend(match args.backend {
            BackendArg::Pg => LockBackend::Pg,
            BackendArg::Etcd => LockBackend::Etcd,
        })
        .durability(match args.durable {
            true => Durability::Durable,
            false => Durability::Fast,
        })
        .auth_tokens_file(&tokens_file)
        .proof_keys_file(&proof_keys_file)
        .rail_read_timeout_ms(args.rail_read_timeout_ms)
        .set(
            Role::RailProxy,
            "rail.proxy.rail-credential-file",
            proxy_credential.display().to_string(),
        );
    for (key, value) in [
        ("rail.stub.latency-ms", args.rail_latency_ms.to_string()),
        ("rail.stub.failure-rate", args.rail_failure_rate.to_string()),
        (
            "rail.stub.duplicate-ack-rate",
            args.rail_duplicate_ack_rate.to_string(),
        ),
        (
            "rail.stub.redirect-rate",
            args.rail_redirect_rate.to_string(),
        ),
    ] {
        builder = builder.set(Role::RailStub, key, value);
    }
    for setting in &args.pg_settings {
        builder = builder.pg_setting(setting);
    }
    if let Some(above) = args.treasury_dual_approval_above {
        builder = builder.set(
            Role::PaymentResource,
            "auth.treasury.dual-approval-above",
            above.to_string(),
        );
    }
    let stack = builder.try_start()?;
    let line = UpLine {
        lock_server: stack.lock().url(),
        payment_resource: Some(stack.payment().url()),
        rail_proxy: Some(stack.proxy().url()),
        rail_stub: Some(stack.stub().url()),
        backend: match args.backend {
            BackendArg::Pg => "pg",
            BackendArg::Etcd => "etcd",
        },
        pids: Pids {
            lock_server: stack.lock().pid(),
            payment_resource: stack.payment().pid(),
            rail_proxy: stack.proxy().pid(),
            rail_stub: stack.stub().pid(),
        },
        paydb: stack.pg().url("paydb"),
        lockdb: stack.pg().url("lockdb"),
        etcd: stack.etcd.as_ref().map(EtcdServer::endpoint),
        tokens_file: tokens_file.display().to_string(),
        proof_keys_file: proof_keys_file.display().to_string(),
        data_dir: dir.display().to_string(),
        env_file: dir.join(ENV_FILE).display().to_string(),
        credentials,
    };
    Ok((stack, line))
}

#[cfg(test)]
mod tests;
