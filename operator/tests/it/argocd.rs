//! The Argo CD health scripts (`argocd/dlock.io/<Kind>/health.lua`), run by a real Lua 5.4
//! against every case of their `health_test.yaml`, the way Argo CD's own test runner does.

use std::path::{Path, PathBuf};

use mlua::{Lua, LuaSerdeExt};
use serde::Deserialize;

use dlock_operator::argocd::KINDS;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthTests {
    tests: Vec<HealthTest>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthTest {
    health_status: HealthStatus,
    input_path: String,
}

#[derive(Debug, Deserialize, PartialEq)]
struct HealthStatus {
    status: String,
    message: String,
}

fn kind_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../argocd/dlock.io")
        .join(kind)
}

fn health(script: &str, object: &serde_json::Value) -> HealthStatus {
    let lua = Lua::new();
    let value = lua.to_value(object).expect("converts the object");
    lua.globals().set("obj", value).expect("sets obj");
    let result: mlua::Table = lua.load(script).eval().expect("the script runs");
    HealthStatus {
        status: result.get("status").expect("a status"),
        message: result.get("message").expect("a message"),
    }
}

/// The GitOps rule, for Argo CD: health comes from conditions and observedGeneration, a paused
/// object shows Suspended, and an object the operator has not caught up with is not Healthy.
#[test]
fn every_kind_has_a_health_script_whose_test_cases_pass() {
    for kind in KINDS {
        let dir = kind_dir(kind);
        let script = std::fs::read_to_string(dir.join("health.lua"))
            .unwrap_or_else(|_| panic!("{kind} has no health.lua"));
        let tests: HealthTests = serde_yaml_ng::from_str(
            &std::fs::read_to_string(dir.join("health_test.yaml")).expect("health_test.yaml"),
        )
        .expect("parses");
        assert!(tests.tests.len() >= 5, "{kind}: too few cases");
        for case in tests.tests {
            let input: serde_json::Value = serde_yaml_ng::from_str(
                &std::fs::read_to_string(dir.join(&case.input_path)).expect("input"),
            )
            .expect("input parses");
            assert_eq!(
                health(&script, &input),
                case.health_status,
                "{kind} {}",
                case.input_path
            );
        }
    }
}

/// The scripts read what the operator writes: a status rendered by the operator's own code.
#[test]
fn a_status_written_by_the_operator_reads_as_healthy() {
    let conditions = dlock_operator::controller::status::Conditions::ready("2/2 replicas ready")
        .render(&[], Some(3), crate::fixtures::NOW);
    let object = serde_json::json!({
        "metadata": {"name": "lock-server", "generation": 3},
        "status": {"observedGeneration": 3, "conditions": conditions},
    });
    let script = std::fs::read_to_string(kind_dir("LockServer").join("health.lua")).unwrap();
    assert_eq!(
        health(&script, &object),
        HealthStatus {
            status: "Healthy".to_owned(),
            message: "2/2 replicas ready".to_owned()
        }
    );
}

/// The argocd-cm snippet in docs/argocd.md is the shipped script, word for word.
#[test]
fn the_argocd_cm_snippet_in_the_docs_is_the_shipped_script() {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/argocd.md"))
            .unwrap();
    let start = docs.find("&dlockHealth |\n").expect("the snippet") + "&dlockHealth |\n".len();
    let snippet: String = docs[start..]
        .lines()
        .take_while(|line| line.starts_with("    ") || line.is_empty())
        .map(|line| format!("{}\n", line.strip_prefix("    ").unwrap_or(line)))
        .collect();
    for kind in KINDS {
        let script = std::fs::read_to_string(kind_dir(kind).join("health.lua")).unwrap();
        let body: String = script
            .lines()
            .skip_while(|line| line.starts_with("--"))
            .map(|line| format!("{line}\n"))
            .collect();
        assert_eq!(snippet, body, "{kind}");
    }
}
