//! Tables of HTTP steps and the one runner that drives them (the conformance and bad-input
//! suites). A step is a request, the answer it must get (status, error code, the fields the
//! error names, values in the body) and what it saves for later steps; every answer must also
//! be `application/json; charset=utf-8`, and every error the contract's envelope.
//!
//! Paths, header values and JSON bodies may name what an earlier step saved as `$name`: in text
//! the value is spliced in; a JSON string that is exactly `"$name"` becomes the saved value
//! itself (a number stays a number).

use std::collections::HashMap;

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::raw;

const RETRY_AFTER_CODES: [&str; 4] = [
    "LOCK_CONTENDED",
    "CONTENTION_EXCEEDED",
    "NOT_LEADER",
    "RAIL_UNAVAILABLE",
];
const RETRY_SAFE_CODES: [&str; 4] = RETRY_AFTER_CODES;

/// Checks the envelope of an error body against the catalogue.
pub fn assert_envelope(step: &str, status: u16, body: &Value, code: &str) {
    assert_eq!(body["code"], json!(code), "{step}: code, body {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{step}: message"
    );
    assert_eq!(
        body["retrySafe"],
        json!(RETRY_SAFE_CODES.contains(&code)),
        "{step}: retrySafe"
    );
    assert_eq!(
        body.get("retryAfterMillis").is_some(),
        RETRY_AFTER_CODES.contains(&code),
        "{step}: retryAfterMillis presence"
    );
    let trace = body["traceId"].as_str().unwrap_or_default();
    assert!(
        trace.len() == 32 && trace.bytes().all(|b| b.is_ascii_hexdigit()),
        "{step}: traceId {trace}"
    );
    assert!(status >= 400, "{step}");
}

/// Replaces what legitimately differs between runs and backends.
pub fn normalise(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = match k.as_str() {
                        "traceId" => json!("<trace>"),
                        "fencingToken" | "revokedToken" | "newTokenFloor" | "storedToken"
                        | "presentedToken" | "highestToken"
                            if v.is_number() =>
                        {
                            json!("<token>")
                        }
                        "retryAfterMillis" => json!("<ms>"),
                        _ => normalise(v),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(normalise).collect()),
        Value::String(s) if uuid::Uuid::parse_str(s).is_ok() => json!("<uuid>"),
        Value::String(s) if chrono::DateTime::parse_from_rfc3339(s).is_ok() => {
            assert!(
                s.ends_with('Z') && s.len() == 24,
                "not RFC 3339 UTC with ms: {s}"
            );
            json!("<time>")
        }
        other => other.clone(),
    }
}

/// The milliseconds from the timestamp at `from` to the one at `to` (JSON pointers).
pub fn millis_between(v: &Value, from: &str, to: &str) -> i64 {
    let parse = |f: &str| {
        let text = v.pointer(f).and_then(Value::as_str).unwrap_or_default();
        chrono::DateTime::parse_from_rfc3339(text).unwrap_or_else(|e| panic!("{f}: {e} in {v}"))
    };
    (parse(to) - parse(from)).num_milliseconds()
}

/// What a body must hold; pointers are JSON pointers (`/details/storedToken`).
pub enum Check {
    /// The value at the pointer is this one.
    Eq(&'static str, Value),
    /// The value at the pointer is what `$name` saved.
    Saved(&'static str, &'static str),
    /// The integer at the pointer is greater than the saved integer `$name`.
    Above(&'static str, &'static str),
    /// The integer at the pointer is greater than this one.
    Gt(&'static str, i64),
    /// The array at the pointer has this many items.
    Len(&'static str, usize),
    /// `to - from` (timestamps at two pointers) is exactly this many milliseconds.
    Span(&'static str, &'static str, i64),
    /// `to - from` is at least this many milliseconds.
    SpanAtLeast(&'static str, &'static str, i64),
}

/// One row of a table.
pub struct Step {
    pub name: String,
    method: Method,
    path: String,
    headers: Vec<(String, String)>,
    body: Option<String>,
    json_body: Option<Value>,
    status: u16,
    code: Option<&'static str>,
    field: Option<&'static str>,
    checks: Vec<(Check, &'static str)>,
    saves: Vec<(&'static str, &'static str)>,
}

/// A step: `method path`, expected to answer 200 unless told otherwise.
pub fn step(name: impl Into<String>, method: Method, path: impl Into<String>) -> Step {
    Step {
        name: name.into(),
        method,
        path: path.into(),
        headers: Vec::new(),
        body: None,
        json_body: None,
        status: 200,
        code: None,
        field: None,
        checks: Vec::new(),
        saves: Vec::new(),
    }
}

pub fn get(name: impl Into<String>, path: impl Into<String>) -> Step {
    step(name, Method::GET, path)
}

pub fn post(name: impl Into<String>, path: impl Into<String>) -> Step {
    step(name, Method::POST, path)
}

pub fn delete(name: impl Into<String>, path: impl Into<String>) -> Step {
    step(name, Method::DELETE, path)
}

impl Step {
    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    pub fn headers(mut self, headers: &[(&str, &str)]) -> Self {
        for (name, value) in headers {
            self = self.header(name, *value);
        }
        self
    }

    /// `X-Owner-Id`.
    pub fn owner(self, owner: &str) -> Self {
        self.header("x-owner-id", owner)
    }

    /// `X-Fencing-Token` (usually `$name` of a saved token).
    pub fn token(self, token: &str) -> Self {
        self.header("x-fencing-token", token)
    }

    /// A JSON body, sent with `Content-Type: application/json` after the other headers.
    pub fn json(mut self, body: Value) -> Self {
        self.json_body = Some(body);
        self
    }

    /// A JSON body naming only the session: `{"sessionId": session}` (usually `$name`).
    pub fn session(self, session: &str) -> Self {
        self.json(json!({ "sessionId": session }))
    }

    /// A body sent exactly as written, with only the headers given.
    pub fn raw(mut self, body: impl Into<String>) -> Self {
        self.body = Some(body.into());
        self
    }

    /// The success status expected (200 by default).
    pub fn answers(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    /// The error expected: its status and code (the envelope is checked too).
    pub fn fails(mut self, status: u16, code: &'static str) -> Self {
        self.status = status;
        self.code = Some(code);
        self
    }

    /// The error's `details.fields` must name `field`.
    pub fn naming(mut self, field: &'static str) -> Self {
        self.field = Some(field);
        self
    }

    /// Something the body must hold, and why (the message when it does not).
    pub fn check(mut self, check: Check, why: &'static str) -> Self {
        self.checks.push((check, why));
        self
    }

    /// `body[pointer] == value`.
    pub fn has(self, pointer: &'static str, value: impl Into<Value>) -> Self {
        self.check(Check::Eq(pointer, value.into()), "")
    }

    /// `body[pointer]` is the value saved as `$name`.
    pub fn has_saved(self, pointer: &'static str, name: &'static str) -> Self {
        self.check(Check::Saved(pointer, name), "")
    }

    /// `body[pointer]` is above the number saved as `$name`, and why it must be.
    pub fn above(self, pointer: &'static str, name: &'static str, why: &'static str) -> Self {
        self.check(Check::Above(pointer, name), why)
    }

    /// Saves the value at `pointer` as `$name` for the steps after.
    pub fn save(mut self, name: &'static str, pointer: &'static str) -> Self {
        self.saves.push((name, pointer));
        self
    }
}

/// Drives steps against one server, keeping what they saved and a transcript of the answers
/// (normalised: ids, tokens and times replaced) to compare runs.
pub struct Runner {
    url: String,
    label: String,
    vars: HashMap<String, Value>,
    pub transcript: Vec<(String, u16, Value)>,
}

impl Runner {
    /// `label` starts every failure message (the backend, say).
    pub fn new(url: &str, label: impl Into<String>) -> Self {
        Self {
            url: url.to_owned(),
            label: label.into(),
            vars: HashMap::new(),
            transcript: Vec::new(),
        }
    }

    pub fn set(&mut self, name: &str, value: Value) {
        self.vars.insert(name.to_owned(), value);
    }

    pub fn var(&self, name: &str) -> &Value {
        self.vars
            .get(name)
            .unwrap_or_else(|| panic!("{}: nothing saved as ${name}", self.label))
    }

    pub fn int(&self, name: &str) -> i64 {
        self.var(name)
            .as_i64()
            .unwrap_or_else(|| panic!("${name} is not an integer: {}", self.var(name)))
    }

    /// `text` with every `$name` replaced by what was saved under it.
    fn splice(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let tail = &rest[at + 1..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            match self.var(&tail[..end]) {
                Value::String(s) => out.push_str(s),
                other => out.push_str(&other.to_string()),
            }
            rest = &tail[end..];
        }
        out.push_str(rest);
        out
    }

    fn splice_json(&self, value: &Value) -> Value {
        match value {
            Value::String(s) => match s.strip_prefix('$') {
                Some(name) if self.vars.contains_key(name) => self.var(name).clone(),
                _ => Value::String(self.splice(s)),
            },
            Value::Array(items) => {
                Value::Array(items.iter().map(|v| self.splice_json(v)).collect())
            }
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| (k.clone(), self.splice_json(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// Runs one step: the request, then every expectation; records the answer and saves what
    /// the step saves. Returns the body.
    pub async fn run(&mut self, step: &Step) -> Value {
        let mut headers: Vec<(String, String)> = step
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), self.splice(v)))
            .collect();
        let mut body = step.body.clone();
        if let Some(json) = &step.json_body {
            headers.push(("content-type".into(), "application/json".into()));
            body = Some(self.splice_json(json).to_string());
        }
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let url = format!("{}{}", self.url, self.splice(&step.path));
        let (got, content_type, json) =
            raw(step.method.clone(), &url, &pairs, body.as_deref()).await;
        let name = format!("{} {}: {:?}", self.label, step.name, step.headers);
        assert_eq!(got, step.status, "{name}: status, body {json}");
        assert_eq!(
            content_type, "application/json; charset=utf-8",
            "{name}: content type"
        );
        if let Some(code) = step.code {
            assert_envelope(&name, got, &json, code);
        }
        if let Some(field) = step.field {
            let fields: Vec<&str> = json["details"]["fields"]
                .as_array()
                .map(|a| a.iter().filter_map(|f| f["field"].as_str()).collect())
                .unwrap_or_default();
            assert!(
                fields.contains(&field),
                "{name}: details.fields {fields:?} should name {field}"
            );
        }
        for (check, why) in &step.checks {
            self.assert(&name, &json, check, why);
        }
        for (var, pointer) in &step.saves {
            let value = json
                .pointer(pointer)
                .unwrap_or_else(|| panic!("{name}: no {pointer} to save in {json}"))
                .clone();
            self.vars.insert((*var).to_owned(), value);
        }
        self.transcript
            .push((step.name.clone(), got, normalise(&json)));
        json
    }

    /// Runs the steps in order.
    pub async fn run_all(&mut self, steps: &[Step]) {
        for step in steps {
            self.run(step).await;
        }
    }

    /// Runs `steps`, none of which may change what `snapshot` reads; then `control`, which
    /// must: the positive control that shows the same snapshot would have seen a change.
    pub async fn run_changing_nothing<F, Fut>(
        &mut self,
        steps: &[Step],
        control: &Step,
        snapshot: F,
    ) where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = String>,
    {
        let before = snapshot().await;
        self.run_all(steps).await;
        let after = snapshot().await;
        assert_eq!(before, after, "{}: a step changed the store", self.label);
        self.run(control).await;
        let changed = snapshot().await;
        assert_ne!(
            after, changed,
            "{}: {} changed nothing the snapshot reads, so it cannot tell either",
            self.label, control.name
        );
    }

    fn assert(&self, name: &str, body: &Value, check: &Check, why: &str) {
        let at = |pointer: &str| body.pointer(pointer).cloned().unwrap_or(Value::Null);
        let int = |pointer: &str| {
            at(pointer)
                .as_i64()
                .unwrap_or_else(|| panic!("{name}: {pointer} is not an integer in {body}"))
        };
        match check {
            Check::Eq(pointer, value) => {
                assert_eq!(&at(pointer), value, "{name}: {pointer} {why}, body {body}");
            }
            Check::Saved(pointer, var) => {
                assert_eq!(
                    &at(pointer),
                    self.var(var),
                    "{name}: {pointer} is ${var} {why}, body {body}"
                );
            }
            Check::Above(pointer, var) => {
                let floor = self.int(var);
                assert!(
                    int(pointer) > floor,
                    "{name}: {pointer} above ${var} ({floor}) {why}, body {body}"
                );
            }
            Check::Gt(pointer, floor) => {
                assert!(
                    int(pointer) > *floor,
                    "{name}: {pointer} above {floor} {why}, body {body}"
                );
            }
            Check::Len(pointer, n) => {
                assert_eq!(
                    at(pointer).as_array().map(Vec::len),
                    Some(*n),
                    "{name}: {pointer} has {n} items {why}, body {body}"
                );
            }
            Check::Span(from, to, ms) => {
                assert_eq!(
                    millis_between(body, from, to),
                    *ms,
                    "{name}: {from} to {to} {why}"
                );
            }
            Check::SpanAtLeast(from, to, ms) => {
                assert!(
                    millis_between(body, from, to) >= *ms,
                    "{name}: {from} to {to} at least {ms} ms {why}"
                );
            }
        }
    }
}
