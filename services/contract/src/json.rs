//! A JSON body extractor whose every rejection is the contract's envelope: an unparsable body,
//! a wrong type, an unknown or missing field, a non-JSON content type and an oversize body are
//! all `400 VALIDATION_FAILED` with `details.fields[]` naming what is at fault.

use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, FieldError};

#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

/// Turns a serde error at `path` into the field it names.
fn field_error(path: &serde_path_to_error::Path, error: &serde_json::Error) -> FieldError {
    let message = error.to_string();
    // serde reports a missing field against the enclosing object; name the field itself.
    let quoted = message
        .split('`')
        .nth(1)
        .filter(|_| message.starts_with("missing field"));
    let mut field = path.to_string();
    if field == "." || field == "?" {
        field.clear();
    }
    if let Some(name) = quoted {
        if !field.is_empty() {
            field.push('.');
        }
        field.push_str(name);
    }
    if field.is_empty() {
        field = "body".to_owned();
    }
    // Drop serde's " at line 1 column 17" suffix: the field path already says where.
    let reason = match message.rfind(" at line ") {
        Some(at) => message[..at].to_owned(),
        None => message,
    };
    FieldError::new(field, reason)
}

/// Parses a JSON body. An empty body reads as `{}`, so a request whose fields are all optional
/// may be sent without one.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        bytes
    };
    // Every body of the contract is an object; serde would otherwise read `[]` as a struct.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::field("body", "must be a JSON object"));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut deserializer)
        .map_err(|e| ApiError::validation(vec![field_error(e.path(), e.inner())]))?;
    deserializer
        .end()
        .map_err(|_| ApiError::field("body", "trailing characters after the JSON value"))?;
    Ok(value)
}

impl<S, T> FromRequest<S> for Json<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        if let Some(content_type) = request.headers().get(header::CONTENT_TYPE) {
            let ok = content_type
                .to_str()
                .ok()
                .and_then(|v| v.split(';').next())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
            if !ok {
                return Err(ApiError::field(
                    "Content-Type",
                    "must be application/json; charset=utf-8",
                ));
            }
        }
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::field("body", "is larger than this service accepts")
                } else {
                    crate::http::envelope_for(rejection.status(), &rejection.body_text(), None, 0)
                }
            })?;
        parse_body(&bytes).map(Json)
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        crate::http::json_response(StatusCode::OK, &self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    #[allow(dead_code)]
    struct Body {
        ttl_millis: i64,
        inner: Option<Inner>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        n: u8,
    }

    fn fields(body: &str) -> Vec<String> {
        match parse_body::<Body>(body.as_bytes()) {
            Ok(_) => vec![],
            Err(e) => e
                .details
                .and_then(|d| serde_json::from_value::<Vec<FieldError>>(d["fields"].clone()).ok())
                .unwrap_or_default()
                .into_iter()
                .map(|f| f.field)
                .collect(),
        }
    }

    #[test]
    fn each_rejection_names_its_field() {
        assert_eq!(fields(r#"{"ttlMillis": 5}"#), Vec::<String>::new());
        assert_eq!(fields(r#"{"ttlMillis": "5"}"#), vec!["ttlMillis"]);
        assert_eq!(fields(r#"{"ttlMillis": 1.5}"#), vec!["ttlMillis"]);
        assert_eq!(fields(r#"{}"#), vec!["ttlMillis"]);
        assert_eq!(fields(""), vec!["ttlMillis"]);
        assert_eq!(fields(r#"{"ttlMillis": 5, "extra": 1}"#), vec!["extra"]);
        assert_eq!(
            fields(r#"{"ttlMillis": 5, "inner": {"n": 300}}"#),
            vec!["inner.n"]
        );
        assert_eq!(
            fields(r#"{"ttlMillis": 5, "inner": {"m": 3}}"#),
            vec!["inner.m"]
        );
        assert_eq!(fields("{not json"), vec!["body"]);
        assert_eq!(fields(r#"{"ttlMillis": 5} x"#), vec!["body"]);
        assert_eq!(fields("[]"), vec!["body"]);
    }
}
