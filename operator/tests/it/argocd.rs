//! The Argo CD health script (`argocd/dlock.io/_/health.lua`, one for every dlock.io kind), run
//! by a real Lua 5.4 against every case of its `health_test.yaml`, the way Argo CD's own test
//! runner does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlua::{Lua, LuaSerdeExt};
use serde::Deserialize;

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

/// `argocd/dlock.io/_`: `_` is the kind wildcard of Argo CD's `resource_customizations` layout.
fn group_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../argocd/dlock.io/_")
}

fn script() -> String {
    std::fs::read_to_string(group_dir().join("health.lua")).expect("argocd/dlock.io/_/health.lua")
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
/// Every kind the operator defines has its own cases, and each case's object is of that kind.
#[test]
fn the_health_script_passes_every_case_of_every_kind() {
    let script = script();
    let dir = group_dir();
    let tests: HealthTests = serde_yaml_ng::from_str(
        &std::fs::read_to_string(dir.join("health_test.yaml")).expect("health_test.yaml"),
    )
    .expect("parses");
    let mut cases_per_kind = BTreeMap::<String, usize>::new();
    for case in tests.tests {
        let input: serde_json::Value = serde_yaml_ng::from_str(
            &std::fs::read_to_string(dir.join(&case.input_path)).expect("input"),
        )
        .expect("input parses");
        let kind = input["kind"].as_str().expect("the input names its kind");
        assert!(
            case.input_path.starts_with(&format!("testdata/{kind}/")),
            "{}: a {kind} under another kind's testdata",
            case.input_path
        );
        assert_eq!(
            health(&script, &input),
            case.health_status,
            "{}",
            case.input_path
        );
        *cases_per_kind.entry(kind.to_owned()).or_default() += 1;
    }
    for (_, crd) in dlock_operator::crd::all() {
        let kind = crd.spec.names.kind;
        let cases = cases_per_kind.remove(&kind).unwrap_or(0);
        assert!(cases >= 6, "{kind}: {cases} health cases, want at least 6");
    }
    assert!(
        cases_per_kind.is_empty(),
        "cases for kinds the operator does not define: {cases_per_kind:?}"
    );
}

/// The script reads what the operator writes: a status rendered by the operator's own code.
#[test]
fn a_status_written_by_the_operator_reads_as_healthy() {
    let conditions = dlock_operator::controller::status::Conditions::ready("2/2 replicas ready")
        .render(&[], Some(3), crate::fixtures::NOW);
    let object = serde_json::json!({
        "metadata": {"name": "lock-server", "generation": 3},
        "status": {"observedGeneration": 3, "conditions": conditions},
    });
    assert_eq!(
        health(&script(), &object),
        HealthStatus {
            status: "Healthy".to_owned(),
            message: "2/2 replicas ready".to_owned()
        }
    );
}

/// The argocd-cm snippet in docs/argocd.md is the shipped script, word for word, under the
/// group wildcard key.
#[test]
fn the_argocd_cm_snippet_in_the_docs_is_the_shipped_script() {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/argocd.md"))
            .unwrap();
    let key = "  resource.customizations: |\n    dlock.io/*:\n      health.lua: |\n";
    let start = docs.find(key).expect("the dlock.io/* snippet") + key.len();
    let snippet: String = docs[start..]
        .lines()
        .take_while(|line| line.starts_with("        ") || line.is_empty())
        .map(|line| format!("{}\n", line.strip_prefix("        ").unwrap_or(line)))
        .collect();
    assert_eq!(snippet, script());
}

/// One copy on disk: no per-kind script left beside the group's.
#[test]
fn the_health_script_is_the_only_one() {
    fn scripts(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                scripts(&path, found);
            } else if path.extension().is_some_and(|ext| ext == "lua") {
                found.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../argocd");
    let mut found = Vec::new();
    scripts(&root, &mut found);
    assert_eq!(found, vec![group_dir().join("health.lua")]);
}
