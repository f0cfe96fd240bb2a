//! The treasury role on a cluster: under TokenReview every caller is a ServiceAccount, so the
//! services' default treasury identity (`treasury`) is nobody's, and no one may open or fund an
//! account until the PaymentResource names the ServiceAccounts that may
//! (`spec.auth.treasuryServiceAccounts`). The operator writes them into the payment resource's
//! `auth.treasury-identities` as TokenReview names them.

use dlock_operator::crd::{PaymentResource, ServiceAuth};
use dlock_operator::validate;
use dlock_operator::workload::SERVICE_NAME_PATTERN;
use kube::CustomResourceExt;

use crate::fixtures::{self, settings};

fn with_treasury(accounts: Option<Vec<&str>>) -> PaymentResource {
    let mut object = fixtures::payment_resource();
    object.spec.service.auth = Some(ServiceAuth {
        mode: None,
        treasury_service_accounts: accounts.map(|a| a.into_iter().map(str::to_owned).collect()),
    });
    object
}

#[test]
fn the_named_service_accounts_are_the_payment_resources_treasury_and_nobody_else_is() {
    let named = validate::payment_resource(
        &with_treasury(Some(vec!["treasury", "payroll-funding"])),
        &settings(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        named.config_toml.contains(
            "\"auth.treasury-identities\" = [\"system:serviceaccount:default:treasury\", \
             \"system:serviceaccount:default:payroll-funding\"]"
        ),
        "{}",
        named.config_toml
    );
    // Absent: the key is left out, and the service's default identity `treasury` is no
    // ServiceAccount's, so nobody under TokenReview may fund.
    let absent = validate::payment_resource(&with_treasury(None), &settings())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !absent.config_toml.contains("auth.treasury-identities"),
        "{}",
        absent.config_toml
    );
}

#[test]
fn a_treasury_entry_that_is_not_a_service_account_name_is_refused_naming_it() {
    for bad in [
        "system:serviceaccount:other:treasury",
        "Treasury",
        "evil.example",
        "",
    ] {
        let refused =
            validate::payment_resource(&with_treasury(Some(vec!["treasury", bad])), &settings())
                .expect_err(bad);
        assert_eq!(
            refused.field, "spec.auth.treasuryServiceAccounts[1]",
            "{bad:?}"
        );
    }
    // The CRD's schema carries the same rule for each entry.
    let crd = serde_json::to_value(PaymentResource::crd()).unwrap_or_else(|e| panic!("{e}"));
    let items = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["auth"]["properties"]["treasuryServiceAccounts"]["items"];
    assert_eq!(items["pattern"], SERVICE_NAME_PATTERN, "{items}");
    assert_eq!(items["maxLength"], 63, "{items}");
}

fn with_dual_approval_above(above: Option<i64>) -> PaymentResource {
    let mut object = fixtures::payment_resource();
    object.spec.treasury = Some(dlock_operator::crd::TreasurySpec {
        dual_approval_above: above,
    });
    object
}

#[test]
fn the_dual_approval_threshold_is_rendered_into_the_payment_resources_config() {
    let key = "\"auth.treasury.dual-approval-above\"";
    let set = validate::payment_resource(&with_dual_approval_above(Some(500_000)), &settings())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        set.config_toml.contains(&format!("{key} = 500000\n")),
        "{}",
        set.config_toml
    );
    // Absent (no treasury, or no threshold in it): the key is left out and every funding
    // applies at once.
    for object in [fixtures::payment_resource(), with_dual_approval_above(None)] {
        let absent =
            validate::payment_resource(&object, &settings()).unwrap_or_else(|e| panic!("{e}"));
        assert!(!absent.config_toml.contains(key), "{}", absent.config_toml);
    }
}

#[test]
fn a_dual_approval_threshold_that_is_not_a_positive_amount_is_refused_naming_it() {
    for bad in [
        0,
        -1,
        i64::MIN,
        dlock_contract::payment::AMOUNT_MINOR_MAX + 1,
    ] {
        let refused = validate::payment_resource(&with_dual_approval_above(Some(bad)), &settings())
            .expect_err(&bad.to_string());
        assert_eq!(refused.field, "spec.treasury.dualApprovalAbove", "{bad}");
        assert!(
            refused.message.contains("minor units"),
            "{}",
            refused.message
        );
    }
    // The CRD's schema carries the same range, so the API server refuses it first.
    let crd = serde_json::to_value(PaymentResource::crd()).unwrap_or_else(|e| panic!("{e}"));
    let above = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["treasury"]["properties"]["dualApprovalAbove"];
    assert_eq!(above["minimum"].as_f64(), Some(1.0), "{above}");
    assert_eq!(
        above["maximum"].as_f64(),
        Some(dlock_contract::payment::AMOUNT_MINOR_MAX as f64),
        "{above}"
    );
}
