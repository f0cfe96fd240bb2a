#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn transfer(client_ref: &str, n: u64) -> Transfer {
    Transfer {
        client_ref: client_ref.to_owned(),
        rail_reference: format!("rail-{n}"),
        amount_minor: 100,
        currency: "EUR".into(),
        accepted_at: chrono::DateTime::from_timestamp_millis(1_700_000_000_000).unwrap(),
    }
}

fn line(t: &Transfer) -> String {
    format!("{}\n", serde_json::to_string(t).unwrap())
}

/// A statement path in a fresh directory (removed when the first value drops).
fn statement() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("statement.jsonl");
    (dir, path)
}

/// Statement lines for `refs`, `rail-{first}`, `rail-{first + 1}`, … in order.
fn lines(refs: impl IntoIterator<Item = String>, first: u64) -> String {
    (first..)
        .zip(refs)
        .map(|(n, r)| line(&transfer(&r, n)))
        .collect()
}

/// `prefix-0` … `prefix-{n - 1}`.
fn refs(prefix: &str, n: u64) -> impl Iterator<Item = String> {
    (0..n).map(move |i| format!("{prefix}-{i}"))
}

/// A ledger at `path` that accepted `prefix-0` … `prefix-{n - 1}` (as `rail-0` …), closed.
fn accepted(path: &Path, prefix: &str, n: u64) {
    let mut ledger = Ledger::open(path).unwrap();
    for (i, r) in (0..).zip(refs(prefix, n)) {
        ledger.accept(transfer(&r, i)).unwrap();
    }
}

/// The rail reference of the first transfer of `client_ref`, or "" when there is none.
fn first_rail_ref(ledger: &mut Ledger, client_ref: &str) -> String {
    ledger
        .first(client_ref)
        .unwrap()
        .map(|t| t.rail_reference)
        .unwrap_or_default()
}

#[test]
fn an_older_statement_without_an_index_is_indexed_on_open_and_its_torn_tail_cut() {
    let (_dir, path) = statement();
    let mut text = lines(refs("ref", 3), 0);
    text += &line(&transfer("ref-1", 9)); // a duplicate acknowledgement
    text += "{\"clientRef\":\"torn"; // a crash mid-append
    std::fs::write(&path, &text).unwrap();

    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(first_rail_ref(&mut ledger, "ref-1"), "rail-1");
    let all: Vec<_> = ledger.all_for("ref-1").unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].rail_reference, "rail-9");
    assert_eq!(first_rail_ref(&mut ledger, "torn"), "");
    // The next line starts on a line of its own.
    ledger.accept(transfer("ref-4", 4)).unwrap();
    drop(ledger);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.ends_with(&line(&transfer("ref-4", 4))));
    assert_eq!(text.lines().count(), 5);
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(first_rail_ref(&mut ledger, "ref-4"), "rail-4");
}

#[test]
fn lines_the_index_missed_are_caught_up_on_open() {
    let (_dir, path) = statement();
    accepted(&path, "ref", 5);
    // Lines appended behind the index's back, as after a kill between the write and the
    // index commit.
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    let behind = lines(["ref-5".to_owned(), "ref-0".to_owned()], 5);
    file.write_all(behind.as_bytes()).unwrap();
    drop(file);
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(first_rail_ref(&mut ledger, "ref-5"), "rail-5");
    assert_eq!(first_rail_ref(&mut ledger, "ref-0"), "rail-0");
    assert_eq!(ledger.all_for("ref-0").unwrap().len(), 2);
}

#[test]
fn an_index_of_another_statement_is_rebuilt() {
    let (_dir, path) = statement();
    accepted(&path, "old", 5);
    // The statement file is replaced by a longer one the index never saw.
    std::fs::write(&path, lines(refs("new", 8), 100)).unwrap();
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(first_rail_ref(&mut ledger, "old-4"), "");
    assert_eq!(first_rail_ref(&mut ledger, "new-7"), "rail-107");
    // And a shorter one.
    drop(ledger);
    std::fs::write(&path, line(&transfer("short", 1))).unwrap();
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(first_rail_ref(&mut ledger, "new-0"), "");
    assert_eq!(first_rail_ref(&mut ledger, "short"), "rail-1");
}

#[test]
fn an_unreadable_index_is_rebuilt_from_the_statement() {
    let (_dir, path) = statement();
    accepted(&path, "ref", 1);
    std::fs::write(index_path(&path), b"not a database").unwrap();
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(first_rail_ref(&mut ledger, "ref-0"), "rail-0");
}
