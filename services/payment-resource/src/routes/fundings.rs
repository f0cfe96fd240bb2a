//! `GET /v1/fundings` (docs/contract.md#list-fundings): the fundings that wait for a second
//! treasury identity, so the approver finds the id without being told it out of band; also the
//! approved ones, with who approved them. A treasury read: it writes nothing.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use dlock_contract::error::{ApiError, ErrorBody, ErrorCode, FieldError};
use dlock_contract::http::json_response;
use dlock_contract::payment::{FundingList, FundingsFilter};
use dlock_server::auth::Caller;
use dlock_server::openapi::{Invalid, NotLeader};
use serde::Deserialize;

use super::AppState;
use super::checks::{Checks, present};
use super::cursor::query_error;
use super::errors::store_error;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct FundingsQuery {
    state: Option<String>,
    limit: Option<String>,
}

impl FundingsQuery {
    /// Both fields checked; one answer names every field at fault.
    fn check(self) -> Result<(FundingsFilter, i64), ApiError> {
        let mut checks = Checks::default();
        let filter = match &self.state {
            None => Some(FundingsFilter::Pending),
            Some(text) => checks.take(FundingsFilter::parse(text).ok_or_else(|| {
                FieldError::new(
                    "state",
                    "must be one of pending (the default), applied, all",
                )
            })),
        };
        let limit = super::cursor::list_limit(&mut checks, self.limit.as_deref());
        checks.done()?;
        Ok((present(filter)?, present(limit)?))
    }
}

/// Lists the fundings that wait for a second treasury identity, or were approved by one
/// (treasury; a read, docs/contract.md#list-fundings), newest request first.
#[utoipa::path(get, path = "/v1/fundings",
    params(("state" = Option<FundingsFilter>, Query, description = "pending (the default), applied or all"),
           ("limit" = Option<i64>, Query, description = "1 to 500, default 100")),
    responses((status = 200, body = FundingList), Invalid, NotLeader,
        (status = 401, description = "UNAUTHENTICATED", body = ErrorBody),
        (status = 403, description = "FORBIDDEN: not a treasury identity", body = ErrorBody),
    ))]
// `GET /v1/fundings?state=pending|applied|all&limit=N`: treasury only (403 FORBIDDEN for any
// other role, before the query is looked at).
pub(super) async fn list_fundings(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<FundingsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    const WHAT: &str = "listing the fundings that wait for a second treasury identity";
    caller.require_treasury(WHAT).map_err(|error| {
        if error.code != ErrorCode::Forbidden {
            return error;
        }
        // require_treasury's own text speaks of creating money; this is a read.
        let name = caller.identity().map_or("", |i| i.name.as_str());
        ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "{WHAT} is a treasury read and `{name}` is not a treasury identity \
                 (auth.treasury-identities)"
            ),
        )
    })?;
    let Query(query) = query.map_err(query_error)?;
    let (filter, limit) = query.check()?;
    let mut items = state
        .store
        .list_fundings(filter, limit)
        .await
        .map_err(store_error)?;
    let truncated = items.len() as i64 > limit;
    items.truncate(limit as usize);
    Ok(json_response(
        StatusCode::OK,
        &FundingList { items, truncated },
    ))
}
