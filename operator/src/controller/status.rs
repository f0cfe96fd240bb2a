//! Status: conditions computed from what was applied, never from the raw spec alone.

use k8s_openapi::api::apps::v1::Deployment;

use crate::crd::Condition;

pub const READY: &str = "Ready";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";

/// One condition's new value.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Observed {
    pub fn new(status: bool, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            reason,
            message: message.into(),
        }
    }
}

/// The three conditions, in order. `lastTransitionTime` moves only when a status changes.
#[derive(Clone, Debug, PartialEq)]
pub struct Conditions {
    pub ready: Observed,
    pub progressing: Observed,
    pub degraded: Observed,
}

impl Conditions {
    pub fn ready(message: impl Into<String>) -> Self {
        Self {
            ready: Observed::new(true, "Available", message),
            progressing: Observed::new(false, "Done", ""),
            degraded: Observed::new(false, "Healthy", ""),
        }
    }
    pub fn progressing(reason: &'static str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            ready: Observed::new(false, reason, message.clone()),
            progressing: Observed::new(true, reason, message),
            degraded: Observed::new(false, "Healthy", ""),
        }
    }
    pub fn degraded(reason: &'static str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            ready: Observed::new(false, reason, message.clone()),
            progressing: Observed::new(false, reason, ""),
            degraded: Observed::new(true, reason, message),
        }
    }

    pub fn render(
        &self,
        previous: &[Condition],
        generation: Option<i64>,
        now: &str,
    ) -> Vec<Condition> {
        [
            (READY, &self.ready),
            (PROGRESSING, &self.progressing),
            (DEGRADED, &self.degraded),
        ]
        .into_iter()
        .map(|(type_, observed)| condition(previous, type_, observed, generation, now))
        .collect()
    }
}

fn status_text(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

pub fn condition(
    previous: &[Condition],
    type_: &str,
    observed: &Observed,
    generation: Option<i64>,
    now: &str,
) -> Condition {
    let status = status_text(observed.status);
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| now.to_owned());
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: observed.reason.to_owned(),
        message: observed.message.clone(),
        last_transition_time: Some(last_transition_time),
        observed_generation: generation,
    }
}

/// The Ready condition's `(status, reason)`, to tell a transition (and so an Event) apart.
pub fn ready_of(conditions: &[Condition]) -> Option<(String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == READY)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// How far an applied Deployment's rollout is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rollout {
    Available { ready: i32 },
    RollingOut { ready: i32, desired: i32 },
    Stuck { message: String },
}

pub fn rollout(deployment: &Deployment) -> Rollout {
    let desired = deployment
        .spec
        .as_ref()
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    let generation = deployment.metadata.generation.unwrap_or(0);
    let Some(status) = &deployment.status else {
        return Rollout::RollingOut { ready: 0, desired };
    };
    if let Some(stuck) = status.conditions.iter().flatten().find(|c| {
        c.type_ == "Progressing"
            && c.status == "False"
            && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
    }) {
        return Rollout::Stuck {
            message: stuck.message.clone().unwrap_or_default(),
        };
    }
    let ready = status.ready_replicas.unwrap_or(0);
    let updated = status.updated_replicas.unwrap_or(0);
    let observed = status.observed_generation.unwrap_or(0);
    if observed >= generation && updated >= desired && ready >= desired {
        Rollout::Available { ready }
    } else {
        Rollout::RollingOut { ready, desired }
    }
}
