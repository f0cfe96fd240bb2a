//! The history check's positive control (docs/testing.md#history-check): violations planted in
//! copies of a recorded history, each of which the checker must refuse, naming the key or the
//! planted call.

use super::*;

/// The client after the highest in `lines`: one that made none of its calls.
fn new_client(lines: &[Value]) -> u64 {
    lines
        .iter()
        .filter_map(|l| l["client"].as_u64())
        .max()
        .unwrap_or_default()
        + 1
}

/// An acquire of `l`'s key and session that the history shows in doubt (`unknown`).
fn in_doubt(lines: &[Value], l: &Value) -> bool {
    lines.iter().any(|o| {
        o["op"] == "acquire"
            && o["status"] == "unknown"
            && o["key"] == l["key"]
            && o["session"] == l["session"]
    })
}

/// The first `op` of `lines` that succeeded and of which `also` holds, with its index; panics
/// with `none` if there is none.
pub(super) fn first_ok<'a>(
    lines: &'a [Value],
    op: &str,
    also: impl Fn(&Value) -> bool,
    none: &str,
) -> (usize, &'a Value) {
    lines
        .iter()
        .enumerate()
        .find(|(_, l)| l["op"] == op && l["status"] == "ok" && also(l))
        .unwrap_or_else(|| panic!("{none}"))
}

/// The positive control for the global token order: a second session's acquire of the key of
/// `acquired` (line `n`), just after it, that gets `token`, written as `path`, must make the
/// checker exit 1 and name `token`, the `what`.
pub(super) fn planted_token_is_caught(
    path: &Path,
    lines: &[Value],
    (n, acquired): (usize, &Value),
    token: i64,
    what: &str,
) {
    let at = acquired["ret"].as_i64().unwrap_or_default();
    let mut planted = lines.to_vec();
    planted.insert(
        n + 1,
        json!({"client": new_client(lines), "op": "acquire", "key": acquired["key"],
               "session": "planted-session", "ttl_ms": GRANT_TTL_MS, "session_until": at + 10_000_000_000i64,
               "call": at + 1_000_000, "ret": at + 2_000_000, "status": "ok", "out": {"token": token}}),
    );
    write_lines(path, &planted);
    let (status, verdict) = check(path);
    assert_eq!(status, 1, "a {what} is caught: {verdict}");
    assert!(
        verdict.contains("violation on the global token order")
            && verdict.contains(&format!("token {token}")),
        "the checker names the {what} ({token}): {verdict}"
    );
}

/// The positive control: each planted violation makes the checker exit 1 and name the call.
pub(super) fn planted_violations_are_caught(dir: &Path, name: &str, lines: &[Value]) {
    // 1. A token given twice: a second session gets the token of an acquire, just after it.
    let acquired = first_ok(lines, "acquire", |_| true, "no acquire succeeded");
    planted_token_is_caught(
        &dir.join(format!("{name}.planted-token.jsonl")),
        lines,
        acquired,
        acquired.1["out"]["token"].as_i64().unwrap_or_default(),
        "token given twice",
    );

    // 2. A read that shows a released grant still held, just after the release, where no
    // acquire of that session on that key is in doubt.
    let (n, released) = first_ok(
        lines,
        "release",
        |l| !in_doubt(lines, l),
        "no release succeeded",
    );
    let at = released["ret"].as_i64().unwrap_or_default();
    let clients = new_client(lines);
    let mut planted = lines.to_vec();
    planted.insert(
        n + 1,
        json!({"client": clients, "op": "read", "key": released["key"],
               "call": at + 1_000_000, "ret": at + 2_000_000, "status": "ok",
               "out": {"held": true, "session": released["session"], "token": released["token"]}}),
    );
    let path = dir.join(format!("{name}.planted-read.jsonl"));
    write_lines(&path, &planted);
    let (status, verdict) = check(&path);
    let key = released["key"].as_str().unwrap_or_default();
    assert_eq!(status, 1, "a read of a released grant is caught: {verdict}");
    assert!(
        verdict.contains(&format!("violation on key {key}"))
            && verdict.contains(&format!("line {}, client {clients}: read", n + 2)),
        "the checker names the planted read (line {}): {verdict}",
        n + 2
    );

    // 3. An applied write answered as refused.
    applied_acquire_refused_is_caught(dir, &format!("{name}.planted-not-leader"), lines, i64::MIN);
}

/// The positive control for a refusal: the first acquire called at `after` or later whose
/// session then renews or releases the grant, made "503 NOT_LEADER, nothing was changed" (what
/// the lock server once answered when its store's answer was lost after the write), written as
/// `{name}.jsonl`, must make the checker exit 1 and name its key. The planted line (from 1).
pub(super) fn applied_acquire_refused_is_caught(
    dir: &Path,
    name: &str,
    lines: &[Value],
    after: i64,
) -> usize {
    let (n, acquired) = first_ok(
        lines,
        "acquire",
        |l| {
            l["call"].as_i64().is_some_and(|t| t >= after)
                && !in_doubt(lines, l)
                && lines.iter().any(|o| {
                    (o["op"] == "renew" || o["op"] == "release")
                        && o["status"] == "ok"
                        && o["key"] == l["key"]
                        && o["session"] == l["session"]
                        && o["token"] == l["out"]["token"]
                })
        },
        "no acquire was renewed or released",
    );
    let mut planted = lines.to_vec();
    planted[n]["status"] = "fail".into();
    planted[n]["code"] = "NOT_LEADER".into();
    planted[n]["out"] = json!({});
    let path = dir.join(format!("{name}.jsonl"));
    write_lines(&path, &planted);
    let (status, verdict) = check(&path);
    let key = acquired["key"].as_str().unwrap_or_default();
    assert_eq!(
        status, 1,
        "an applied acquire answered NOT_LEADER is caught: {verdict}"
    );
    assert!(
        verdict.contains(&format!("violation on key {key}")),
        "the checker names the key whose acquire was answered NOT_LEADER: {verdict}"
    );
    n + 1
}
