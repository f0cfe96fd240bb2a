//! `kubectl dlock resolve`: a RAIL_AMBIGUOUS payout resolved at the namespace's payment resource.

use super::*;

pub(super) async fn resolve(kube: &Kube, args: ResolveArgs) -> Result<()> {
    let ns = &kube.namespace;
    let outcome_given = args.decision.posted || args.decision.failed;
    if !outcome_given {
        bail!(
            "say --posted --rail-reference R (the rail paid it) or --failed --evidence TEXT (it did not)"
        );
    }
    let token = operator_token(&args)?;
    let resources = kube
        .list::<PaymentResource>("paymentresources.dlock.io")
        .await?;
    let resource = chosen_payment_resource(&resources, args.payment_resource.as_deref(), ns)?;
    // The operator credential goes only to the URL of the PaymentResource's own Service, built
    // from its name: never to `status.url`, which anyone who may write the status can set.
    let name = dlock_operator::workload::ServiceName::new(&resource.name_any())
        .map_err(|e| anyhow!("PaymentResource {ns}/{}: {e}", resource.name_any()))?;
    let url = dlock_operator::workload::service_url(&name, ns);
    let operator = kube.operator(args.operator.as_deref()).await;
    let evidence = match (&args.evidence, &args.decision.rail_reference) {
        (Some(e), _) => e.clone(),
        (None, Some(r)) => format!("the rail's reference {r}"),
        (None, None) => bail!("--failed needs --evidence TEXT (what the decision rests on)"),
    };
    let payout = args.decision.payout_id.to_string();
    let resolved = crate::jobs::resolve(crate::jobs::ResolveArgs {
        decision: args.decision.clone(),
        operator,
        evidence,
        payment_resource: url.clone(),
        operator_token: token,
    })
    .await
    .map_err(|e| with_port_forward_hint(&e, resource, &url, ns));
    resolved?;
    refresh_batches_listing(kube, &payout).await;
    Ok(())
}

/// The operator credential: `--credential-file`, else `DLOCK_OPERATOR_TOKEN`.
fn operator_token(args: &ResolveArgs) -> Result<String> {
    Ok(match (&args.credential_file, &args.operator_token) {
        (Some(path), _) => dlock_contract::auth::Credential::from_file(path)
            .map_err(|e| anyhow!("--credential-file (DLOCK_CREDENTIAL_FILE): {e}"))?
            .token(),
        (None, Some(token)) if !token.trim().is_empty() => token.trim().to_owned(),
        _ => bail!(
            "no operator credential: set DLOCK_OPERATOR_TOKEN or give --credential-file FILE (a token of an \
             identity the payment resource lists in auth.operator-identities)"
        ),
    })
}

/// The PaymentResource named by `--payment-resource`, else the only one in the namespace.
fn chosen_payment_resource<'a>(
    resources: &'a [PaymentResource],
    named: Option<&str>,
    ns: &str,
) -> Result<&'a PaymentResource> {
    Ok(match named {
        Some(name) => resources.iter().find(|r| r.name_any() == name).ok_or_else(|| {
            anyhow!("paymentresource {name} not found in namespace {ns} (`kubectl get paymentresources -n {ns}`)")
        })?,
        None => match resources {
            [only] => only,
            [] => bail!("no PaymentResource in namespace {ns}: is this the namespace of the stack? (-n NAMESPACE)"),
            several => bail!(
                "{} PaymentResources in namespace {ns} ({}); say which with --payment-resource NAME",
                several.len(),
                several.iter().map(|r| r.name_any()).collect::<Vec<_>>().join(", ")
            ),
        },
    })
}

/// A payment resource that did not answer at its in-cluster address: how to reach it from
/// outside the cluster. Other errors as they are.
fn with_port_forward_hint(
    error: &anyhow::Error,
    resource: &PaymentResource,
    url: &str,
    ns: &str,
) -> anyhow::Error {
    let authority = url
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .to_owned();
    let text = format!("{error:#}");
    if text.contains("no answer from") {
        anyhow!(
            "{text}\nthe PaymentResource {} is at {url}, an in-cluster address: from outside the cluster run \
             `kubectl port-forward -n {ns} svc/{} 18080:8080` and set DLOCK_SERVICE_ADDRESSES={authority}=127.0.0.1:18080",
            resource.name_any(),
            resource.name_any()
        )
    } else {
        anyhow!("{text}")
    }
}

/// The annotation that asks the operator to count a batch's payouts again now (any change to
/// the object starts a reconcile, which re-reads the payouts' states from paydb).
pub const REFRESH_ANNOTATION: &str = "dlock.io/refresh-requested-at";

/// After a resolution: the batches that list `payout` as RAIL_AMBIGUOUS are asked to count again,
/// so `status` and `batch` stop listing it at once instead of at the next resync (5 minutes).
pub(super) async fn refresh_batches_listing(kube: &Kube, payout: &str) {
    let Ok(batches) = kube.list::<PayoutBatch>("payoutbatches.dlock.io").await else {
        return;
    };
    let api = kube.api::<PayoutBatch>();
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let patch = serde_json::json!({"metadata": {"annotations": {REFRESH_ANNOTATION: now}}});
    for batch in batches.iter().filter(|b| {
        b.status
            .as_ref()
            .is_some_and(|s| s.ambiguous.iter().any(|a| a == payout))
    }) {
        let name = batch.name_any();
        match api
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => println!("payoutbatch.dlock.io/{name} asked to count its payouts again"),
            Err(e) => eprintln!(
                "note: PayoutBatch {name} still lists {payout} until the operator counts again (within 5 minutes): {}",
                kube.explain(e, "patch", "payoutbatches.dlock.io", Some(&name))
            ),
        }
    }
}
