//! On the real API server, with the operator under the chart's RBAC: a PayoutBatch cannot choose
//! what runs beside the services' credentials. Its `spec.image` must be the operator's own image or
//! one the platform allows (`--allowed-image`, the chart's `allowedImages`); any other is
//! `Degraded/InvalidSpec` naming the field, and no Job is made. Control: the same batch naming an
//! allowed image gets its Job.

use std::time::Duration;

use serde_json::Value;

use crate::world::{World, condition};

/// The operator's own image in this suite (`World::start_operator`).
const OWN_IMAGE: &str = "dlock:e2e";
const ALLOWED: &str = "registry.example/dlock:pinned";

fn batch(name: &str, image: &str) -> String {
    format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n  \
         image: {image:?}\n  payouts:\n  - key: p1\n    accountId: acct-1\n    \
         amountMinor: 100\n    currency: EUR\n    beneficiaryRef: ben-1\n"
    )
}

fn jobs(world: &World, ns: &str) -> Vec<String> {
    world.get_json(&["jobs", "-n", ns])["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|j| j["metadata"]["name"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payout_batch_naming_an_image_the_platform_does_not_allow_runs_nothing() {
    let ns = "images";
    let mut world = World::with_namespace(ns).await;
    world.start_services(&[]);
    // The operator registers a batch's payouts before it makes the Job: the account exists.
    crate::shared::accounts::open_account(
        &world.services().treasury_payments(),
        "acct-1",
        Some(1_000_000),
    )
    .await;
    world.start_operator(&[ns], &[("DLOCK_OPERATOR_ALLOWED_IMAGES", ALLOWED)]);

    world
        .apply(ns, &batch("foreign", "evil.example/exfiltrate:latest"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let refused = world.wait_for(
        "the foreign image's batch is Degraded",
        Duration::from_secs(60),
        || world.get_json(&["payoutbatch", "foreign", "-n", ns]),
        |b: &Value| condition(b, "Degraded").is_some_and(|c| c["status"] == "True"),
    );
    let degraded = condition(&refused, "Degraded").cloned().unwrap_or_default();
    assert_eq!(degraded["reason"], "InvalidSpec", "{degraded}");
    let message = degraded["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("spec.image") && message.contains("allowedImages"),
        "the condition names the field and what to do: {message}"
    );

    // Controls: the allowed image and the operator's own are run, each batch by its Job.
    for (name, image) in [("allowed", ALLOWED), ("own", OWN_IMAGE)] {
        world
            .apply(ns, &batch(name, image))
            .unwrap_or_else(|e| panic!("{e:#}"));
        world.wait_until(
            &format!("the Job of the batch naming {image}"),
            Duration::from_secs(60),
            || jobs(&world, ns).iter().any(|j| j.starts_with(name)),
        );
    }
    let made = jobs(&world, ns);
    assert!(
        !made.iter().any(|j| j.starts_with("foreign")),
        "a Job was made for the foreign image: {made:?}"
    );
    let images: Vec<String> = world.get_json(&["jobs", "-n", ns])["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|j| j["spec"]["template"]["spec"]["containers"][0]["image"].as_str())
        .map(str::to_owned)
        .collect();
    assert!(
        images.iter().all(|i| i == ALLOWED || i == OWN_IMAGE),
        "{images:?}"
    );
}
