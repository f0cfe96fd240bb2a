//! One way to start a stack of real services for a test or a benchmark: which `dlock serve`
//! processes, on which lock backend, with which faults (a network namespace some of them run
//! in, a fault proxy in front of the rail), and the handles to all of it.
//!
//! ```no_run
//! # use dlock_devstack::stack::{LockBackend, Role, Stack};
//! let stack = Stack::builder(env!("CARGO_MANIFEST_DIR"))
//!     .lock_backend(LockBackend::Etcd)
//!     .rail_stub(&[("rail.stub.latency-ms", "20")])
//!     .rail_read_timeout_ms(1_000)
//!     .in_netns(&[Role::LockServer])
//!     .start();
//! let url = stack.lock().url();
//! ```
//!
//! [`StackBuilder::start`] starts everything or panics with what would not start: a test that
//! cannot build its stack has failed. `dlock dev up` builds its stack here too, with
//! [`StackBuilder::try_start`], which returns that error instead.
//!
//! The stack's directory holds each service's `<name>.toml`, its log under `logs/<name>.log`,
//! and PostgreSQL's and etcd's data (`postgres/`, `etcd/`), reused when the directory is.
//!
//! The integration tests' `LockStack`, `PayStack` and `RailWorld` (dlock/tests/it) are stacks of
//! this builder too: a role can be [deferred](StackBuilder::deferred) and started as many times as
//! a test needs ([`Stack::add`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::faultproxy::FaultProxy;
use crate::netfault::NetNs;
use crate::{
    Durability, EtcdServer, ManagedChild, PgServer, free_port, http_status, spawn_command,
    spawn_logged, wait_until,
};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// The rail stub's statement file in the stack's directory (a test may write one first).
pub const STATEMENT_FILE: &str = "rail-statement.jsonl";

/// A service of the payout path, as `dlock serve <name>` starts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    LockServer,
    PaymentResource,
    RailStub,
    RailProxy,
}

impl Role {
    /// Every role, in start order (the proxy last: it needs the rail's address).
    pub const ALL: [Role; 4] = [
        Role::LockServer,
        Role::PaymentResource,
        Role::RailStub,
        Role::RailProxy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::LockServer => "lock-server",
            Role::PaymentResource => "payment-resource",
            Role::RailStub => "rail-stub",
            Role::RailProxy => "rail-proxy",
        }
    }
}

/// Where the lock server keeps its locks.
#[derive(Debug, Clone)]
pub enum LockBackend {
    /// `lockdb` on the stack's PostgreSQL.
    Pg,
    /// An etcd started for the stack.
    Etcd,
    /// Whatever these `lock.*` keys say (an etcd cluster the test runs itself, say).
    Config(Vec<(&'static str, String)>),
}

/// One `dlock serve` process, on the host or inside the stack's namespace; restartable.
pub struct Service {
    pub role: Role,
    pub addr: SocketAddr,
    in_ns: bool,
    exe: PathBuf,
    /// The `--config` file this service is started with.
    config: PathBuf,
    /// Environment variables its process gets beside the test's own.
    env: Vec<(String, String)>,
    pub log: PathBuf,
    child: Option<ManagedChild>,
}

impl Service {
    /// A service of `template`'s, its files in `dir` named `file` (`<file>.toml`, its log
    /// `logs/<file>.log`), on a free port; `extra` keys replace the template's.
    fn new(
        exe: &Path,
        template: &Template,
        dir: &Path,
        file: &str,
        extra: &[(String, String)],
    ) -> Result<Self> {
        let addr = SocketAddr::new(template.ip, free_port()?);
        let mut config = vec![("server.listen".to_owned(), addr.to_string())];
        config.extend(template.pairs.iter().cloned());
        // As for the stack's own services: `fencing.*` keys of this one's replace running without
        // proofs.
        if extra.iter().any(|(k, _)| k.starts_with("fencing.")) {
            config.retain(|(k, _)| k != "fencing.insecure-no-proofs");
        }
        for (key, value) in extra {
            match config.iter_mut().find(|(k, _)| k == key) {
                Some(pair) => pair.1 = value.clone(),
                None => config.push((key.clone(), value.clone())),
            }
        }
        let path = dir.join(format!("{file}.toml"));
        crate::write_config(&path, &config)?;
        Ok(Self {
            role: template.role,
            addr,
            in_ns: template.in_ns,
            exe: exe.to_path_buf(),
            config: path,
            env: template.env.clone(),
            log: dir.join("logs").join(format!("{file}.log")),
            child: None,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(ManagedChild::pid)
    }

    pub fn child(&self) -> Option<&ManagedChild> {
        self.child.as_ref()
    }

    /// Starts the process (inside `ns` if it is placed there) and waits until it is ready; the
    /// error names the service, says whether it exited, and shows the last lines of its log.
    pub fn start(&mut self, ns: Option<&NetNs>) -> Result<()> {
        let name = self.role.name();
        let args = vec![
            "serve".to_owned(),
            name.to_owned(),
            "--config".to_owned(),
            self.config.display().to_string(),
        ];
        let command = match ns {
            Some(ns) if self.in_ns => ns.command(&self.exe),
            _ => Command::new(&self.exe),
        };
        let mut child = spawn_command(name, command, &args, &self.env, Some(&self.log))?;
        let addr = self.addr;
        // A service that exits (a port taken, a bad configuration) ends the wait at once.
        let ready = wait_until(name, Duration::from_secs(60), || {
            child.exited() || http_status(addr, "/readyz") == Some(200)
        });
        let exited = child.exited();
        if ready.is_err() || exited {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            bail!(
                "{name} {} on {addr}; last log lines ({}):\n{}",
                match exited {
                    true => "exited before it became ready",
                    false => "did not become ready",
                },
                self.log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no shutdown path runs, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }
}

/// How a stack runs one role: where its services listen and their configuration (without
/// `server.listen`); every service of the role is started from it.
#[derive(Debug, Clone)]
struct Template {
    role: Role,
    ip: IpAddr,
    in_ns: bool,
    pairs: Vec<(String, String)>,
    env: Vec<(String, String)>,
}

/// What to start; [`Stack::builder`] makes one, [`StackBuilder::start`] starts it.
pub struct StackBuilder {
    exe: PathBuf,
    roles: Vec<Role>,
    backend: LockBackend,
    read_timeout_ms: Option<u64>,
    operator_token: Option<String>,
    extra: Vec<(Role, String, String)>,
    env: Vec<(Role, String, String)>,
    deferred: Vec<Role>,
    in_ns: Vec<Role>,
    netns: bool,
    rail_fault_proxy: bool,
    executor_args: Vec<String>,
    /// The directory to start in, and the guard that removes it (none for a kept one).
    dir: Option<(PathBuf, Option<tempfile::TempDir>)>,
    durability: Durability,
    pg_settings: Vec<String>,
}

impl StackBuilder {
    /// Only these services (by default all four).
    pub fn only(mut self, roles: &[Role]) -> Self {
        self.roles = roles.to_vec();
        self
    }

    /// Prepares these of the stack's services (what they need started, their configuration)
    /// without starting them: [`Stack::add`] starts each, as many of one role as a test wants
    /// (lock-server replicas on one backend, say). A deferred rail stub gives the rail proxy no
    /// `rail.proxy.rail-url`: each proxy added is given its own.
    pub fn deferred(mut self, roles: &[Role]) -> Self {
        self.deferred = roles.to_vec();
        self
    }

    /// The lock server's backend (by default PostgreSQL).
    pub fn lock_backend(mut self, backend: LockBackend) -> Self {
        self.backend = backend;
        self
    }

    /// The rail stub's `rail.stub.*` settings (latency, failure rates, …).
    pub fn rail_stub(mut self, pairs: &[(&str, &str)]) -> Self {
        for (key, value) in pairs {
            self = self.set(Role::RailStub, key, *value);
        }
        self
    }

    /// The rail proxy's read timeout, also given to the executors this stack starts.
    pub fn rail_read_timeout_ms(mut self, ms: u64) -> Self {
        self.read_timeout_ms = Some(ms);
        self
    }

    /// The operator token of the payment resource and the rail proxy.
    pub fn operator_token(mut self, token: &str) -> Self {
        self.operator_token = Some(token.to_owned());
        self
    }

    /// Every service authenticates its callers with `auth.mode = "tokens"` on this file of
    /// `<identity> <token> [roles]` lines; the operator is one of them, so no operator token.
    pub fn auth_tokens_file(mut self, file: &Path) -> Self {
        self.operator_token = None;
        for role in Role::ALL {
            self = self.set(role, "auth.mode", "tokens").set(
                role,
                "auth.tokens-file",
                file.display().to_string(),
            );
        }
        self
    }

    /// The lock server, payment resource and rail proxy prove fencing tokens with this file of
    /// `<key-id> <secret>` lines (`fencing.proof-keys-file`, docs/design.md#d-8).
    pub fn proof_keys_file(mut self, file: &Path) -> Self {
        for role in [Role::LockServer, Role::PaymentResource, Role::RailProxy] {
            self = self.set(role, "fencing.proof-keys-file", file.display().to_string());
        }
        self
    }

    /// PostgreSQL's [`Durability`] (by default [`Durability::Fast`]).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// One more PostgreSQL server setting, `name=value` as for `postgres -c` (after the
    /// durability's: the same name replaces it).
    pub fn pg_setting(mut self, setting: impl Into<String>) -> Self {
        self.pg_settings.push(setting.into());
        self
    }

    /// One more config key for one service (after its defaults: the same key replaces them).
    pub fn set(mut self, role: Role, key: &str, value: impl Into<String>) -> Self {
        self.extra.push((role, key.to_owned(), value.into()));
        self
    }

    /// An environment variable for the processes of `role` (the allocator's options, say).
    pub fn env(mut self, role: Role, key: &str, value: impl Into<String>) -> Self {
        self.env.push((role, key.to_owned(), value.into()));
        self
    }

    /// A network namespace, with these services running inside it (the others on the host).
    pub fn in_netns(mut self, roles: &[Role]) -> Self {
        self.netns = true;
        self.in_ns = roles.to_vec();
        self
    }

    /// A [`FaultProxy`] between the rail proxy and the rail stub.
    pub fn rail_fault_proxy(mut self) -> Self {
        self.rail_fault_proxy = true;
        self
    }

    /// Arguments every executor of [`Stack::executor`] gets, after the endpoints.
    pub fn executor_args(mut self, args: &[&str]) -> Self {
        self.executor_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Starts in `dir` (which may already hold, say, a statement file) instead of a new one.
    pub fn in_dir(mut self, dir: tempfile::TempDir) -> Self {
        self.dir = Some((dir.path().to_path_buf(), Some(dir)));
        self
    }

    /// Starts in `dir`, made if missing and kept afterwards: a second stack there reuses its
    /// databases.
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some((dir.into(), None));
        self
    }

    fn pairs(&self, role: Role, pairs: Vec<(&str, String)>) -> Vec<(String, String)> {
        let mut pairs: Vec<(String, String)> =
            pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        let extra: Vec<(String, String)> = self
            .extra
            .iter()
            .filter(|(r, _, _)| *r == role)
            .map(|(_, k, v)| (k.clone(), v.clone()))
            .collect();
        // The lock server, payment resource and rail proxy refuse to start without proof keys
        // unless told by name (docs/threat-model.md#safe-defaults): this stack runs them without
        // proofs unless a test gives a service its own `fencing.*` keys with `set`.
        let proves = matches!(
            role,
            Role::LockServer | Role::PaymentResource | Role::RailProxy
        );
        if proves && !extra.iter().any(|(k, _)| k.starts_with("fencing.")) {
            pairs.push(("fencing.insecure-no-proofs".to_owned(), "true".to_owned()));
        }
        for (key, value) in extra {
            match pairs.iter_mut().find(|(k, _)| *k == key) {
                Some(pair) => pair.1 = value,
                None => pairs.push((key, value)),
            }
        }
        pairs
    }

    /// Starts the backing servers, then the services in [`Role::ALL`] order; panics with what
    /// would not start.
    pub fn start(self) -> Stack {
        self.try_start().unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// Like [`StackBuilder::start`], returning what would not start instead of panicking.
    pub fn try_start(mut self) -> Result<Stack> {
        // Declared first, dropped last: whatever started before an error stops before its data
        // goes.
        let (dir, temp) = match self.dir.take() {
            Some(dir) => dir,
            None => {
                let temp = tempfile::tempdir().context("making the stack's directory")?;
                (temp.path().to_path_buf(), Some(temp))
            }
        };
        std::fs::create_dir_all(dir.join("logs"))
            .with_context(|| format!("making {}", dir.join("logs").display()))?;
        let wants = |role: Role| self.roles.contains(&role);
        let ns = match self.netns {
            true => Some(NetNs::create().context("cannot build a network partition")?),
            false => None,
        };
        // Services on the host listen on the host end of the veth pair, so that services inside
        // the namespace reach them too; so do PostgreSQL and etcd.
        let host_ip = ns.as_ref().map_or(LOOPBACK, NetNs::host_addr);
        let ns_ip = ns.as_ref().map_or(LOOPBACK, NetNs::ns_addr);
        let extra: Vec<IpAddr> = ns.iter().map(NetNs::host_addr).collect();
        let pg_lock = wants(Role::LockServer) && matches!(self.backend, LockBackend::Pg);
        let pg_pay = wants(Role::PaymentResource) || wants(Role::RailProxy);
        let pg = match pg_lock || pg_pay {
            false => None,
            true => {
                let pg_dir = Some(dir.join("postgres"));
                let pg = match extra.is_empty() {
                    true => PgServer::start_configured(
                        pg_dir.as_deref(),
                        self.durability,
                        &self.pg_settings,
                    )?,
                    false => {
                        ensure!(
                            self.durability == Durability::Fast && self.pg_settings.is_empty(),
                            "a stack with a network namespace runs a fast PostgreSQL with the \
                             default settings only"
                        );
                        PgServer::start_listening(pg_dir.as_deref(), &extra)?
                    }
                };
                for db in ["lockdb", "paydb"] {
                    pg.create_database(db)
                        .with_context(|| format!("create {db}"))?;
                }
                Some(pg)
            }
        };
        let pg_url = |db: &str, role: Role| {
            let ip = if self.in_ns.contains(&role) {
                host_ip
            } else {
                LOOPBACK
            };
            let port = pg.as_ref().map(|p| p.port).unwrap_or_default();
            format!("postgres://postgres@{}/{db}", SocketAddr::new(ip, port))
        };
        let etcd = match wants(Role::LockServer) && matches!(self.backend, LockBackend::Etcd) {
            true => Some(EtcdServer::start_listening(
                Some(&dir.join("etcd")),
                &extra,
            )?),
            false => None,
        };
        let at = |role: Role| {
            if self.in_ns.contains(&role) {
                ns_ip
            } else {
                host_ip
            }
        };
        let mut templates = Vec::new();
        let mut services = Vec::new();
        // The role's template, and its service unless it is deferred.
        let mut prepare = |role: Role, pairs: Vec<(&str, String)>| -> Result<Option<Service>> {
            let template = Template {
                role,
                ip: at(role),
                in_ns: self.in_ns.contains(&role),
                pairs: self.pairs(role, pairs),
                env: (self.env.iter())
                    .filter(|(r, ..)| *r == role)
                    .map(|(_, key, value)| (key.clone(), value.clone()))
                    .collect(),
            };
            let service = match self.deferred.contains(&role) {
                true => None,
                false => Some(Service::new(&self.exe, &template, &dir, role.name(), &[])?),
            };
            templates.push(template);
            Ok(service)
        };
        let operator_token = |key| self.operator_token.clone().map(|token| (key, token));
        if wants(Role::LockServer) {
            let pairs = match (&self.backend, &etcd) {
                (LockBackend::Config(pairs), _) => pairs.clone(),
                (_, Some(etcd)) => vec![
                    ("lock.backend", "etcd".to_owned()),
                    (
                        "lock.etcd.endpoints",
                        format!("http://{}", SocketAddr::new(host_ip, etcd.client_port)),
                    ),
                ],
                _ => vec![
                    ("lock.backend", "pg".to_owned()),
                    ("lock.pg.url", pg_url("lockdb", Role::LockServer)),
                ],
            };
            services.extend(prepare(Role::LockServer, pairs)?);
        }
        if wants(Role::PaymentResource) {
            let mut pairs = vec![("payment.pg.url", pg_url("paydb", Role::PaymentResource))];
            pairs.extend(operator_token("payment.operator.token"));
            services.extend(prepare(Role::PaymentResource, pairs)?);
        }
        if wants(Role::RailStub) {
            let statement = dir.join(STATEMENT_FILE).display().to_string();
            services.extend(prepare(
                Role::RailStub,
                // Tests reach the stub directly; one that wants it closed sets auth.* itself.
                vec![
                    ("rail.stub.statement-path", statement),
                    ("auth.mode", "none".to_owned()),
                ],
            )?);
        }
        for s in &mut services {
            s.start(ns.as_ref())?;
        }
        let stub_addr = services
            .iter()
            .find(|s| s.role == Role::RailStub)
            .map(|s| s.addr);
        let rail_fault = match self.rail_fault_proxy {
            true => {
                let upstream = stub_addr.context("a fault proxy needs the rail")?;
                Some(FaultProxy::start(SocketAddr::new(host_ip, 0), upstream)?)
            }
            false => None,
        };
        if wants(Role::RailProxy) {
            let rail_url = match (&rail_fault, stub_addr) {
                (Some(fault), _) => Some(fault.url()),
                (None, Some(addr)) => Some(format!("http://{addr}")),
                (None, None) if self.deferred.contains(&Role::RailStub) => None,
                (None, None) => bail!("the rail proxy needs the rail stub"),
            };
            let mut pairs = vec![("rail.proxy.pg.url", pg_url("paydb", Role::RailProxy))];
            pairs.extend(rail_url.map(|url| ("rail.proxy.rail-url", url)));
            pairs.extend(operator_token("rail.proxy.operator-token"));
            if let Some(ms) = self.read_timeout_ms {
                pairs.push(("rail.proxy.read-timeout-ms", ms.to_string()));
            }
            if let Some(mut proxy) = prepare(Role::RailProxy, pairs)? {
                proxy.start(ns.as_ref())?;
                services.push(proxy);
            }
        }
        Ok(Stack {
            services,
            templates,
            added: 0,
            rail_fault,
            etcd,
            pg,
            ns,
            dir,
            _temp: temp,
            exe: self.exe,
            read_timeout_ms: self.read_timeout_ms,
            executor_args: self.executor_args,
            operator_token: self.operator_token,
        })
    }
}

/// A started stack. Field order is drop order: the processes first, then the fault proxy, the
/// stores, the namespace and the directory with the logs (unless it is kept).
pub struct Stack {
    services: Vec<Service>,
    templates: Vec<Template>,
    /// How many services [`Stack::add`] started (their files are numbered).
    added: usize,
    pub rail_fault: Option<FaultProxy>,
    pub etcd: Option<EtcdServer>,
    pub pg: Option<PgServer>,
    pub ns: Option<NetNs>,
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    exe: PathBuf,
    read_timeout_ms: Option<u64>,
    executor_args: Vec<String>,
    pub operator_token: Option<String>,
}

/// A test that fails shows what its services logged last: their logs go with the stack's
/// directory.
impl Drop for Stack {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for service in &self.services {
            let log = std::fs::read_to_string(&service.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            eprintln!(
                "--- {} on {}, last lines of its log:\n{}",
                service.role.name(),
                service.addr,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

impl Stack {
    /// A builder for a stack whose services are run from the `dlock` binary `exe`, each with a
    /// configuration file in the stack's directory (services take nothing from the environment).
    pub fn builder(exe: impl Into<PathBuf>) -> StackBuilder {
        StackBuilder {
            exe: exe.into(),
            roles: Role::ALL.to_vec(),
            backend: LockBackend::Pg,
            read_timeout_ms: None,
            operator_token: Some("stack-operator-token".to_owned()),
            extra: Vec::new(),
            env: Vec::new(),
            deferred: Vec::new(),
            in_ns: Vec::new(),
            netns: false,
            rail_fault_proxy: false,
            executor_args: Vec::new(),
            dir: None,
            durability: Durability::Fast,
            pg_settings: Vec::new(),
        }
    }

    /// The stack's directory: configurations, `logs/`, the databases' data.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn service(&self, role: Role) -> &Service {
        self.services
            .iter()
            .find(|s| s.role == role)
            .unwrap_or_else(|| panic!("this stack runs no {}", role.name()))
    }

    pub fn service_mut(&mut self, role: Role) -> &mut Service {
        self.services
            .iter_mut()
            .find(|s| s.role == role)
            .unwrap_or_else(|| panic!("this stack runs no {}", role.name()))
    }

    /// Restarts a service in place (same port, same config), e.g. after a kill.
    pub fn restart(&mut self, role: Role) {
        let service = self
            .services
            .iter_mut()
            .find(|s| s.role == role)
            .unwrap_or_else(|| panic!("this stack runs no {}", role.name()));
        service.kill();
        service
            .start(self.ns.as_ref())
            .unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Starts one more service of `role` (deferred or not) from the stack's configuration of it,
    /// `extra` keys replacing its own, on a port of its own; its files are numbered
    /// (`<role>-<n>.toml`, `logs/<role>-<n>.log`). Panics with what would not start.
    pub fn add(&mut self, role: Role, extra: &[(&str, &str)]) -> &mut Service {
        let template = self
            .templates
            .iter()
            .find(|t| t.role == role)
            .unwrap_or_else(|| panic!("this stack runs no {}", role.name()));
        self.added += 1;
        let file = format!("{}-{}", role.name(), self.added);
        let extra: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let service = Service::new(&self.exe, template, &self.dir, &file, &extra)
            .and_then(|mut service| service.start(self.ns.as_ref()).map(|()| service))
            .unwrap_or_else(|e| panic!("{e:#}"));
        self.services.push(service);
        let last = self.services.len() - 1;
        &mut self.services[last]
    }

    /// The configuration the stack gives services of `role` (without `server.listen`), for a
    /// test that starts one its own way.
    pub fn config(&self, role: Role) -> Vec<(String, String)> {
        self.templates
            .iter()
            .find(|t| t.role == role)
            .map(|t| t.pairs.clone())
            .unwrap_or_else(|| panic!("this stack runs no {}", role.name()))
    }

    pub fn lock(&self) -> &Service {
        self.service(Role::LockServer)
    }

    pub fn payment(&self) -> &Service {
        self.service(Role::PaymentResource)
    }

    pub fn stub(&self) -> &Service {
        self.service(Role::RailStub)
    }

    pub fn proxy(&self) -> &Service {
        self.service(Role::RailProxy)
    }

    pub fn pg(&self) -> &PgServer {
        self.pg
            .as_ref()
            .unwrap_or_else(|| panic!("this stack runs no PostgreSQL"))
    }

    pub fn ns(&self) -> &NetNs {
        self.ns
            .as_ref()
            .unwrap_or_else(|| panic!("this stack has no network namespace"))
    }

    pub fn rail_fault(&self) -> &FaultProxy {
        self.rail_fault
            .as_ref()
            .unwrap_or_else(|| panic!("this stack has no rail fault proxy"))
    }

    /// PostgreSQL as the namespace reaches it (the address its partition rules name).
    pub fn pg_peer(&self) -> SocketAddr {
        SocketAddr::new(self.ns().host_addr(), self.pg().port)
    }

    /// etcd as the namespace reaches it.
    pub fn etcd_peer(&self) -> Option<SocketAddr> {
        let etcd = self.etcd.as_ref()?;
        Some(SocketAddr::new(self.ns().host_addr(), etcd.client_port))
    }

    pub fn statement_path(&self) -> PathBuf {
        self.dir.join(STATEMENT_FILE)
    }

    pub fn read_timeout_ms(&self) -> u64 {
        self.read_timeout_ms
            .unwrap_or_else(|| panic!("this stack has no rail read timeout"))
    }

    /// A count out of paydb (`SELECT count(*) …`); 0 when it cannot be read.
    pub fn paydb_count(&self, sql: &str) -> usize {
        self.pg()
            .psql("paydb", sql)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    /// How many payouts are POSTED.
    pub fn posted(&self) -> usize {
        self.paydb_count("SELECT count(*) FROM payouts WHERE state = 'POSTED'")
    }

    /// Writes a PayoutBatch of `n` payouts (keys `item-0000`…) spread over accounts
    /// `{prefix}-00`…, amounts 1000, 1001, …
    pub fn batch(&self, name: &str, prefix: &str, accounts: usize, n: usize) -> PathBuf {
        let mut text = format!(
            "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n  workers: 4\n  payouts:\n"
        );
        for i in 0..n {
            text.push_str(&format!(
                "    - key: item-{i:04}\n      accountId: {prefix}-{:02}\n      amountMinor: {}\n      currency: EUR\n      beneficiaryRef: ben-{i}\n",
                i % accounts,
                1_000 + i
            ));
        }
        let path = self.dir.join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    /// Starts `dlock run -f batch` against this stack (4 workers), logging to
    /// `logs/{owner}.log`.
    pub fn executor(&self, batch: &Path, owner: &str, extra: &[&str]) -> (ManagedChild, PathBuf) {
        let log = self.dir.join("logs").join(format!("{owner}.log"));
        let mut args: Vec<String> = vec![
            "run".into(),
            "-f".into(),
            batch.display().to_string(),
            "--lock-server".into(),
            self.lock().url(),
            "--payment-resource".into(),
            self.payment().url(),
            "--rail-proxy".into(),
            self.proxy().url(),
            "--workers".into(),
            "4".into(),
            "--owner-id".into(),
            owner.into(),
            "--rail-read-timeout-ms".into(),
            self.read_timeout_ms().to_string(),
        ];
        args.extend(self.executor_args.iter().cloned());
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let child = spawn_logged(owner, &self.exe, &args, &[], Some(&log))
            .unwrap_or_else(|e| panic!("{e:#}"));
        (child, log)
    }

    /// Waits up to `within` for an executor (stopping it if it is still running); whether it
    /// succeeded, and its log.
    pub fn wait_executor(
        &self,
        mut executor: ManagedChild,
        log: &Path,
        within: Duration,
    ) -> (bool, String) {
        let status = executor.wait_exit(within);
        if status.is_none() {
            executor.stop();
        }
        let text = std::fs::read_to_string(log).unwrap_or_default();
        (status.is_some_and(|s| s.success()), text)
    }
}
