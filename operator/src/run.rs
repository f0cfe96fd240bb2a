//! `dlock operator`: leader election on a Lease, the controllers, `/healthz` and `/metrics`, and a
//! graceful shutdown on SIGTERM or a lost lease.

use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Client, Resource};
use kube_lease_manager::LeaseManagerBuilder;
use serde::de::DeserializeOwned;

use crate::controller::{self, Context, Error, error_policy};
use crate::crd::{
    Lock, LockRevocation, LockServer, PaymentResource, PayoutBatch, RailProxy, Reconciliation,
};
use crate::metrics::Metrics;
use crate::services::ContractServices;
use crate::validate::Settings;
use dlock_contract::auth::Credential;

/// The image of the operator's pods when neither `--image` nor its environment variable is set.
pub const DEFAULT_IMAGE: &str = "ghcr.io/dlock/dlock:latest";

#[derive(Debug, Clone, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct OperatorArgs {
    /// Where `/healthz` and `/metrics` listen.
    #[arg(long, env = "DLOCK_OPERATOR_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// The image the operator's pods run when a spec names none (the operator's own image).
    #[arg(long, env = "DLOCK_OPERATOR_IMAGE", default_value = DEFAULT_IMAGE)]
    pub image: String,
    /// An image a custom resource may name in `spec.image` (or `spec.cloudSql.image`) besides
    /// --image; repeat for several. A spec naming any other image is refused (InvalidSpec), so
    /// whoever may create a PayoutBatch cannot run their own image with the services' Secrets.
    #[arg(
        long = "allowed-image",
        env = "DLOCK_OPERATOR_ALLOWED_IMAGES",
        value_delimiter = ','
    )]
    pub allowed_images: Vec<String>,
    /// A ServiceAccount and its roles at the services, `<namespace>/<name>=<role>[+<role>…]`
    /// (roles: treasury, registrar, executor, operator, reader); repeat for several. Every
    /// service gets the list as `auth.tokenreview.service-accounts`; a ServiceAccount named
    /// nowhere is 403 at every service (docs/contract.md#roles).
    #[arg(
        long = "service-account-role",
        env = "DLOCK_OPERATOR_SERVICE_ACCOUNT_ROLES",
        value_delimiter = ',',
        value_parser = service_account_role
    )]
    pub service_account_roles: Vec<String>,
    /// A namespace the operator watches and writes in; repeat or comma-separate for several.
    /// Absent: every namespace (the chart's ClusterRole). Given: only these, every watch and
    /// owned-object stream namespaced, so Roles in these namespaces are all the rights it needs
    /// (the chart's `watchNamespaces`, docs/kubernetes.md#confining-the-operator-to-namespaces).
    /// The Lease stays in the operator's own namespace.
    #[arg(
        long = "watch-namespace",
        env = "DLOCK_OPERATOR_WATCH_NAMESPACES",
        value_delimiter = ',',
        value_parser = watch_namespace
    )]
    pub watch_namespaces: Vec<String>,
    /// The Lease of the leader election.
    #[arg(long, env = "DLOCK_OPERATOR_LEASE", default_value = "dlock-operator")]
    pub lease_name: String,
    /// The Lease's namespace (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// This replica's identity in the election.
    #[arg(long, env = "POD_NAME", default_value = "dlock-operator")]
    pub identity: String,
    /// Seconds a leader's lease lasts without renewal (the chart's
    /// `leaderElection.durationSeconds`).
    #[arg(long, env = "DLOCK_OPERATOR_LEASE_DURATION_S", default_value_t = 15)]
    pub lease_duration_s: u64,
    /// The operator's own service account (the chart's): the services' configuration names
    /// `system:serviceaccount:<POD_NAMESPACE>:<this>` as their operator identity, the identity its
    /// projected token authenticates as.
    #[arg(
        long,
        env = "DLOCK_OPERATOR_SERVICE_ACCOUNT",
        default_value = "dlock-operator"
    )]
    pub service_account: String,
    /// The identity the operator's calls to the dlock services carry (`X-Owner-Id`, 1-64
    /// characters).
    #[arg(long, env = "DLOCK_OPERATOR_OWNER_ID", default_value = "operator")]
    pub owner_id: String,
    /// The operator credential (`Authorization: Bearer …`), fixed. Prefer --credential-file.
    #[arg(
        long,
        env = "DLOCK_OPERATOR_TOKEN",
        hide_env_values = true,
        conflicts_with = "credential_file"
    )]
    pub operator_token: Option<String>,
    /// A file holding the operator credential (a mounted Secret key or a projected
    /// service-account token); re-read every 30 s, so a rotated token is picked up.
    #[arg(long, env = "DLOCK_CREDENTIAL_FILE")]
    pub credential_file: Option<std::path::PathBuf>,
}

/// `--help`'s closing words.
pub const AFTER_HELP: &str = "Outside the cluster, DLOCK_SERVICE_ADDRESSES maps the services' \
in-cluster addresses to reachable ones, like curl --resolve: a comma-separated list of \
host:port=host:port, e.g. lock-server.ns1.svc:8080=127.0.0.1:40123. Every service URL whose \
host:port matches an entry exactly is rewritten; a malformed entry stops the operator at start.";

impl OperatorArgs {
    /// The credential: the file when given (it rotates), else the fixed token, else none.
    pub fn credential(&self) -> anyhow::Result<Option<Credential>> {
        if let Some(path) = &self.credential_file {
            return Credential::from_file(path)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("--credential-file (DLOCK_CREDENTIAL_FILE): {e}"));
        }
        Ok(self
            .operator_token
            .as_deref()
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(Credential::fixed))
    }

    /// The services' clients, or why the operator must not start (a malformed address map, an
    /// unreadable credential file, an owner id the contract refuses).
    pub fn services(&self) -> anyhow::Result<ContractServices> {
        ContractServices::new(&self.owner_id, self.credential()?)
    }
}

/// The label every object the operator builds carries; the owned-object watches select on it.
const MANAGED_SELECTOR: &str = "app.kubernetes.io/managed-by=dlock-operator";

pub async fn run(args: OperatorArgs) -> anyhow::Result<()> {
    // Before anything else: a malformed address map or credential must stop the start.
    let services = Arc::new(args.services()?);
    let client = Client::try_default()
        .await
        .context("no Kubernetes configuration (in-cluster or kubeconfig)")?;
    let metrics = Arc::new(Metrics::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http = tokio::spawn(serve_http(args.listen, metrics.clone(), stop_rx.clone()));

    let manager = LeaseManagerBuilder::new(client.clone(), &args.lease_name)
        .with_namespace(&args.lease_namespace)
        .with_identity(&args.identity)
        .with_duration(args.lease_duration_s)
        .with_grace(args.lease_duration_s / 3)
        .build()
        .await
        .context("preparing the leader-election Lease")?;
    let (mut leader, lease_task) = manager.watch().await;
    tracing::info!(event = "waiting_for_leadership", lease = %args.lease_name);
    let signal = shutdown_signal().shared();
    if !elected(&mut leader, signal.clone()).await? {
        step_down(stop_tx, leader, lease_task, http).await;
        return Ok(());
    }
    tracing::info!(
        event = "leading",
        identity = %args.identity,
        watching = %watched(&args.watch_namespaces)
    );

    let stop = signalled_or_lost(signal, leader.clone());

    let ctx = Arc::new(Context::new(
        client.clone(),
        services,
        settings(&args),
        metrics.clone(),
        controller::system_clock(),
    ));
    run_controllers(&client, &ctx, &args.watch_namespaces, stop).await;
    let still_leader = *leader.borrow();
    step_down(stop_tx, leader, lease_task, http).await;
    if !still_leader {
        anyhow::bail!("lost the leader-election lease; restarting to campaign again");
    }
    tracing::info!(event = "stopped");
    Ok(())
}

/// Waits until this replica leads (true) or a shutdown signal comes first (false).
async fn elected(
    leader: &mut tokio::sync::watch::Receiver<bool>,
    signal: impl Future<Output = ()>,
) -> anyhow::Result<bool> {
    Ok(tokio::select! {
        _ = signal => false,
        became = leader.wait_for(|is_leader| *is_leader) => {
            became.context("the leader election stopped")?;
            true
        }
    })
}

/// Stop when signalled or when the lease is lost: a former leader must not keep writing.
fn signalled_or_lost(
    signal: impl Future<Output = ()> + Send + 'static,
    mut lost: tokio::sync::watch::Receiver<bool>,
) -> Shared<BoxFuture<'static, ()>> {
    async move {
        tokio::select! {
            _ = signal => {}
            _ = lost.wait_for(|is_leader| !*is_leader) => {
                tracing::error!(event = "leadership_lost");
            }
        }
    }
    .boxed()
    .shared()
}

/// One `--service-account-role`, checked as the services will check it.
fn service_account_role(entry: &str) -> Result<String, String> {
    dlock_server::auth::roles::parse_service_account(entry.trim())?;
    Ok(entry.trim().to_owned())
}

/// One `--watch-namespace`: a namespace name as Kubernetes spells it (RFC 1123 label), so a
/// typo stops the start instead of watching a namespace that cannot exist.
fn watch_namespace(entry: &str) -> Result<String, String> {
    let name = entry.trim();
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if valid {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{entry:?} is not a namespace name (1-63 lowercase letters, digits and '-', \
             starting and ending with a letter or digit)"
        ))
    }
}

/// The namespaces the controllers watch, for the log: `*` for all.
fn watched(namespaces: &[String]) -> String {
    if namespaces.is_empty() {
        "*".to_owned()
    } else {
        namespaces.join(",")
    }
}

/// Where the controllers watch: `[None]` is every namespace (`Api::all`), else one scope per
/// listed namespace (`Api::namespaced`).
fn scopes(namespaces: &[String]) -> Vec<Option<String>> {
    if namespaces.is_empty() {
        vec![None]
    } else {
        let mut unique = namespaces.to_vec();
        unique.sort();
        unique.dedup();
        unique.into_iter().map(Some).collect()
    }
}

/// The API of kind `K` in one scope of [`scopes`].
fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    }
}

/// What the controllers build with, from the operator's arguments.
fn settings(args: &OperatorArgs) -> Settings {
    Settings {
        image: args.image.clone(),
        allowed_images: args.allowed_images.clone(),
        // The operator registers PayoutBatches' payouts itself (the registrar role; its Jobs run
        // them as executors), so its own ServiceAccount is a registrar at every service.
        service_account_roles: args
            .service_account_roles
            .iter()
            .cloned()
            .chain([format!(
                "{}/{}=registrar",
                args.lease_namespace, args.service_account
            )])
            .collect(),
        operator_namespace: args.lease_namespace.clone(),
        operator_identity: crate::validate::service_account_identity(
            &args.lease_namespace,
            &args.service_account,
        ),
    }
}

/// Runs every controller until `stop`, in every namespace or only in `namespaces`.
async fn run_controllers(
    client: &Client,
    ctx: &Arc<Context>,
    namespaces: &[String],
    stop: Shared<BoxFuture<'static, ()>>,
) {
    let scopes = scopes(namespaces);
    // One controller per kind and scope: the kind, what it owns (watched by the managed label,
    // in the same scope) and its reconcile, behind the deserialize guard and the pause, stopping
    // with the lease. Confined to namespaces, each kind runs one controller per namespace, each
    // of whose watches is namespaced: nothing lists or watches outside them.
    macro_rules! controller {
        ($kind:ty, [$($owned:ty),*], $reconcile:path) => {
            futures::future::join_all(scopes.iter().map(|scope| {
                Controller::new(
                    scoped::<DeserializeGuard<$kind>>(client, scope.as_deref()),
                    watcher::Config::default(),
                )
                $(.owns(
                    scoped::<$owned>(client, scope.as_deref()),
                    watcher::Config::default().labels(MANAGED_SELECTOR),
                ))*
                .graceful_shutdown_on(stop.clone())
                .run(
                    |o, c| guarded(o, c, stringify!($kind), $reconcile),
                    error_policy,
                    ctx.clone(),
                )
                .for_each(log_result)
            }))
        };
    }
    use controller::{lock, payout_batch, reconciliation, workloads};
    let lock_servers = controller!(
        LockServer,
        [Deployment, ConfigMap, Service],
        workloads::reconcile_lock_server
    );
    let payment_resources = controller!(
        PaymentResource,
        [Deployment],
        workloads::reconcile_payment_resource
    );
    let rail_proxies = controller!(RailProxy, [Deployment], workloads::reconcile_rail_proxy);
    let batches = controller!(PayoutBatch, [Job], payout_batch::reconcile_payout_batch);
    let locks = controller!(Lock, [], lock::reconcile_lock);
    let revocations = controller!(LockRevocation, [], lock::reconcile_lock_revocation);
    let reconciliations = controller!(
        Reconciliation,
        [Job, CronJob],
        reconciliation::reconcile_reconciliation
    );

    futures::join!(
        reconciliations,
        lock_servers,
        payment_resources,
        rail_proxies,
        batches,
        locks,
        revocations
    );
}

/// Stops `/healthz` and `/metrics`, gives up the lease (dropping the leader watch ends the
/// election, given 5 s) and waits for the HTTP server to end.
async fn step_down<T>(
    stop_http: tokio::sync::watch::Sender<bool>,
    leader: tokio::sync::watch::Receiver<bool>,
    lease_task: tokio::task::JoinHandle<T>,
    http: tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let _ = stop_http.send(true);
    drop(leader);
    let _ = tokio::time::timeout(Duration::from_secs(5), lease_task).await;
    let _ = http.await;
}

/// What every reconcile runs behind. The deserialize guard: an object that does not parse fails
/// its own reconcile (permanently, until it changes) instead of wedging the watcher for every
/// other object. The pause: a paused object of `kind` is not reconciled at all
/// ([`controller::paused`]).
pub async fn guarded<K, F, Fut>(
    object: Arc<DeserializeGuard<K>>,
    ctx: Arc<Context>,
    kind: &'static str,
    reconcile: F,
) -> Result<Action, Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
    F: FnOnce(Arc<K>, Arc<Context>) -> Fut,
    Fut: Future<Output = Result<Action, Error>>,
{
    match &object.0 {
        Ok(inner) => match controller::paused(inner, &ctx, kind) {
            Some(action) => Ok(action),
            None => reconcile(Arc::new(inner.clone()), ctx).await,
        },
        Err(invalid) => {
            tracing::warn!(
                event = "malformed_object",
                name = invalid.metadata.name.as_deref().unwrap_or(""),
                error = %invalid.error
            );
            Err(Error::Malformed(invalid.error.clone()))
        }
    }
}

async fn log_result<T: Debug, E: std::fmt::Display>(result: Result<T, E>) {
    match result {
        Ok(object) => tracing::debug!(event = "reconciled", object = ?object),
        Err(error) => tracing::debug!(event = "reconcile_error", error = %error),
    }
}

/// SIGINT or SIGTERM, the services' signal, logged as the operator's shutdown request.
async fn shutdown_signal() {
    dlock_server::http::shutdown_signal().await;
    tracing::info!(event = "shutdown_requested");
}

/// `/healthz` (the process is up) and `/metrics` (Prometheus text).
pub fn http_app(metrics: Arc<Metrics>) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.encode(),
                    )
                }
            }),
        )
}

async fn serve_http(
    listen: SocketAddr,
    metrics: Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    axum::serve(listener, http_app(metrics))
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        })
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: OperatorArgs,
    }

    #[test]
    fn the_owner_id_defaults_to_operator_and_the_credential_may_come_from_a_file() {
        let cli = Cli::parse_from(["dlock-operator"]);
        assert_eq!(cli.args.owner_id, "operator");
        let path =
            std::env::temp_dir().join(format!("dlock-operator-token-{}", std::process::id()));
        std::fs::write(&path, "s3cret-operator-token\n").unwrap_or_else(|e| panic!("{e}"));
        let cli = Cli::parse_from([
            "dlock-operator",
            "--owner-id",
            "ops-1",
            "--credential-file",
            path.to_str().unwrap_or_default(),
        ]);
        let credential = cli.args.credential().ok().flatten().map(|c| c.token());
        assert_eq!(credential.as_deref(), Some("s3cret-operator-token"));
        assert!(cli.args.services().is_ok());
        let _ = std::fs::remove_file(&path);
        let cli = Cli::parse_from(["dlock-operator", "--credential-file", "/nonexistent/x"]);
        assert!(cli.args.credential().is_err());
        let cli = Cli::parse_from(["dlock-operator", "--owner-id", &"o".repeat(65)]);
        assert!(cli.args.services().is_err());
    }

    #[test]
    fn watch_namespaces_repeat_or_comma_separate_and_absent_means_every_namespace() {
        let cli = Cli::parse_from(["dlock-operator"]);
        assert!(cli.args.watch_namespaces.is_empty());
        assert_eq!(scopes(&cli.args.watch_namespaces), vec![None]);
        let cli = Cli::parse_from([
            "dlock-operator",
            "--watch-namespace",
            "payments,payouts",
            "--watch-namespace",
            "payments",
        ]);
        assert_eq!(
            cli.args.watch_namespaces,
            ["payments", "payouts", "payments"]
        );
        assert_eq!(
            scopes(&cli.args.watch_namespaces),
            vec![Some("payments".to_owned()), Some("payouts".to_owned())]
        );
        for bad in ["Payments", "-a", "a_b", "", &"a".repeat(64)] {
            assert!(
                Cli::try_parse_from(["dlock-operator", "--watch-namespace", bad]).is_err(),
                "{bad:?} was taken as a namespace"
            );
        }
    }
}
