//! On the real API server, with the Prometheus Operator's CRDs (generated from its API types by
//! `scripts/prometheus-operator-crds`): the chart's PrometheusRule and PodMonitors, rendered with
//! monitoring on (`charts/dlock/ci/monitoring-values.yaml`), are admitted under strict field
//! validation, so every field the chart writes is one the Prometheus Operator knows and every
//! value has the type and form its schema asks for. Controls: the same objects with one field
//! misspelt, and with a duration Prometheus cannot read, are refused naming the field.

use std::process::{Command, Stdio};

use serde::Deserialize as _;
use serde_yaml_ng::Value;

use crate::world::{World, render_chart_with_files, repo};

/// The directory of the Prometheus Operator's CRDs, generated (and cached) by the script.
fn prometheus_operator_crds() -> String {
    let output = Command::new(repo().join("scripts/prometheus-operator-crds"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("scripts/prometheus-operator-crds: {e}"));
    assert!(
        output.status.success(),
        "scripts/prometheus-operator-crds failed"
    );
    String::from_utf8(output.stdout)
        .unwrap_or_else(|e| panic!("{e}"))
        .trim()
        .to_string()
}

/// The chart's monitoring objects of `kind`, rendered with monitoring on.
fn rendered(kind: &str) -> Vec<Value> {
    let values = repo().join("charts/dlock/ci/monitoring-values.yaml");
    let text = render_chart_with_files(&[values.to_str().unwrap_or_default()]);
    let objects: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("the rendered chart: {e}")))
        .filter(|o| o["kind"].as_str() == Some(kind))
        .collect();
    assert!(
        !objects.is_empty(),
        "the chart with monitoring on renders no {kind}"
    );
    objects
}

fn yaml(object: &Value) -> String {
    serde_yaml_ng::to_string(object).unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_charts_prometheus_rule_and_pod_monitors_are_admitted_by_the_prometheus_operators_schema()
 {
    let crds = prometheus_operator_crds();
    let world = World::start().await;
    for kind in ["podmonitors", "prometheusrules"] {
        world.kubectl(&[
            "apply",
            "--server-side",
            "--field-manager=dlock-e2e",
            "-f",
            &format!("{crds}/monitoring.coreos.com_{kind}.yaml"),
        ]);
    }
    world.kubectl(&[
        "wait",
        "--for=condition=Established",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
        "--timeout=60s",
    ]);
    let ns = crate::world::OPERATOR_NAMESPACE;
    let apply = |object: &Value| {
        world.cluster.kubectl_with_input(
            &[
                "apply",
                "--server-side",
                "--field-manager=dlock-e2e",
                "--validate=strict",
                "-n",
                ns,
                "-f",
                "-",
            ],
            Some(&yaml(object)),
        )
    };

    let rules = rendered("PrometheusRule");
    let monitors = rendered("PodMonitor");
    for object in rules.iter().chain(&monitors) {
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        apply(object).unwrap_or_else(|e| {
            panic!(
                "{} {name} was refused by the Prometheus Operator's schema: {e:#}",
                object["kind"].as_str().unwrap_or_default()
            )
        });
    }
    let stored = world.get_json(&["prometheusrules,podmonitors", "-n", ns]);
    let count = stored["items"].as_array().map_or(0, Vec::len);
    assert_eq!(count, rules.len() + monitors.len(), "stored: {stored:#}");
    // The alerts arrive whole: as many rules as the chart's alert file has.
    let alerts: usize = stored["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|o| o["kind"] == "PrometheusRule")
        .flat_map(|o| o["spec"]["groups"].as_array().cloned().unwrap_or_default())
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum();
    assert!(alerts > 0, "no alert rule stored: {stored:#}");

    // Controls: the schema is really applied. A misspelt field of a PodMonitor's endpoint and a
    // `for` Prometheus cannot read are refused, naming the field.
    let mut misspelt = monitors[0].clone();
    misspelt["metadata"]["name"] = Value::from("misspelt");
    misspelt["spec"]["podMetricsEndpoints"][0]["portt"] = Value::from("http");
    let message = match apply(&misspelt) {
        Ok(out) => panic!("a misspelt field was admitted: {out}"),
        Err(e) => format!("{e:#}"),
    };
    assert!(message.contains("portt"), "{message}");

    let mut bad_for = rules[0].clone();
    bad_for["metadata"]["name"] = Value::from("bad-for");
    bad_for["spec"]["groups"][0]["rules"][0]["for"] = Value::from("five minutes");
    let message = match apply(&bad_for) {
        Ok(out) => panic!("an unreadable `for` was admitted: {out}"),
        Err(e) => format!("{e:#}"),
    };
    assert!(message.contains(".for"), "{message}");
    eprintln!(
        "{} PrometheusRule ({alerts} alerts) and {} PodMonitors admitted by the Prometheus Operator's CRDs; \
         a misspelt field and a bad duration refused",
        rules.len(),
        monitors.len()
    );
}
