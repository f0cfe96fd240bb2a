//! The alerts and the dashboard against the real services: every metric an
//! alert or a dashboard query names is one the services really export, and a real Prometheus
//! (Debian's `prometheus` package) that scrapes a local stack fires DlockFencedOut when a paused
//! holder is fenced out, and not before.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use dlock_devstack::{ManagedChild, free_port, spawn_logged};
use promql_parser::parser::Expr;
use promql_parser::util::{ExprVisitor, walk_expr};
use serde_json::Value;

use crate::chaos::{Chaos, EXE, OPERATOR_TOKEN, ScriptedHolder, register_one};
use crate::harness::{Backend, eventually};
use crate::shared::process::wait_serving;

const RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../charts/dlock/files/dlock-alerts.yaml"
);
const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../charts/dlock/files/dlock-dashboard.json"
);

/// Metrics Prometheus makes itself rather than scrapes.
const SYNTHETIC: [&str; 1] = ["up"];

#[derive(serde::Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(serde::Deserialize)]
struct RuleGroup {
    rules: Vec<Rule>,
}

#[derive(serde::Deserialize)]
struct Rule {
    alert: String,
    expr: String,
}

fn alert_rules() -> Vec<Rule> {
    let text = std::fs::read_to_string(RULES).unwrap_or_else(|e| panic!("{RULES}: {e}"));
    let file: RuleFile = serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{RULES}: {e}"));
    file.groups.into_iter().flat_map(|g| g.rules).collect()
}

/// Every panel query of the dashboard, with Grafana's interval macros made PromQL durations.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(DASHBOARD).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    let dashboard: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"));
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("a target of {} has no expr", panel["title"]));
            let expr = expr
                .replace("$__rate_interval", "5m")
                .replace("$__range", "1h");
            queries.push((panel["title"].as_str().unwrap_or("?").to_owned(), expr));
        }
    }
    assert!(
        queries.len() >= 10,
        "the dashboard has {} queries",
        queries.len()
    );
    queries
}

/// The metric names a PromQL expression selects, from promql-parser's syntax tree.
fn metric_names(expr: &str) -> BTreeSet<String> {
    struct Names(BTreeSet<String>);
    impl ExprVisitor for Names {
        type Error = std::convert::Infallible;
        fn pre_visit(&mut self, expr: &Expr) -> Result<bool, Self::Error> {
            let selector = match expr {
                Expr::VectorSelector(v) => Some(v),
                Expr::MatrixSelector(m) => Some(&m.vs),
                _ => None,
            };
            if let Some(selector) = selector {
                let name = selector.name.clone().unwrap_or_else(|| {
                    panic!("{expr}: a selector without a metric name cannot be checked")
                });
                self.0.insert(name);
            }
            Ok(true)
        }
    }
    let parsed =
        promql_parser::parser::parse(expr).unwrap_or_else(|e| panic!("{expr}: not PromQL: {e}"));
    let mut names = Names(BTreeSet::new());
    let _ = walk_expr(&mut names, &parsed);
    names.0
}

/// The metric names of one `/metrics` text, as PromQL sees them, parsed by prometheus-parse.
fn exported_names(text: &str) -> BTreeSet<String> {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .unwrap_or_else(|e| panic!("unparseable /metrics: {e}\n{text}"));
    let mut names = BTreeSet::new();
    for sample in scrape.samples {
        if let prometheus_parse::Value::Histogram(_) = sample.value {
            names.insert(format!("{}_bucket", sample.metric));
        }
        names.insert(sample.metric);
    }
    names
}

/// The names used but not exported (Prometheus's own aside).
fn missing(used: &BTreeSet<String>, exported: &BTreeSet<String>) -> Vec<String> {
    used.iter()
        .filter(|n| !exported.contains(*n) && !SYNTHETIC.contains(&n.as_str()))
        .cloned()
        .collect()
}

async fn get_text(url: &str) -> Option<String> {
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let response = http.get(url).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok()
}

async fn scrape(url: &str) -> String {
    get_text(&format!("{url}/metrics"))
        .await
        .unwrap_or_else(|| panic!("{url}/metrics did not answer"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_metric_an_alert_or_the_dashboard_names_is_exported() {
    let started = Instant::now();
    let mut used = BTreeSet::new();
    for rule in alert_rules() {
        let names = metric_names(&rule.expr);
        assert!(!names.is_empty(), "{} selects no metric", rule.alert);
        used.extend(names);
    }
    for (title, expr) in dashboard_queries() {
        let names = metric_names(&expr);
        assert!(
            !names.is_empty(),
            "dashboard panel {title:?} selects no metric"
        );
        used.extend(names);
    }
    // A rail slower than the proxy's read timeout: every payout becomes RAIL_AMBIGUOUS, so the
    // ambiguous gauges have something to count, and the run lasts long enough to scrape the
    // executor mid-run.
    let chaos = Chaos::start(Backend::Pg, &[("rail.stub.latency-ms", "1500")], 1_000);
    chaos.accounts("mon", 1, 1_000_000).await;
    let batch = chaos.batch("mon-batch", "mon", 1, 4);
    let metrics_port = free_port().unwrap_or_else(|e| panic!("{e}"));
    let metrics_url = format!("http://127.0.0.1:{metrics_port}");
    let (executor, log) = chaos.executor(
        &batch,
        "executor-mon",
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );
    let mut executor = executor;
    let deadline = Instant::now() + Duration::from_secs(60);
    let executor_text = loop {
        if let Some(text) = get_text(&format!("{metrics_url}/metrics"))
            .await
            .filter(|t| t.contains("payout_execute_total"))
        {
            break text;
        }
        assert!(
            !executor.exited() && Instant::now() < deadline,
            "the executor's /metrics never counted a lock cycle: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let status = tokio::task::spawn_blocking(move || executor.wait_exit(Duration::from_secs(120)))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        status.is_some(),
        "the executor did not finish: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let mut exported = exported_names(&executor_text);
    // The executor settles every payout (as RAIL_AMBIGUOUS) before the services are scraped.
    let ambiguous = eventually(
        "every payout of the batch is RAIL_AMBIGUOUS",
        Duration::from_secs(60),
        || async {
            let n: usize = chaos
                .pg()
                .psql(
                    "paydb",
                    "SELECT count(*) FROM payouts WHERE state = 'RAIL_AMBIGUOUS'",
                )
                .ok()?
                .parse()
                .ok()?;
            (n == 4).then_some(n)
        },
    )
    .await;
    let mut proxy_text = String::new();
    for (service, url) in [
        ("lock server", chaos.lock().url()),
        ("payment resource", chaos.payment().url()),
        ("rail proxy", chaos.proxy().url()),
    ] {
        let text = scrape(&url).await;
        let names = exported_names(&text);
        assert!(!names.is_empty(), "{service} exports nothing:\n{text}");
        exported.extend(names);
        if service == "rail proxy" {
            proxy_text = text;
        }
    }
    // The operator's own /metrics (the registry `dlock operator` serves; the process itself
    // needs a Kubernetes API server): the reconciler's findings by class.
    exported.extend(exported_names(
        &dlock_operator::metrics::Metrics::default().encode(),
    ));
    let absent = missing(&used, &exported);
    assert!(
        absent.is_empty(),
        "alerts or dashboard name metrics nobody exports: {absent:?}\nexported: {exported:?}"
    );
    // Positive control: a misspelt name is reported missing by the same check.
    let bogus: BTreeSet<String> = metric_names("increase(lock_fenced_out_totl[5m]) > 0");
    assert_eq!(
        missing(&bogus, &exported),
        vec!["lock_fenced_out_totl".to_owned()]
    );
    // The ambiguous gauges count what paydb holds.
    let scrape = prometheus_parse::Scrape::parse(proxy_text.lines().map(|l| Ok(l.to_owned())))
        .unwrap_or_else(|e| panic!("{e}"));
    let gauge = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name)
            .map(|s| match s.value {
                prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => v,
                _ => panic!("{name} is not a gauge"),
            })
            .unwrap_or_else(|| panic!("{name} missing:\n{proxy_text}"))
    };
    assert_eq!(gauge("payout_ambiguous"), ambiguous as f64, "{proxy_text}");
    assert!(
        gauge("payout_ambiguous_oldest_age_seconds") > 0.0,
        "{proxy_text}"
    );
    println!(
        "{} metric names used by {} alerts and the dashboard, all exported; {} exported in all; {:.1} s",
        used.len(),
        alert_rules().len(),
        exported.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Prometheus from Debian's package, run on a generated configuration.
struct Prometheus {
    url: String,
    _child: ManagedChild,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn binary() -> PathBuf {
        ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .unwrap_or_else(|| {
                panic!(
                    "no prometheus binary: install Debian's prometheus package (apt-get install prometheus); .ci/run does"
                )
            })
    }

    /// Scrapes each `(job, url)` every second and evaluates dlock's rules every second.
    fn start(targets: &[(&str, String)]) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {RULES}\nscrape_configs:\n"
        );
        for (job, url) in targets {
            let address = url.trim_start_matches("http://");
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: ['{address}']\n"
            ));
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap_or_else(|e| panic!("{e}"));
        let port = free_port().unwrap_or_else(|e| panic!("{e}"));
        let args: Vec<String> = vec![
            format!("--config.file={}", config_path.display()),
            format!("--storage.tsdb.path={}", dir.path().join("data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
            "--log.level=warn".to_owned(),
        ];
        let log = dir.path().join("prometheus.log");
        let mut child = spawn_logged("prometheus", &Self::binary(), &args, &[], Some(&log))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        wait_serving(
            "prometheus ready",
            &mut child,
            addr,
            "/-/ready",
            Duration::from_secs(60),
            &log,
        );
        Self {
            url: format!("http://{addr}"),
            _child: child,
            _dir: dir,
        }
    }

    async fn api(&self, path: &str) -> Value {
        let text = get_text(&format!("{}{path}", self.url))
            .await
            .unwrap_or_else(|| panic!("prometheus {path} did not answer"));
        let body: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(body["status"], "success", "{path}: {body}");
        body["data"].clone()
    }

    /// The DlockFencedOut alerts as `(state, job, resource)`.
    async fn fenced_out_alerts(&self) -> Vec<(String, String, String)> {
        let data = self.api("/api/v1/alerts").await;
        let field = |a: &Value, k: &str| a["labels"][k].as_str().unwrap_or_default().to_owned();
        data["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["labels"]["alertname"] == "DlockFencedOut")
            .map(|a| {
                (
                    a["state"].as_str().unwrap_or_default().to_owned(),
                    field(a, "job"),
                    field(a, "resource"),
                )
            })
            .collect()
    }

    /// When the DlockFencedOut rule was last evaluated, as Prometheus reports it (RFC 3339).
    async fn fenced_out_rule_evaluated(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        let data = self.api("/api/v1/rules?type=alert").await;
        let rule = data["groups"]
            .as_array()?
            .iter()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .find(|r| r["name"] == "DlockFencedOut")?
            .clone();
        assert_eq!(rule["health"], "ok", "DlockFencedOut: {rule}");
        chrono::DateTime::parse_from_rfc3339(rule["lastEvaluation"].as_str()?)
            .ok()
            .map(|t| t.with_timezone(&chrono::Utc))
    }
}

async fn revoke(chaos: &Chaos, key: &str) {
    let args = [
        "revoke",
        key,
        "--reason",
        "holder stuck in a GC pause",
        "--operator",
        "oncall",
        "--lock-server",
        &chaos.lock().url(),
        "--payment-resource",
        &chaos.payment().url(),
        "--rail-proxy",
        &chaos.proxy().url(),
        "--operator-token",
        OPERATOR_TOKEN,
    ]
    .map(str::to_owned);
    let output = tokio::process::Command::new(EXE)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        output.status.success(),
        "dlock revoke failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A real Prometheus scrapes the lock server, payment resource and rail proxy every second and
/// evaluates the shipped rules file. A holder claims a payout, its lock is revoked while it is
/// "paused", and it resumes with its old token: the rail proxy and the payment resource refuse
/// it (FENCED_OUT) and DlockFencedOut fires for both. Before the refusal, with the rule
/// evaluated on scraped zeros and the revocation already done, it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prometheus_fires_fenced_out_when_a_paused_holder_is_fenced() {
    let started = Instant::now();
    let chaos = Chaos::start(Backend::Pg, &[], 2_000);
    chaos.accounts("alert", 1, 1_000_000).await;
    let payout = register_one(&chaos, "alert-batch", "alert-00", 1_000).await;
    let prometheus = Prometheus::start(&[
        ("lock-server", chaos.lock().url()),
        ("payment-resource", chaos.payment().url()),
        ("rail-proxy", chaos.proxy().url()),
    ]);
    let booted = started.elapsed();
    // Both fenced-out counters are scraped at zero (3 resources each).
    eventually(
        "prometheus holds lock_fenced_out_total of both services",
        Duration::from_secs(30),
        || async {
            let data = prometheus
                .api("/api/v1/query?query=lock_fenced_out_total%20%3D%3D%200")
                .await;
            (data["result"].as_array()?.len() == 6).then_some(())
        },
    )
    .await;
    // Every target scraped at least once: one not scraped yet reports "unknown", and one that
    // failed its scrape "down", which the assertion then shows.
    let (health, targets) = eventually(
        "prometheus has scraped all three targets",
        Duration::from_secs(30),
        || async {
            let targets = prometheus.api("/api/v1/targets?state=active").await;
            let health: Vec<String> = targets["activeTargets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["health"].as_str().map(str::to_owned))
                .collect();
            (health.len() == 3 && health.iter().all(|h| h != "unknown"))
                .then_some((health, targets))
        },
    )
    .await;
    assert_eq!(health, ["up", "up", "up"], "{targets}");

    // The holder claims, and is "paused" while an operator revokes its lock.
    let holder = ScriptedHolder::claim(&chaos, "alert-00", payout, 60_000).await;
    revoke(&chaos, "payout:alert-00").await;
    // Not firing before the fence-out: the rule has been evaluated since the zeros and the
    // revocation were scraped.
    let seen = chrono::Utc::now() + chrono::Duration::seconds(2);
    eventually(
        "DlockFencedOut evaluated after the revocation",
        Duration::from_secs(30),
        || async {
            prometheus
                .fenced_out_rule_evaluated()
                .await
                .filter(|t| *t > seen)
        },
    )
    .await;
    let before = prometheus.fenced_out_alerts().await;
    assert!(
        before.is_empty(),
        "DlockFencedOut before any fence-out: {before:?}"
    );

    // The holder wakes up and writes with its old token: refused at the rail and the account.
    let fenced_at = Instant::now();
    assert_eq!(holder.resume("alert-00", payout, 1_000).await, 2);
    let firing = eventually(
        "DlockFencedOut firing for the rail proxy and the payment resource",
        Duration::from_secs(60),
        || async {
            let alerts = prometheus.fenced_out_alerts().await;
            let firing: BTreeSet<(String, String)> = alerts
                .into_iter()
                .filter(|(state, _, _)| state == "firing")
                .map(|(_, job, resource)| (job, resource))
                .collect();
            (firing.len() == 2).then_some(firing)
        },
    )
    .await;
    let to_fire = fenced_at.elapsed();
    // The rail proxy refuses the submit (rail); the payment resource refuses the post at the
    // first fence it checks (ledger).
    let jobs: Vec<&str> = firing.iter().map(|(job, _)| job.as_str()).collect();
    assert_eq!(jobs, ["payment-resource", "rail-proxy"], "{firing:?}");
    assert!(
        firing.contains(&("rail-proxy".to_owned(), "rail".to_owned())),
        "{firing:?}"
    );
    println!(
        "prometheus up in {:.1} s; DlockFencedOut firing {:.1} s after the fence-out (1 s scrape and evaluation); test {:.1} s",
        booted.as_secs_f64(),
        to_fire.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn metric_names_come_from_selectors_not_functions_or_labels() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le, job) (rate(lock_acquisition_latency_seconds_bucket{outcome="granted", job=~"lock_timeouts_total"}[5m]))) / on (job) group_left max(up)"#,
    );
    let expected: BTreeSet<String> = ["lock_acquisition_latency_seconds_bucket", "up"]
        .map(str::to_owned)
        .into();
    assert_eq!(names, expected);
}
