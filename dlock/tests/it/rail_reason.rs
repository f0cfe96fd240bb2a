//! A `reason` over 4096 characters on the high-water advance is a
//! 400 VALIDATION_FAILED with the envelope, naming the field, and changes nothing.

use reqwest::Method;
use serde_json::json;

use crate::conformance::assert_envelope;
use crate::harness::raw;
use crate::rail::RailWorld;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_high_water_reason_over_4096_characters_is_validation_failed_not_a_500() {
    let (_world, _, proxy) = RailWorld::with_proxy("acct-r").await;
    let advance = |reason: String| {
        let proxy = proxy.clone();
        async move {
            raw(
                Method::POST,
                &format!("{proxy}/v1/rail/high-water/acct-r"),
                &[
                    ("content-type", "application/json"),
                    ("x-owner-id", "ops"),
                    ("authorization", "Bearer test-operator"),
                ],
                Some(&json!({"floor": 9, "operator": "ops", "reason": reason}).to_string()),
            )
            .await
        }
    };
    for len in [4_097, 10_000] {
        let (status, _, body) = advance("r".repeat(len)).await;
        assert_eq!(status, 400, "reason of {len} characters: {body}");
        assert_envelope("long reason", status, &body, "VALIDATION_FAILED");
        assert!(
            body["details"]["fields"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f["field"] == "reason")),
            "{body}"
        );
    }
    // Multi-byte characters count as characters, not bytes: 4096 of them is fine.
    let (status, _, body) = advance("é".repeat(4_096)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["highestToken"], 9);
}
