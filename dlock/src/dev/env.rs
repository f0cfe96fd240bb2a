//! The env file `dev up` writes: what a shell needs to use the stack, readable by its owner only.

use std::path::Path;

use anyhow::{Context, Result};

use super::{DEV_EXECUTOR_IDENTITY, UpLine};

/// The env file in the data directory, and the file holding the pid of the running `dev up`.
pub const ENV_FILE: &str = "env";
pub const PID_FILE: &str = "dev-up.pid";

/// `text` in single quotes for a POSIX shell.
pub(super) fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// What a shell needs to use the stack as the README shows: the variables the dlock commands
/// read, short names for the curl examples, and the `dlock` binary that runs this stack first on
/// PATH. It holds the stack's credentials: [`write_private`] makes it readable by its owner
/// only, and it is never logged.
pub(crate) fn env_file_text(
    line: &UpLine,
    rail_read_timeout_ms: u64,
    bin_dir: Option<&Path>,
) -> String {
    let payment = line.payment_resource.as_deref().unwrap_or_default();
    let proxy = line.rail_proxy.as_deref().unwrap_or_default();
    let stub = line.rail_stub.as_deref().unwrap_or_default();
    let q = shell_quote;
    let mut out = format!(
        "# The local stack of `dlock dev up` (data in {dir}). Load it into a shell with\n\
         #   source {env}\n\
         # It holds this stack's credentials: keep it to yourself (mode 0600).\n\
         export DLOCK_DEV_DIR={dir_q}\n\
         export DLOCK_LOCK_SERVER={ls}\n\
         export DLOCK_PAYMENT_RESOURCE={pr}\n\
         export DLOCK_RAIL_PROXY={rp}\n\
         export DLOCK_RAIL_READ_TIMEOUT_MS={rail_read_timeout_ms}\n\
         # dlock run: who writes (owner ids `executor/<worker>`)\n\
         export DLOCK_IDENTITY={identity}\n\
         export DLOCK_CREDENTIAL={executor}\n\
         # dlock run registers the batch's payouts as the registrar (the registrar role)\n\
         export DLOCK_REGISTRAR_IDENTITY={registrar_identity}\n\
         export DLOCK_REGISTRAR_CREDENTIAL={registrar}\n\
         # dlock accounts: the treasury, the only identity that opens and funds accounts\n\
         export DLOCK_TREASURY_IDENTITY={treasury_identity}\n\
         export DLOCK_TREASURY_CREDENTIAL={treasury}\n\
         # dlock revoke, dlock resolve: the operator credential\n\
         export DLOCK_OPERATOR_TOKEN={operator}\n\
         # dlock reconcile: paydb and the rail whose statement it compares\n\
         export DLOCK_PAYDB={paydb}\n\
         export DLOCK_RAIL={stub}\n\
         # short names for the curl examples\n\
         LS={ls}\n\
         PR={pr}\n\
         RP={rp}\n\
         RAIL={stub}\n\
         TOKEN={executor}\n\
         TRTOKEN={treasury}\n\
         RGTOKEN={registrar}\n\
         OPTOKEN={operator}\n",
        dir = line.data_dir,
        env = line.env_file,
        dir_q = q(&line.data_dir),
        ls = q(&line.lock_server),
        pr = q(payment),
        rp = q(proxy),
        stub = q(stub),
        identity = q(DEV_EXECUTOR_IDENTITY),
        executor = q(&line.credentials.executor),
        treasury_identity = q(crate::dev::DEV_TREASURY_IDENTITY),
        treasury = q(&line.credentials.treasury),
        registrar_identity = q(crate::dev::DEV_REGISTRAR_IDENTITY),
        registrar = q(&line.credentials.registrar),
        operator = q(&line.credentials.operator),
        paydb = q(&line.paydb),
    );
    if let Some(bin) = bin_dir {
        let bin = bin.display().to_string();
        out.push_str(&format!(
            "# the dlock that runs this stack\n\
             case \":$PATH:\" in *:{bin_q}:*) ;; *) export PATH={bin_q}:\"$PATH\" ;; esac\n",
            bin_q = q(&bin),
        ));
    }
    out
}

/// Writes `text` to `path`, created readable and writable by its owner only (an existing file
/// is narrowed to 0600 before it is rewritten).
pub(crate) fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if path.exists() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("restricting {}", path.display()))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}
