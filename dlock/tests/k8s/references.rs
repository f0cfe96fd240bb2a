//! On the real API server: a reference to a dlock service that is not a Service name is refused
//! at admission, by the CRD's pattern, naming the field. The operator never sees it, and so never
//! builds a URL of it to send its credential to.

use crate::world::World;

/// A PayoutBatch of one payout whose `spec.paymentResource` is `reference`.
fn batch(name: &str, reference: &str) -> String {
    format!(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: {name}\nspec:\n  \
         paymentResource: {reference:?}\n  payouts:\n  - key: p1\n    accountId: acct-1\n    \
         amountMinor: 100\n    currency: EUR\n    beneficiaryRef: ben-1\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_refuses_a_service_reference_that_is_not_a_service_name() {
    let ns = "refs";
    let world = World::with_namespace(ns).await;
    let dry_run = ["apply", "--dry-run=server", "-n", ns, "-f", "-"];
    // Positive control: a Service name is admitted.
    world
        .cluster
        .kubectl_with_input(&dry_run, Some(&batch("good", "payments-eu")))
        .unwrap_or_else(|e| panic!("a Service name was refused: {e:#}"));
    for hostile in [
        "evil.example:80/?",
        "evil.example",
        "Payments",
        "payments/../x",
    ] {
        let refused = world
            .cluster
            .kubectl_with_input(&dry_run, Some(&batch("hostile", hostile)));
        let message = match refused {
            Ok(out) => panic!("{hostile:?} was admitted: {out}"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            message.contains("spec.paymentResource"),
            "{hostile:?}: {message}"
        );
    }
}
