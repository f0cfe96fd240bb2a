//! What every service's OpenAPI document shares: the `bearerAuth` security scheme, the error
//! envelope and serving the document at `GET /v1/openapi.json` with the contract's content type.

use axum::http::StatusCode;
use axum::response::Response;
use utoipa::Modify;
use utoipa::openapi::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

/// The path every service serves its document at.
pub const PATH: &str = "/v1/openapi.json";

/// Adds the `bearerAuth` scheme (`Authorization: Bearer <token>`); the published document names it
/// on every operation that may answer `401` (`dlock_server::openapi::published`).
pub struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearerAuth",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as the JSON answer of `GET /v1/openapi.json`.
pub fn response(doc: &OpenApi) -> Response {
    crate::http::json_response(StatusCode::OK, doc)
}

/// The document as pretty JSON with a final newline, as committed under `docs/openapi/`.
pub fn pretty(doc: &OpenApi) -> String {
    let mut text = doc.to_pretty_json().unwrap_or_default();
    text.push('\n');
    text
}
