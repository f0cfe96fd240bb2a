//! A reference to a dlock service in a custom resource becomes the URL the operator sends its own
//! credential to. Each one is a Service name of the object's namespace: a name that could steer
//! the credential to another host, port or path is refused by the operator's validation (and,
//! with the same pattern, by the CRD's schema).

use dlock_operator::crd::PayoutBatch;
use dlock_operator::validate;
use dlock_operator::workload::{SERVICE_NAME_LEN_MAX, SERVICE_NAME_PATTERN, ServiceName};
use kube::CustomResourceExt;

use crate::fixtures::{self, settings};

/// Names that are not a Service's: another host and port, a path, a user-info part, upper case,
/// a dotted subdomain, too long, empty.
fn hostile() -> Vec<String> {
    let mut names: Vec<String> = [
        "evil.example:80/?",
        "evil.example",
        "payments/../x",
        "u@evil",
        "Payments",
        "-payments",
        "payments-",
        "",
    ]
    .map(str::to_owned)
    .to_vec();
    names.push("a".repeat(SERVICE_NAME_LEN_MAX + 1));
    names
}

#[test]
fn a_service_name_is_a_dns_label_and_nothing_else() {
    for good in [
        "payment-resource",
        "rail-sepa-2",
        "a",
        &"a".repeat(SERVICE_NAME_LEN_MAX),
    ] {
        assert_eq!(
            ServiceName::new(good).map(|n| n.to_string()),
            Ok(good.to_owned())
        );
    }
    for bad in hostile() {
        assert!(ServiceName::new(&bad).is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn a_batch_naming_a_host_instead_of_a_service_is_refused_before_any_url_is_made() {
    // Positive control: the fixture's batch, with each reference named, is accepted.
    let mut named = fixtures::payout_batch();
    named.spec.lock_server = Some("locks".to_owned());
    named.spec.payment_resource = Some("payments".to_owned());
    named.spec.rail_proxy = Some("rail".to_owned());
    let batch = validate::payout_batch(&named, &settings(), &Default::default()).unwrap();
    assert_eq!(
        batch.payment_resource_url,
        "http://payments.default.svc:8080"
    );
    type Field = fn(&mut PayoutBatch) -> &mut Option<String>;
    let fields: [(&str, Field); 3] = [
        ("spec.lockServer", |b| &mut b.spec.lock_server),
        ("spec.paymentResource", |b| &mut b.spec.payment_resource),
        ("spec.railProxy", |b| &mut b.spec.rail_proxy),
    ];
    for (field, at) in fields {
        for bad in hostile() {
            let mut object = named.clone();
            *at(&mut object) = Some(bad.clone());
            let refused = validate::payout_batch(&object, &settings(), &Default::default())
                .err()
                .unwrap_or_else(|| panic!("{field} = {bad:?} was accepted"));
            assert_eq!(refused.field, field, "{bad:?}: {refused}");
        }
    }
}

#[test]
fn a_reconciliation_naming_a_host_as_its_rail_proxy_is_refused() {
    let good = validate::reconciliation(&fixtures::reconciliation(None), &settings()).unwrap();
    assert_eq!(good.rail_url, "http://rail-proxy-stub.default.svc:8080");
    for bad in hostile() {
        let mut object = fixtures::reconciliation(None);
        object.spec.rail_proxy = Some(bad.clone());
        let refused = validate::reconciliation(&object, &settings())
            .err()
            .unwrap_or_else(|| panic!("{bad:?} was accepted"));
        assert_eq!(refused.field, "spec.railProxy", "{bad:?}");
    }
}

/// Every reference field of every kind carries the Service-name pattern and length in the
/// generated schema, so the API server refuses a hostile name before the operator sees it.
#[test]
fn every_service_reference_in_the_crds_has_the_service_name_pattern() {
    use dlock_operator::crd::{Lock, LockRevocation, Reconciliation};
    let schemas = [
        (
            PayoutBatch::crd(),
            vec!["lockServer", "paymentResource", "railProxy"],
        ),
        (
            LockRevocation::crd(),
            vec!["lockServer", "paymentResource", "railProxy"],
        ),
        (Lock::crd(), vec!["lockServer"]),
        (Reconciliation::crd(), vec!["railProxy"]),
    ];
    for (crd, fields) in schemas {
        let crd = serde_json::to_value(&crd).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        for field in fields {
            let kind = &crd["spec"]["names"]["kind"];
            let schema = &spec[field];
            assert_eq!(schema["pattern"], SERVICE_NAME_PATTERN, "{kind}.{field}");
            assert_eq!(
                schema["maxLength"], SERVICE_NAME_LEN_MAX as u64,
                "{kind}.{field}"
            );
        }
    }
}
