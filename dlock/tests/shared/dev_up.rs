//! `dlock dev up` as a process: the four services, PostgreSQL, authentication on, described by
//! the JSON line it prints first.

use std::io::BufRead as _;
use std::process::{Command, Stdio};

use dlock_contract::auth::Credential;
use dlock_contract::payment_client::PaymentClient;
use dlock_devstack::ManagedChild;
use serde_json::Value;

/// A running `dlock dev up`, its line parsed; its data and its log (stderr) in a directory of
/// its own that goes with it.
pub struct DevUp {
    /// The stack's URLs (`lockServer`, …, `paydb`), `proofKeysFile` and `credentials`.
    pub line: Value,
    _child: ManagedChild,
    _dir: tempfile::TempDir,
}

impl DevUp {
    /// `dlock dev up ARGS` with `env` for every process of the stack (e.g. an OTLP endpoint).
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let log_path = dir.path().join("dev-up.log");
        let log = std::fs::File::create(&log_path).unwrap_or_else(|e| panic!("dev up log: {e}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_dlock"))
            .args(["dev", "up", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting dlock dev up: {e}"));
        let stdout = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        let child = ManagedChild::new("dev-up", child);
        let mut first = String::new();
        std::io::BufReader::new(stdout)
            .read_line(&mut first)
            .unwrap_or_else(|e| panic!("reading dev up's line: {e}"));
        let line: Value = serde_json::from_str(&first).unwrap_or_else(|e| {
            panic!(
                "dev up's line is not JSON ({e}): {first}\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            )
        });
        Self {
            line,
            _child: child,
            _dir: dir,
        }
    }

    /// A string field of the line (a service URL, `paydb`, `proofKeysFile`).
    pub fn url(&self, field: &str) -> String {
        self.line[field]
            .as_str()
            .unwrap_or_else(|| panic!("no {field} in {}", self.line))
            .to_owned()
    }

    /// The credential of `who` (`executor`, `operator`, `treasury`).
    pub fn token(&self, who: &str) -> String {
        self.line["credentials"][who]
            .as_str()
            .unwrap_or_else(|| panic!("no {who} credential in {}", self.line))
            .to_owned()
    }

    /// A client of the payment resource with the treasury's credential (owner `treasury/setup`):
    /// the only identity that may open and fund accounts.
    pub fn treasury_payments(&self) -> PaymentClient {
        PaymentClient::new(&self.url("paymentResource"), "treasury/setup")
            .unwrap_or_else(|e| panic!("{e}"))
            .with_credential(Some(Credential::fixed(&self.token("treasury"))))
    }

    /// A client of the payment resource with the registrar's credential (owner
    /// `registrar/setup`): the only identity that may register payouts.
    #[allow(dead_code)] // the it suite's; the k8s suite includes this file too
    pub fn registrar_payments(&self) -> PaymentClient {
        PaymentClient::new(&self.url("paymentResource"), "registrar/setup")
            .unwrap_or_else(|e| panic!("{e}"))
            .with_credential(Some(Credential::fixed(&self.token("registrar"))))
    }

    /// The environment of a `dlock run` on this stack: the executor's credential for the payout
    /// cycles, the registrar's for registering the batch.
    pub fn run_env(&self) -> Vec<(String, String)> {
        vec![
            ("DLOCK_CREDENTIAL".to_owned(), self.token("executor")),
            (
                "DLOCK_REGISTRAR_IDENTITY".to_owned(),
                "registrar".to_owned(),
            ),
            (
                "DLOCK_REGISTRAR_CREDENTIAL".to_owned(),
                self.token("registrar"),
            ),
        ]
    }

    /// A client of the payment resource with the executor identity's credential, calling as
    /// `owner`.
    pub fn payments_as(&self, owner: &str) -> PaymentClient {
        PaymentClient::new(&self.url("paymentResource"), owner)
            .unwrap_or_else(|e| panic!("{e}"))
            .with_credential(Some(Credential::fixed(&self.token("executor"))))
    }
}
