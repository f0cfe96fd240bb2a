//! The arguments of a write on the resource its path names (an account, a payout, a lock key,
//! a rail account): who makes it, the path's one parameter, the headers and the contract's JSON
//! body. They are extracted as the separate extractors would be, in the same order, so a bad
//! path is answered before a bad body and every rejection is the one that extractor gives.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use dlock_contract::json::Json;
use serde::de::DeserializeOwned;

/// A write of a `B` body on the resource its path names, made by `By`: the
/// [`Caller`](crate::auth::Caller) of an operator write, whom the handler asks with its
/// operation's name, or `()` for a write anyone authenticated may make.
pub struct PathWrite<B, By = ()>(pub By, pub String, pub HeaderMap, pub B);

impl<S, B, By> FromRequest<S> for PathWrite<B, By>
where
    S: Send + Sync,
    B: DeserializeOwned,
    By: FromRequestParts<S> + Send,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (mut parts, body) = request.into_parts();
        let by = By::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let Path(id) = Path::<String>::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let headers = parts.headers.clone();
        let Json(body) = Json::<B>::from_request(Request::from_parts(parts, body), state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self(by, id, headers, body))
    }
}
