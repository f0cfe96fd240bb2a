//! On the real API server, with the operator under the chart's RBAC: a PayoutBatch cannot choose
//! what runs beside the services' credentials. Its `spec.image` must be the operator's own image or
//! one the platform allows (`--allowed-image`, the chart's `allowedImages`); any other is
//! `Degraded/InvalidSpec` naming the field, and no Job is made. Control: the same batch naming an
//! allowed image gets its Job.

use std::time::Duration;

use crate::executor_identity::{self, batch_world, refused_batch};
use crate::world::World;

/// The operator's own image in this suite (`World::start_operator`).
const OWN_IMAGE: &str = "dlock:e2e";
const ALLOWED: &str = "registry.example/dlock:pinned";

fn batch(name: &str, image: &str) -> String {
    executor_identity::batch(name, &format!("  image: {image:?}\n"))
}

/// The names of the Jobs in `ns`.
fn jobs(world: &World, ns: &str) -> Vec<String> {
    executor_identity::jobs(world, ns)
        .iter()
        .filter_map(|j| j["metadata"]["name"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_payout_batch_naming_an_image_the_platform_does_not_allow_runs_nothing() {
    let ns = "images";
    let world = batch_world(ns, &[("DLOCK_OPERATOR_ALLOWED_IMAGES", ALLOWED)]).await;

    let message = refused_batch(
        &world,
        ns,
        "foreign",
        &batch("foreign", "evil.example/exfiltrate:latest"),
    );
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
    let images: Vec<String> = executor_identity::jobs(&world, ns)
        .iter()
        .filter_map(|j| j["spec"]["template"]["spec"]["containers"][0]["image"].as_str())
        .map(str::to_owned)
        .collect();
    assert!(
        images.iter().all(|i| i == ALLOWED || i == OWN_IMAGE),
        "{images:?}"
    );
}
