//! `kubectl dlock batch`: a PayoutBatch's phase, counts and executor Job, optionally watched.

use super::*;

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchView {
    pub name: String,
    pub namespace: String,
    /// `Pending` (no status yet), `Running`, `Succeeded`, `Degraded` or `Failed`.
    pub phase: String,
    /// The batch's size (`spec.payouts`).
    pub payouts: usize,
    /// Payouts per state as the operator last counted them in paydb.
    pub counts: BTreeMap<String, i64>,
    pub ambiguous: Vec<String>,
    pub fenced_out: Option<i64>,
    pub summary: Option<String>,
    pub conditions: Vec<Condition>,
    pub job: Option<JobView>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobView {
    pub name: String,
    /// `Running`, `Complete`, `Failed` or `Absent`.
    pub state: String,
    pub active: i32,
    pub succeeded: i32,
    pub failed: i32,
    pub message: Option<String>,
}

pub fn batch_phase(reported: &Reported, job: Option<&JobView>) -> &'static str {
    let is_true = |t: &str| reported.find(t).is_some_and(|c| c.status == "True");
    if is_true("Degraded") {
        if job.is_some_and(|j| j.state == "Failed") {
            "Failed"
        } else {
            "Degraded"
        }
    } else if is_true("Ready") {
        "Succeeded"
    } else if reported.conditions.is_empty() {
        "Pending"
    } else {
        "Running"
    }
}

pub(super) fn job_view(name: &str, job: Option<&Job>) -> JobView {
    let Some(job) = job else {
        return JobView {
            name: name.to_owned(),
            state: "Absent".to_owned(),
            active: 0,
            succeeded: 0,
            failed: 0,
            message: None,
        };
    };
    let status = job.status.clone().unwrap_or_default();
    let ended = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.status == "True" && (c.type_ == "Complete" || c.type_ == "Failed"));
    JobView {
        name: name.to_owned(),
        state: ended.map_or("Running", |c| c.type_.as_str()).to_owned(),
        active: status.active.unwrap_or(0),
        succeeded: status.succeeded.unwrap_or(0),
        failed: status.failed.unwrap_or(0),
        message: ended.and_then(|c| c.message.clone()),
    }
}

pub(super) async fn batch_view(kube: &Kube, batch: &PayoutBatch) -> Result<BatchView> {
    let status = batch.status.clone().unwrap_or_default();
    let job = match &status.job_name {
        Some(job_name) => {
            let found = kube
                .api::<Job>()
                .get_opt(job_name)
                .await
                .map_err(|e| kube.explain(e, "get", "jobs.batch", Some(job_name)))?;
            Some(job_view(job_name, found.as_ref()))
        }
        None => None,
    };
    Ok(BatchView {
        name: batch.name_any(),
        namespace: kube.namespace.clone(),
        phase: batch_phase(&status.reported, job.as_ref()).to_owned(),
        payouts: batch.spec.payouts.len(),
        counts: status.counts,
        ambiguous: status.ambiguous,
        fenced_out: status.fenced_out,
        summary: status.summary,
        conditions: status.reported.conditions,
        job,
    })
}

pub fn batch_table(view: &BatchView) -> String {
    let job = view.job.as_ref();
    let mut out = table(
        &["name", "phase", "payouts", "counted", "job", "job-state"],
        &[vec![
            view.name.clone(),
            view.phase.clone(),
            view.payouts.to_string(),
            view.counts.values().sum::<i64>().to_string(),
            job.map(|j| j.name.clone()).unwrap_or_default(),
            job.map(|j| {
                if j.state == "Running" {
                    format!("Running ({} active)", j.active)
                } else {
                    j.state.clone()
                }
            })
            .unwrap_or_default(),
        ]],
    );
    out.push('\n');
    if view.counts.is_empty() {
        out.push_str("No payouts counted yet (the operator counts them in paydb every 10 s while the batch runs).\n");
    } else {
        let rows: Vec<Vec<String>> = view
            .counts
            .iter()
            .map(|(state, n)| vec![state.clone(), n.to_string()])
            .collect();
        out.push_str(&table(&["state", "payouts"], &rows));
    }
    out.push('\n');
    let rows: Vec<Vec<String>> = view
        .conditions
        .iter()
        .map(|c| {
            vec![
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                cell(&c.message, 100),
            ]
        })
        .collect();
    if rows.is_empty() {
        out.push_str("No conditions yet: the operator has not reconciled the batch.\n");
    } else {
        out.push_str(&table(&["condition", "status", "reason", "message"], &rows));
    }
    if !view.ambiguous.is_empty() {
        out.push_str(&format!(
            "\n{} payout(s) are RAIL_AMBIGUOUS: `kubectl dlock status -n {}` lists them; resolve each with \
             `kubectl dlock resolve PAYOUT --posted --rail-reference R | --failed --evidence TEXT`\n",
            view.ambiguous.len(),
            view.namespace
        ));
    }
    out
}

pub(super) fn show_batch(view: &BatchView, output: Output, watching: bool) -> Result<()> {
    if !watching {
        return print_view(output, view, batch_table);
    }
    // While watching: a blank line after each table, and one document per line as
    // `kubectl get -w -o json` streams objects.
    match output {
        Output::Table => println!("{}", batch_table(view)),
        Output::Json => println!("{}", serde_json::to_string(view)?),
        Output::Yaml => print!("---\n{}", serde_yaml_ng::to_string(view)?),
    }
    Ok(())
}

pub(super) async fn batch(kube: &Kube, args: BatchArgs, output: Output) -> Result<()> {
    let api = kube.api::<PayoutBatch>();
    let object = api
        .get(&args.name)
        .await
        .map_err(|e| kube.explain(e, "get", "payoutbatches.dlock.io", Some(&args.name)))?;
    let view = batch_view(kube, &object).await?;
    show_batch(&view, output, args.watch)?;
    if !args.watch {
        return Ok(());
    }
    let ended = |v: &BatchView| {
        v.job
            .as_ref()
            .is_some_and(|j| j.state == "Complete" || j.state == "Failed")
    };
    if ended(&view) {
        return Ok(());
    }
    let mut shown = serde_json::to_value(&view)?;
    let watch = kube::runtime::watcher::watch_object(api, &args.name).default_backoff();
    let mut watch = std::pin::pin!(watch);
    let mut failures = 0;
    while let Some(event) = watch.next().await {
        if event.is_ok() {
            failures = 0;
        }
        let object = match event {
            Ok(Some(object)) => object,
            Ok(None) => bail!("PayoutBatch {} was deleted", args.name),
            Err(e) => {
                failures += 1;
                if failures >= WATCH_FAILURES_MAX {
                    bail!(
                        "watching PayoutBatch {}: {e} ({failures} times in a row)",
                        args.name
                    );
                }
                eprintln!("note: watching PayoutBatch {} again after: {e}", args.name);
                continue;
            }
        };
        let view = batch_view(kube, &object).await?;
        let now = serde_json::to_value(&view)?;
        if now != shown {
            show_batch(&view, output, true)?;
            shown = now;
        }
        if ended(&view) {
            return Ok(());
        }
    }
    Ok(())
}
