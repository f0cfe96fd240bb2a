//! The arguments of a write on the resource its path names (an account, a payout, a lock key,
//! a rail account): the path's one parameter, the headers and the contract's JSON body, and for
//! an operator write the caller before them. Each is extracted as the separate extractors would
//! be, in the same order, so a bad path is answered before a bad body and every rejection is
//! the one that extractor gives.

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use dlock_contract::json::Json;
use serde::de::DeserializeOwned;

use crate::auth::Caller;

/// A write on the resource its path names: the path's parameter, the headers and the body.
pub struct PathWrite<B>(pub String, pub HeaderMap, pub B);

impl<S, B> FromRequest<S> for PathWrite<B>
where
    S: Send + Sync,
    B: DeserializeOwned,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (mut parts, body) = request.into_parts();
        let Path(id) = Path::<String>::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let headers = parts.headers.clone();
        let Json(body) = Json::<B>::from_request(Request::from_parts(parts, body), state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self(id, headers, body))
    }
}

/// A [`PathWrite`] that only an operator may make: the caller, whom the handler asks with its
/// operation's name ([`Caller::operator`], [`Caller::require_operator`]), then the write.
pub struct OperatorWrite<B>(pub Caller, pub String, pub HeaderMap, pub B);

impl<S, B> FromRequest<S> for OperatorWrite<B>
where
    S: Send + Sync,
    B: DeserializeOwned,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (mut parts, body) = request.into_parts();
        let caller = Caller::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let PathWrite(id, headers, body) =
            PathWrite::from_request(Request::from_parts(parts, body), state).await?;
        Ok(Self(caller, id, headers, body))
    }
}
