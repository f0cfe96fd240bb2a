//! The error answers the services' OpenAPI documents share, each with the contract's status and
//! envelope (docs/contract.md#error-envelope). An operation names the sets it may answer in its
//! `responses(...)`, after its success; a tuple listed after a set replaces that set's entry for
//! its status (a more precise description).

use dlock_contract::batch::Item;
use dlock_contract::error::ErrorBody;
use utoipa::{IntoParams, IntoResponses, Modify};

/// 400: the request failed validation.
#[derive(IntoResponses)]
pub enum Invalid {
    #[response(status = 400, description = "VALIDATION_FAILED")]
    ValidationFailed(ErrorBody),
}

/// 400 on a fenced call: the token header, or anything else, failed validation.
#[derive(IntoResponses)]
pub enum InvalidToken {
    #[response(status = 400, description = "INVALID_TOKEN or VALIDATION_FAILED")]
    InvalidToken(ErrorBody),
}

/// 401 and 403: an authenticated write.
#[derive(IntoResponses)]
pub enum Unauthorized {
    #[response(status = 401, description = "UNAUTHENTICATED")]
    Unauthenticated(ErrorBody),
    #[response(status = 403, description = "FORBIDDEN")]
    Forbidden(ErrorBody),
}

/// 404: nothing by that name.
#[derive(IntoResponses)]
pub enum NotFound {
    #[response(status = 404, description = "NOT_FOUND")]
    NotFound(ErrorBody),
}

/// 422 and 429: a write under `X-Idempotency-Key`.
#[derive(IntoResponses)]
pub enum Idempotent {
    #[response(status = 422, description = "IDEMPOTENCY_CONFLICT")]
    IdempotencyConflict(ErrorBody),
    #[response(
        status = 429,
        description = "CONTENTION_EXCEEDED: an identical request still holds the idempotency record; retry after retryAfterMillis"
    )]
    ContentionExceeded(ErrorBody),
}

/// 503: the database or cluster behind the service takes no writes here.
#[derive(IntoResponses)]
pub enum NotLeader {
    #[response(status = 503, description = "NOT_LEADER")]
    NotLeader(ErrorBody),
}

/// 503 from the rail proxy: paydb or the rail is not available.
#[derive(IntoResponses)]
pub enum RailUnavailable {
    #[response(status = 503, description = "RAIL_UNAVAILABLE")]
    RailUnavailable(ErrorBody),
}

/// The headers of a docs/design.md#d-8 recovery (a fence or high-water lowering), after its path
/// and before the service's write headers: the operator's proven grant on the account's lock key.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
pub struct RecoveryParams {
    /// the operator's grant on payout:{accountId}
    #[param(rename = "X-Fencing-Token")]
    pub fencing_token: String,
    /// that grant's fencingProof
    #[param(rename = "X-Fencing-Proof")]
    pub fencing_proof: String,
}

/// 403 of a recovery ([`crate::proof::recovery_grant`]), listed after [`Unauthorized`]: its
/// FORBIDDEN names the second cause, a service without proof keys.
#[derive(IntoResponses)]
pub enum RecoveryForbidden {
    #[response(
        status = 403,
        description = "FORBIDDEN (not an operator, or no proof keys)"
    )]
    Forbidden(ErrorBody),
}

/// A service's batch endpoints (docs/contract.md#batches): the routes it serves them on
/// ([`BatchEndpoints::routes`]) and what each documents the same way in every service:
/// `X-Owner-Id` for every item and its refusals of the whole batch (400, 401, 403, 503), each
/// naming the step it batches (the 401 makes [`published`] name the `bearerAuth` security). Listed in the document's `modifiers`;
/// the operation itself (`#[utoipa::path]` with the items' [`Item::PATH`]) declares its request
/// body and its 200.
pub struct BatchEndpoints(pub &'static [BatchEndpoint]);

impl BatchEndpoints {
    /// The batch routes, one per endpoint, that [`crate::http::service`] adds.
    pub fn routes(&self) -> Vec<crate::batch::Route> {
        self.0.iter().map(|endpoint| endpoint.route).collect()
    }
}

/// One batch endpoint, its route and the words its refusals name it with.
pub struct BatchEndpoint {
    path: &'static str,
    route: crate::batch::Route,
    items: &'static str,
    roles: &'static str,
    unavailable: &'static str,
}

impl BatchEndpoint {
    /// The batch of items `I`, served at [`Item::PATH`]: it batches `items` (`"acquires"`),
    /// needs `roles` (`"L4's"`); `unavailable` says what an item the service cannot write
    /// answers (the end of the 503's description).
    pub const fn new<I: Item>(
        items: &'static str,
        roles: &'static str,
        unavailable: &'static str,
    ) -> Self {
        Self {
            path: I::PATH,
            route: crate::batch::route::<I>,
            items,
            roles,
            unavailable,
        }
    }

    fn refusals(&self) -> [(&'static str, String); 4] {
        let (items, roles) = (self.items, self.roles);
        [
            (
                "400",
                format!(
                    "VALIDATION_FAILED: the body is not a batch of {items} (an unknown field, a \
                     missing one, a wrong type), or holds no item or more than 64; nothing ran"
                ),
            ),
            ("401", "UNAUTHENTICATED".to_owned()),
            (
                "403",
                format!(
                    "FORBIDDEN: the identity holds none of {roles} roles, or X-Owner-Id does not \
                     belong to it; nothing ran"
                ),
            ),
            (
                "503",
                format!(
                    "AUTH_UNAVAILABLE: the credential could not be checked; {}",
                    self.unavailable
                ),
            ),
        ]
    }
}

impl Modify for BatchEndpoints {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::path::{ParameterBuilder, ParameterIn};
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        use utoipa::openapi::{Content, Ref, Required, ResponseBuilder};

        for endpoint in self.0 {
            let Some(operation) = openapi
                .paths
                .paths
                .get_mut(endpoint.path)
                .and_then(|item| item.post.as_mut())
            else {
                continue;
            };
            let owner = ParameterBuilder::new()
                .name("X-Owner-Id")
                .parameter_in(ParameterIn::Header)
                .description(Some("owner id, ≤64 chars, for every item"))
                .required(Required::True)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .build();
            operation
                .parameters
                .get_or_insert_with(Vec::new)
                .insert(0, owner);
            for (status, description) in endpoint.refusals() {
                let response = ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        Content::new(Some(Ref::from_schema_name("ErrorBody"))),
                    )
                    .build();
                operation
                    .responses
                    .responses
                    .insert(status.to_owned(), response.into());
            }
        }
    }
}

/// The document a service publishes, from the operations of the routes it serves
/// (`utoipa_axum::OpenApiRouter`), in the form of the documents under `docs/openapi/`:
///
/// - each route's path as the contract names it. A route names its path parameters in snake
///   case, as the router matches them and as the request spans name the route
///   (`POST /v1/payouts/{payout_id}/claim`); the contract names them in camel case
///   (`/v1/payouts/{payoutId}/claim`, docs/contract.md), like the operation's own `params`;
/// - every operation lists its tags, none (`"tags": []`), as an operation listed in an
///   `#[openapi(paths(...))]` does; a route's operation leaves the list out;
/// - in a document that declares the `bearerAuth` scheme, every operation that may answer `401`
///   names it as its security: the credential is what a `401` refuses, so the operation's
///   responses say once that it needs one.
pub fn published(mut document: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::openapi::security::SecurityRequirement;
    let bearer = document
        .components
        .as_ref()
        .is_some_and(|components| components.security_schemes.contains_key("bearerAuth"));
    let paths = std::mem::take(&mut document.paths.paths);
    document.paths.paths = paths
        .into_iter()
        .map(|(path, mut item)| {
            for operation in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ]
            .into_iter()
            .flatten()
            {
                operation.tags.get_or_insert_with(Vec::new);
                if bearer
                    && operation.security.is_none()
                    && operation.responses.responses.contains_key("401")
                {
                    operation.security = Some(vec![SecurityRequirement::new(
                        "bearerAuth",
                        Vec::<String>::new(),
                    )]);
                }
            }
            (contract_path(&path), item)
        })
        .collect();
    document
}

/// `path` with each `{snake_case}` parameter in camel case.
fn contract_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let (mut in_param, mut upper) = (false, false);
    for c in path.chars() {
        match c {
            '{' => in_param = true,
            '}' => in_param = false,
            '_' if in_param => {
                upper = true;
                continue;
            }
            _ if upper => {
                out.extend(c.to_uppercase());
                upper = false;
                continue;
            }
            _ => {}
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::contract_path;

    #[test]
    fn a_route_parameter_is_named_in_camel_case_and_nothing_else_changes() {
        assert_eq!(
            contract_path("/v1/payouts/{payout_id}/claim"),
            "/v1/payouts/{payoutId}/claim"
        );
        assert_eq!(
            contract_path("/v1/rail/high-water/{account_id}/lower"),
            "/v1/rail/high-water/{accountId}/lower"
        );
        assert_eq!(contract_path("/v1/locks/{key}"), "/v1/locks/{key}");
        assert_eq!(contract_path("/v1/rail_x/{a_b_c}"), "/v1/rail_x/{aBC}");
    }
}
