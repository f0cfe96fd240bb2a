//! Batch endpoints on the service side (docs/contract.md#batches).
//!
//! `POST <Item::PATH>` takes a [`BatchRequest`] of one step's items. The batch request passes the
//! credential check once, with the roles of its step (the one table,
//! [`crate::auth::roles::WRITES`]); then each item becomes the single request it stands for
//! ([`Item::single`]: fixed method, the step's own path with each parameter percent-encoded, so
//! an item can reach no other route) and runs through the service's own routes, with the batch
//! request's headers and what the credential check found, concurrently with its neighbours. Each
//! item's answer is what that route answered, so the single endpoint's decisions, idempotency and
//! group commit apply to it unchanged. A body that is not a batch of this step, or holds no item
//! or more than [`MAX_ITEMS`], is `400 VALIDATION_FAILED` and nothing runs.

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use dlock_contract::batch::{BatchAnswer, BatchRequest, Item, ItemAnswer, MAX_ITEMS};
use dlock_contract::error::{ApiError, FieldError};
use dlock_contract::headers;
use dlock_contract::http::json_response;
use tower::ServiceExt;

/// Adds one step's batch route to `routes`; items run through `singles`.
pub type Route = fn(Router, Router) -> Router;

/// The batch route of items `I` (a [`Route`]).
pub fn route<I: Item>(routes: Router, singles: Router) -> Router {
    routes.route(
        I::PATH,
        axum::routing::post(move |request: Request| handle::<I>(singles.clone(), request)),
    )
}

/// The largest answer body one item may have; the services' answers are a few hundred bytes.
const ITEM_ANSWER_BYTES_MAX: usize = 1024 * 1024;

/// The headers an item sets itself; the batch request's own are never passed on.
const ITEM_HEADERS: [&str; 4] = [
    headers::FENCING_TOKEN,
    headers::FENCING_PROOF,
    headers::IDEMPOTENCY_KEY,
    headers::TRACEPARENT,
];

async fn handle<I: Item>(singles: Router, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let mut body_request = Request::new(body);
    *body_request.headers_mut() = parts.headers.clone();
    // The body limit (`server.body-limit-bytes`) travels as an extension.
    *body_request.extensions_mut() = parts.extensions.clone();
    let batch = match <dlock_contract::Json<BatchRequest<I>> as axum::extract::FromRequest<()>>::from_request(
        body_request,
        &(),
    )
    .await
    {
        Ok(dlock_contract::Json(batch)) => batch,
        Err(error) => return error.into_response(),
    };
    if batch.items.is_empty() || batch.items.len() > MAX_ITEMS {
        return ApiError::field(
            "items",
            format!(
                "must hold 1 to {MAX_ITEMS} items, holds {}; split the batch",
                batch.items.len()
            ),
        )
        .into_response();
    }
    let answers = futures::future::join_all(
        batch
            .items
            .iter()
            .map(|item| run_one(&singles, &parts, item)),
    )
    .await;
    json_response(axum::http::StatusCode::OK, &BatchAnswer { items: answers })
}

/// Runs one item as its single request and reads the answer.
async fn run_one<I: Item>(
    singles: &Router,
    batch: &axum::http::request::Parts,
    item: &I,
) -> ItemAnswer {
    let single = item.single();
    let response = match single_request(batch, single) {
        Ok(request) => match singles.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        Err(error) => error.into_response(),
    };
    let status = response.status().as_u16();
    let body = match axum::body::to_bytes(response.into_body(), ITEM_ANSWER_BYTES_MAX).await {
        Ok(bytes) if bytes.is_empty() => None,
        Ok(bytes) => {
            Some(serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                serde_json::Value::String(String::from_utf8_lossy(&bytes).into())
            }))
        }
        Err(error) => {
            tracing::error!(event = "batch_item_answer_unreadable", single = I::SINGLE, %error, "an item's answer could not be read; its outcome is unknown");
            return ItemAnswer {
                status: 500,
                body: serde_json::to_value(
                    ApiError::new(
                        dlock_contract::ErrorCode::Internal,
                        "the item's answer could not be read; its outcome is unknown, read the state before acting",
                    )
                    .body(),
                )
                .ok(),
            };
        }
    };
    ItemAnswer { status, body }
}

/// The single request `single` stands for, with the batch request's headers (but the item's
/// own) and everything the credential check attached to the batch request.
fn single_request(
    batch: &axum::http::request::Parts,
    single: dlock_contract::batch::Single,
) -> Result<Request, ApiError> {
    let body = serde_json::to_vec(&single.body).map_err(|e| {
        ApiError::new(
            dlock_contract::ErrorCode::Internal,
            format!("the item's body could not be written: {e}"),
        )
    })?;
    let mut request = Request::builder()
        .method(single.method)
        .uri(&single.path)
        .body(Body::from(body))
        .map_err(|e| ApiError::field("items", format!("does not make a request: {e}")))?;
    let headers = request.headers_mut();
    for (name, value) in &batch.headers {
        if name != header::CONTENT_LENGTH && !ITEM_HEADERS.contains(&name.as_str()) {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(dlock_contract::http::JSON_CONTENT_TYPE),
    );
    for (name, value) in single.headers {
        let value = HeaderValue::from_str(&value).map_err(|_| {
            ApiError::validation(vec![FieldError::new(
                item_field(name),
                "holds a character a header cannot carry",
            )])
        })?;
        headers.insert(HeaderName::from_static(name), value);
    }
    let extensions = request.extensions_mut();
    *extensions = batch.extensions.clone();
    // The route the batch request matched is not the item's: left in place, the router would
    // name the item `POST /v1/batches/claim/v1/payouts/{payout_id}/claim` in its span and
    // envelope.
    extensions.remove::<axum::extract::MatchedPath>();
    Ok(request)
}

/// The item's field that becomes header `name`.
fn item_field(name: &str) -> &'static str {
    match name {
        headers::FENCING_TOKEN => "fencingToken",
        headers::FENCING_PROOF => "fencingProof",
        headers::IDEMPOTENCY_KEY => "idempotencyKey",
        _ => "traceparent",
    }
}
