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

#[test]
fn an_older_statement_without_an_index_is_indexed_on_open_and_its_torn_tail_cut() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("statement.jsonl");
    let mut text = String::new();
    for n in 0..3 {
        text += &line(&transfer(&format!("ref-{n}"), n));
    }
    text += &line(&transfer("ref-1", 9)); // a duplicate acknowledgement
    text += "{\"clientRef\":\"torn"; // a crash mid-append
    std::fs::write(&path, &text).unwrap();

    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(
        ledger.first("ref-1").unwrap().unwrap().rail_reference,
        "rail-1"
    );
    let all: Vec<_> = ledger.all_for("ref-1").unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].rail_reference, "rail-9");
    assert!(ledger.first("torn").unwrap().is_none());
    // The next line starts on a line of its own.
    ledger.accept(transfer("ref-4", 4)).unwrap();
    drop(ledger);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.ends_with(&line(&transfer("ref-4", 4))));
    assert_eq!(text.lines().count(), 5);
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(
        ledger.first("ref-4").unwrap().unwrap().rail_reference,
        "rail-4"
    );
}

#[test]
fn lines_the_index_missed_are_caught_up_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("statement.jsonl");
    let mut ledger = Ledger::open(&path).unwrap();
    for n in 0..5 {
        ledger.accept(transfer(&format!("ref-{n}"), n)).unwrap();
    }
    drop(ledger);
    // Lines appended behind the index's back, as after a kill between the write and the
    // index commit.
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    file.write_all(line(&transfer("ref-5", 5)).as_bytes())
        .unwrap();
    file.write_all(line(&transfer("ref-0", 6)).as_bytes())
        .unwrap();
    drop(file);
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(
        ledger.first("ref-5").unwrap().unwrap().rail_reference,
        "rail-5"
    );
    assert_eq!(
        ledger.first("ref-0").unwrap().unwrap().rail_reference,
        "rail-0"
    );
    assert_eq!(ledger.all_for("ref-0").unwrap().len(), 2);
}

#[test]
fn an_index_of_another_statement_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("statement.jsonl");
    let mut ledger = Ledger::open(&path).unwrap();
    for n in 0..5 {
        ledger.accept(transfer(&format!("old-{n}"), n)).unwrap();
    }
    drop(ledger);
    // The statement file is replaced by a longer one the index never saw.
    let mut text = String::new();
    for n in 0..8 {
        text += &line(&transfer(&format!("new-{n}"), 100 + n));
    }
    std::fs::write(&path, text).unwrap();
    let mut ledger = Ledger::open(&path).unwrap();
    assert!(ledger.first("old-4").unwrap().is_none());
    assert_eq!(
        ledger.first("new-7").unwrap().unwrap().rail_reference,
        "rail-107"
    );
    // And a shorter one.
    drop(ledger);
    std::fs::write(&path, line(&transfer("short", 1))).unwrap();
    let mut ledger = Ledger::open(&path).unwrap();
    assert!(ledger.first("new-0").unwrap().is_none());
    assert_eq!(
        ledger.first("short").unwrap().unwrap().rail_reference,
        "rail-1"
    );
}

#[test]
fn an_unreadable_index_is_rebuilt_from_the_statement() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("statement.jsonl");
    let mut ledger = Ledger::open(&path).unwrap();
    ledger.accept(transfer("ref-0", 0)).unwrap();
    drop(ledger);
    std::fs::write(index_path(&path), b"not a database").unwrap();
    let mut ledger = Ledger::open(&path).unwrap();
    assert_eq!(
        ledger.first("ref-0").unwrap().unwrap().rail_reference,
        "rail-0"
    );
}
