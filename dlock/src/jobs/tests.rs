use super::*;
use dlock_contract::reconcile::StatementCounts;
use dlock_executor::reconcile::{Finding, Findings, Severity};

fn batch(items: &[(&str, i64, &str)]) -> PayoutBatch {
    let mut text = String::from(
        "apiVersion: dlock.io/v1alpha1\nkind: PayoutBatch\nmetadata:\n  name: b1\nspec:\n  workers: 1\n  payouts:\n",
    );
    for (n, (account, amount, currency)) in items.iter().enumerate() {
        text.push_str(&format!(
            "    - key: k{n}\n      accountId: {account}\n      amountMinor: {amount}\n      currency: {currency}\n      beneficiaryRef: ben-{n}\n"
        ));
    }
    dlock_executor::manifest::parse(&text).unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn each_account_is_funded_with_what_the_batch_pays_from_it_under_a_stable_key() {
    let b = batch(&[
        ("acct-a", 100, "EUR"),
        ("acct-b", 7, "EUR"),
        ("acct-a", 50, "EUR"),
    ]);
    let f = fundings(&b, None).unwrap_or_else(|e| panic!("{e:#}"));
    let got: Vec<(&str, i64)> = f
        .iter()
        .map(|f| (f.account_id.as_str(), f.amount_minor))
        .collect();
    assert_eq!(got, [("acct-a", 150), ("acct-b", 7)]);
    // The same batch and amount: the same key (a replay, funded once); another amount or
    // another account: another key.
    let again = fundings(&b, None).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(f, again);
    assert_ne!(f[0].key, f[1].key);
    let more = fundings(&b, Some(1_000)).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(more[0].amount_minor, 1_000);
    assert_ne!(more[0].key, f[0].key);
    for funding in f.iter().chain(&more) {
        assert!(
            dlock_contract::payment::reference_is_valid(&funding.key),
            "{}",
            funding.key
        );
        assert!(funding.key.len() <= 128);
    }
    let mixed = batch(&[("acct-a", 1, "EUR"), ("acct-a", 1, "USD")]);
    let error = fundings(&mixed, None).err().map(|e| e.to_string());
    assert!(
        error.as_deref().is_some_and(|e| e.contains("EUR and USD")),
        "{error:?}"
    );
}

#[test]
fn the_summary_says_what_is_quarantined_and_the_exact_commands_to_settle_it() {
    let services = [
        ("lock server", "http://127.0.0.1:1/"),
        ("rail proxy", "http://127.0.0.1:3"),
    ];
    let mut report = Report {
        payouts: 4,
        ..Report::default()
    };
    report.states.insert("POSTED".into(), 4);
    let clean = summary(&report, &services, None);
    assert!(clean.contains("paid              4  POSTED"), "{clean}");
    assert!(!clean.contains("dlock resolve"), "{clean}");
    assert!(
        clean.contains("metrics: http://127.0.0.1:1/metrics (lock server), http://127.0.0.1:3/metrics (rail proxy)"),
        "{clean}"
    );
    // One quarantined payout: its exact commands.
    let one = Uuid::from_u128(42);
    report.ambiguous = vec![one];
    report.states.insert("RAIL_AMBIGUOUS".into(), 1);
    let text = summary(&report, &services, None);
    assert!(text.contains("  dlock reconcile "), "{text}");
    assert!(
        text.contains(&format!(
            "dlock resolve {one} --posted --rail-reference REF --operator YOU"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("dlock resolve {one} --failed --operator YOU")),
        "{text}"
    );
    // Many: the commands once, the first ids, and how to list the rest.
    let ids: Vec<Uuid> = (0..7u128).map(Uuid::from_u128).collect();
    report.ambiguous = ids.iter().rev().copied().collect();
    report.states.insert("RAIL_AMBIGUOUS".into(), 7);
    report.states.insert("PENDING".into(), 2);
    let text = summary(&report, &services, Some("http://127.0.0.1:9/metrics"));
    assert!(
        text.contains("quarantined       7  RAIL_AMBIGUOUS: the rail's answer was lost"),
        "{text}"
    );
    assert!(
        text.contains("dlock resolve ID --posted --rail-reference REF"),
        "{text}"
    );
    let named: Vec<String> = ids[..SUMMARY_IDS_SHOWN]
        .iter()
        .map(Uuid::to_string)
        .collect();
    assert!(
        text.contains(&format!("quarantined: {}, and 2 more", named.join(", "))),
        "{text}"
    );
    // Nothing to report, no metrics line.
    assert!(!summary(&report, &[], None).contains("metrics:"));
    assert!(text.contains("unfinished        2"), "{text}");
    assert!(
        text.contains("metrics: http://127.0.0.1:9/metrics (this run"),
        "{text}"
    );
}

#[test]
fn the_termination_summary_fits_4096_bytes_most_severe_first() {
    let finding = |severity, n: usize| Finding {
        severity,
        kind: "ambiguous_not_on_rail",
        subject: format!("payout-{n}"),
        detail: "x".repeat(300),
    };
    let mut findings = Findings {
        payouts_checked: 500,
        statement: StatementCounts {
            ambiguous_not_on_rail: 100,
            ..StatementCounts::default()
        },
        ..Findings::default()
    };
    findings
        .findings
        .extend((0..100).map(|n| finding(Severity::Info, n)));
    findings.findings.push(finding(Severity::Critical, 1000));
    let text = termination_summary(&findings);
    assert!(text.len() <= TERMINATION_MESSAGE_MAX, "{}", text.len());
    let parsed: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(parsed["critical"], 1);
    assert_eq!(parsed["info"], 100);
    assert_eq!(parsed["payoutsChecked"], 500);
    let lines = parsed["findings"].as_array().cloned().unwrap_or_default();
    let first = lines.first().and_then(|l| l.as_str()).unwrap_or_default();
    assert!(
        first.starts_with("critical ambiguous_not_on_rail payout-1000: "),
        "{first}"
    );
    let omitted = parsed["omitted"].as_u64().unwrap_or_default() as usize;
    assert!(omitted > 0, "{text}");
    assert_eq!(omitted + lines.len(), 101);
    let empty = termination_summary(&Findings::default());
    assert!(empty.contains("\"findings\":[]"), "{empty}");
}
