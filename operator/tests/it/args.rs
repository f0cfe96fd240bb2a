//! The chart's settings reach `dlock operator`: every env var the Deployment template sets for a
//! flag is the env var that flag reads.

use clap::Args as _;
use dlock_operator::run::OperatorArgs;

fn env_of(flag: &str) -> String {
    let command = OperatorArgs::augment_args(clap::Command::new("operator"));
    let arg = command
        .get_arguments()
        .find(|a| a.get_long() == Some(flag))
        .unwrap_or_else(|| panic!("no --{flag}"));
    arg.get_env()
        .unwrap_or_else(|| panic!("--{flag} reads no env var"))
        .to_string_lossy()
        .into_owned()
}

/// A file of the Helm chart, `charts/dlock/<path>`.
fn chart_file(path: &str) -> String {
    std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../charts/dlock")
            .join(path),
    )
    .unwrap()
}

/// `--flag` reads the env var `env`, which the chart's Deployment template sets to `value`.
fn assert_chart_sets(flag: &str, env: &str, value: &str) {
    assert_eq!(env_of(flag), env);
    let template = chart_file("templates/deployment.yaml");
    let wired = format!("- name: {env}\n              value: {value}");
    assert!(template.contains(&wired), "the chart does not set {env}");
}

#[test]
fn the_charts_lease_duration_reaches_the_operator() {
    assert_chart_sets(
        "lease-duration-s",
        "DLOCK_OPERATOR_LEASE_DURATION_S",
        "{{ .Values.leaderElection.durationSeconds | quote }}",
    );
    let values = chart_file("values.yaml");
    assert!(
        values.contains("durationSeconds: 15"),
        "the chart's default"
    );
}

/// The operator's identity at the services is its own service account, which the chart names in
/// DLOCK_OPERATOR_SERVICE_ACCOUNT; the identity fits the 64 characters of an owner id for the
/// chart's default names.
#[test]
fn the_charts_service_account_reaches_the_operator() {
    assert_chart_sets(
        "service-account",
        "DLOCK_OPERATOR_SERVICE_ACCOUNT",
        "{{ include \"dlock.serviceAccountName\" . }}",
    );
    let identity =
        dlock_operator::validate::service_account_identity("dlock-system", "dlock-operator");
    assert_eq!(
        identity,
        "system:serviceaccount:dlock-system:dlock-operator"
    );
    assert!(identity.len() <= 64);
}

/// The operator presents a projected service-account token with the audience `dlock` by default,
/// the audience the services it deploys check (`auth.tokenreview.audiences`); a static token
/// Secret replaces it rather than failing the install.
#[test]
fn the_chart_gives_the_operator_a_projected_token_for_the_audience_dlock_by_default() {
    let values: serde_yaml_ng::Value = serde_yaml_ng::from_str(&chart_file("values.yaml")).unwrap();
    let projected = &values["operatorToken"]["projectedServiceAccountToken"];
    assert_eq!(projected["enabled"], serde_yaml_ng::Value::Bool(true));
    assert_eq!(
        projected["audience"].as_str(),
        Some(dlock_operator::build::job::TOKEN_AUDIENCE)
    );
    assert_eq!(values["operatorToken"]["existingSecret"].as_str(), Some(""));
    let template = chart_file("templates/deployment.yaml");
    assert!(
        template.contains(
            "$projected := and .Values.operatorToken.projectedServiceAccountToken.enabled (not .Values.operatorToken.existingSecret)"
        ),
        "a static token Secret replaces the projected token"
    );
    assert!(
        !template.contains("fail "),
        "no value combination fails the install"
    );
}
