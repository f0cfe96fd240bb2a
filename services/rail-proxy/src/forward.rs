//! The one forward to the rail (docs/contract.md#rail-step-4): after the intent is durable, the
//! transfer is presented once and never retried; the answer is read into what it means.

use serde::Deserialize;
use serde_json::json;

use crate::AppState;
use dlock_contract::rail::SubmissionRequest;

/// What the rail's answer means.
pub(crate) enum RailAnswer {
    Acked(String),
    Rejected(String),
    Unknown(Unknown),
}

/// An outcome we cannot read. `reason` is what the caller is told: what kind of failure, never
/// where the rail is. `detail` is the full error, rail address included, for
/// the operator's log only.
pub(crate) struct Unknown {
    pub(crate) reason: &'static str,
    pub(crate) detail: String,
}

impl Unknown {
    fn answer(reason: &'static str, detail: impl std::fmt::Display) -> RailAnswer {
        RailAnswer::Unknown(Self {
            reason,
            detail: detail.to_string(),
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RailAck {
    rail_reference: String,
}

/// Presents the transfer to the rail, once; never retried, whatever happens.
pub(crate) async fn forward(state: &AppState, body: &SubmissionRequest) -> RailAnswer {
    let url = format!("{}/submit", state.config.rail_url.trim_end_matches('/'));
    let request = json!({
        "clientRef": body.payout_id.to_string(),
        "amountMinor": body.amount_minor,
        "currency": body.currency,
    });
    // The hop to the rail is a span of its own: the last link of the payout's trace.
    let span = tracing::info_span!(
        "rail submit",
        otel.kind = "client",
        payout.id = %body.payout_id,
    );
    let traceparent = span.in_scope(|| dlock_contract::trace::outgoing_traceparent(None));
    let mut forward = state
        .rail
        .post(&url)
        .json(&request)
        .header(dlock_contract::headers::TRACEPARENT, traceparent);
    if let Some(credential) = &state.config.rail_credential {
        forward = forward.header(axum::http::header::AUTHORIZATION, credential.header_value());
    }
    let response = match tracing::Instrument::instrument(forward.send(), span).await {
        Ok(r) => r,
        // Even a refused connection is treated as unknown: proving that nothing was presented
        // is the rail's business, and a wrong guess here pays twice.
        Err(e) if e.is_timeout() => {
            return Unknown::answer("the rail did not answer within the read timeout", e);
        }
        Err(e) if e.is_connect() => {
            return Unknown::answer("the connection to the rail failed", e);
        }
        Err(e) => return Unknown::answer("the request to the rail failed without an answer", e),
    };
    let status = response.status();
    match response.bytes().await {
        Ok(bytes) => read_answer(status, &bytes, &url),
        Err(e) => Unknown::answer("the rail's answer broke off", e),
    }
}

/// What the rail's status and body mean: only 200 with an acknowledgement is ACKED and only 402
/// is REJECTED; anything else is an outcome we cannot read.
fn read_answer(status: reqwest::StatusCode, bytes: &[u8], url: &str) -> RailAnswer {
    match status.as_u16() {
        200 => match serde_json::from_slice::<RailAck>(bytes) {
            Ok(ack) if !ack.rail_reference.is_empty() && ack.rail_reference.len() <= 128 => {
                RailAnswer::Acked(ack.rail_reference)
            }
            _ => Unknown::answer(
                "the rail's acknowledgement was malformed",
                format!(
                    "HTTP 200 with {} bytes that are not an acknowledgement",
                    bytes.len()
                ),
            ),
        },
        402 => RailAnswer::Rejected("the rail declined the transfer".into()),
        300..=399 => Unknown::answer(
            "the rail answered with a redirect, which is not followed; the transfer may have been taken",
            format!("HTTP {status} towards {url}"),
        ),
        500..=599 => Unknown::answer(
            "the rail answered with a server error",
            format!("HTTP {status} towards {url}"),
        ),
        _ => Unknown::answer(
            "the rail answered with a status it does not document",
            format!("HTTP {status} towards {url}"),
        ),
    }
}
