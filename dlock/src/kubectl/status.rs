//! `kubectl dlock status`: the namespace's dlock resources, held locks and ambiguous payouts.

use super::*;

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusView {
    pub context: String,
    pub namespace: String,
    pub resources: Vec<ResourceView>,
    pub locks: Vec<LockView>,
    pub ambiguous_payouts: Vec<AmbiguousView>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceView {
    pub kind: String,
    pub name: String,
    /// The Ready condition's status, `Unknown` when there is none yet.
    pub ready: String,
    /// The Degraded condition's status, `False` when there is none.
    pub degraded: String,
    /// The Degraded condition's reason and message when it is True, else the Ready one's.
    pub reason: String,
    pub message: String,
    pub conditions: Vec<Condition>,
}

/// A held lock as the operator mirrors it: the Lock's own spec and status, so a field the CRD
/// gains shows in `-o json` without a second edit here. As in the Lock itself, a status field
/// the operator has not written yet is left out.
#[derive(Debug, Serialize)]
pub struct LockView {
    pub name: String,
    #[serde(flatten)]
    pub spec: LockSpec,
    #[serde(flatten)]
    pub status: LockStatus,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AmbiguousView {
    pub batch: String,
    pub payout_id: String,
}

pub(super) fn resource_view(kind: &str, name: String, reported: Reported) -> ResourceView {
    let ready = reported.find("Ready");
    let degraded = reported.find("Degraded");
    let explaining = degraded
        .filter(|d| d.status == "True")
        .or(ready)
        .or_else(|| reported.find("Progressing"));
    ResourceView {
        kind: kind.to_owned(),
        name,
        ready: ready.map_or("Unknown", |c| c.status.as_str()).to_owned(),
        degraded: degraded.map_or("False", |c| c.status.as_str()).to_owned(),
        reason: explaining.map(|c| c.reason.clone()).unwrap_or_default(),
        message: explaining.map(|c| c.message.clone()).unwrap_or_default(),
        conditions: reported.conditions,
    }
}

/// The rows of one kind's objects, from their status conditions (every dlock status flattens a
/// [`Reported`] into a type of its own per kind).
macro_rules! resource_views {
    ($kind:literal, $objects:expr) => {
        $objects.iter().map(|o| {
            resource_view(
                $kind,
                o.name_any(),
                o.status
                    .as_ref()
                    .map(|s| s.reported.clone())
                    .unwrap_or_default(),
            )
        })
    };
}

pub async fn status_view(kube: &Kube) -> Result<StatusView> {
    let (
        lock_servers,
        payment_resources,
        rail_proxies,
        batches,
        reconciliations,
        revocations,
        locks,
    ) = futures::try_join!(
        kube.list::<LockServer>("lockservers.dlock.io"),
        kube.list::<PaymentResource>("paymentresources.dlock.io"),
        kube.list::<RailProxy>("railproxies.dlock.io"),
        kube.list::<PayoutBatch>("payoutbatches.dlock.io"),
        kube.list::<Reconciliation>("reconciliations.dlock.io"),
        kube.list::<LockRevocation>("lockrevocations.dlock.io"),
        kube.list::<Lock>("locks.dlock.io"),
    )?;
    let resources = resource_views!("LockServer", lock_servers)
        .chain(resource_views!("PaymentResource", payment_resources))
        .chain(resource_views!("RailProxy", rail_proxies))
        .chain(resource_views!("PayoutBatch", batches))
        .chain(resource_views!("Reconciliation", reconciliations))
        .chain(resource_views!("LockRevocation", revocations))
        .collect();
    Ok(StatusView {
        context: kube.context.clone(),
        namespace: kube.namespace.clone(),
        resources,
        locks: locks.iter().map(lock_view).collect(),
        ambiguous_payouts: ambiguous_payouts(&batches),
    })
}

pub(super) fn lock_view(lock: &Lock) -> LockView {
    LockView {
        name: lock.name_any(),
        spec: lock.spec.clone(),
        status: lock.status.clone().unwrap_or_default(),
    }
}

/// The RAIL_AMBIGUOUS payouts the batches list in their status.
fn ambiguous_payouts(batches: &[PayoutBatch]) -> Vec<AmbiguousView> {
    batches
        .iter()
        .flat_map(|b| {
            let batch = b.name_any();
            b.status
                .iter()
                .flat_map(|s| s.ambiguous.clone())
                .map(move |payout_id| AmbiguousView {
                    batch: batch.clone(),
                    payout_id,
                })
        })
        .collect()
}

pub fn status_table(view: &StatusView) -> String {
    let ns = &view.namespace;
    let mut out = section(
        &["kind", "name", "ready", "degraded", "reason", "message"],
        view.resources.iter().map(resource_row).collect(),
        format!("No dlock resources found in {ns} namespace.\n"),
    );
    out.push('\n');
    out.push_str(&section(
        &["lock", "key", "holder", "token", "expires"],
        view.locks.iter().map(lock_row).collect(),
        format!("No held locks in {ns} namespace.\n"),
    ));
    out.push('\n');
    out.push_str(&section(
        &["batch", "payout", "state"],
        view.ambiguous_payouts.iter().map(ambiguous_row).collect(),
        format!("No RAIL_AMBIGUOUS payouts in {ns} namespace.\n"),
    ));
    if !view.ambiguous_payouts.is_empty() {
        out.push_str(&format!(
            "\nResolve each after checking the rail: kubectl dlock resolve PAYOUT -n {ns} --posted --rail-reference R | --failed --evidence TEXT\n"
        ));
    }
    out
}

/// A table of `rows` under `headers`, or `none` when there are no rows.
fn section(headers: &[&str], rows: Vec<Vec<String>>, none: String) -> String {
    if rows.is_empty() {
        none
    } else {
        table(headers, &rows)
    }
}

fn resource_row(r: &ResourceView) -> Vec<String> {
    vec![
        r.kind.clone(),
        r.name.clone(),
        r.ready.clone(),
        r.degraded.clone(),
        r.reason.clone(),
        cell(&r.message, 100),
    ]
}

fn ambiguous_row(a: &AmbiguousView) -> Vec<String> {
    let state = "RAIL_AMBIGUOUS".to_owned();
    vec![a.batch.clone(), a.payout_id.clone(), state]
}

fn lock_row(l: &LockView) -> Vec<String> {
    vec![
        l.name.clone(),
        l.spec.key.clone(),
        l.status.holder.clone().unwrap_or_default(),
        l.status.token.map(|t| t.to_string()).unwrap_or_default(),
        l.status.expires_at.clone().unwrap_or_default(),
    ]
}

pub(super) async fn status(kube: &Kube, output: Output) -> Result<()> {
    print_view(output, &status_view(kube).await?, status_table)
}
