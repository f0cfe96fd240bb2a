//! Requests as raw HTTP, for the tests that must see exactly what went over the wire: an
//! answer's status, content type and JSON body.

/// A raw HTTP request; a body that is not JSON fails the test.
pub async fn raw(
    method: reqwest::Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, String, serde_json::Value) {
    let http = dlock_contract::client::http_client().unwrap_or_else(|e| panic!("{e}"));
    let mut request = http.request(method, url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(body) = body {
        request = request.body(body.to_owned());
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await.unwrap_or_default();
    let json = if text.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{url}: body is not JSON ({e}): {text}"))
    };
    (status, content_type, json)
}

/// A JSON `POST` of `body` to `url` with `headers` besides its content type, as [`raw`] sends it.
pub async fn post_json(
    url: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> (u16, String, serde_json::Value) {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    raw(reqwest::Method::POST, url, &all, Some(&body.to_string())).await
}
