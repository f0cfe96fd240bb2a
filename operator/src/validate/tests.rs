use crate::workload::ServiceName;
use dlock_contract::revoke::RevokeOrder;

use super::*;

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|n| (*n).to_owned()).collect()
}

#[test]
fn a_fence_target_is_the_named_one_or_the_namespaces_only_one() {
    let kind = "PaymentResource";
    let name = |n: &str| ServiceName::new(n).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        fence_target(kind, "f", Some("pay"), &names(&["a", "pay"])),
        Ok(name("pay"))
    );
    assert_eq!(
        fence_target(kind, "f", None, &names(&["payments-eu"])),
        Ok(name("payments-eu"))
    );
    // A named target must be one of the namespace's own objects, by a Service name.
    let Err(absent) = fence_target(kind, "f", Some("pay"), &names(&["a", "b"])) else {
        panic!("a target that does not exist was chosen");
    };
    assert!(
        absent.message.contains("no PaymentResource named pay"),
        "{absent}"
    );
    for hostile in ["evil.example:80/?", "a.b", "Pay", "pay/", "-pay", "p@evil"] {
        let present = names(&[hostile]);
        assert!(
            fence_target(kind, "f", Some(hostile), &present).is_err(),
            "{hostile:?} was accepted as a target"
        );
        assert!(
            fence_target(kind, "f", None, &present).is_err(),
            "{hostile:?} was accepted as the only target"
        );
    }
    let Err(none) = fence_target(kind, "f", None, &[]) else {
        panic!("chosen from none");
    };
    assert!(none.message.contains("no PaymentResource"), "{none}");
    let Err(several) = fence_target(kind, "f", Some(" "), &names(&["a", "b"])) else {
        panic!("chosen from several");
    };
    assert!(
        several
            .message
            .contains("2 PaymentResources in the namespace (a, b)"),
        "{several}"
    );
}

#[test]
fn a_revocation_target_uses_the_namespaces_objects_never_fixed_names() {
    let ask = RevocationAsk {
        order: RevokeOrder {
            key: "payout:acct-17".to_owned(),
            account_id: "acct-17".to_owned(),
            operator: " oncall ".to_owned(),
            reason: "worker wedged".to_owned(),
            expected_token: Some(41),
        },
        named: [Some("locks"), None, None],
    };
    let present = NamespaceTargets {
        lock_servers: names(&["locks", "other-locks"]),
        payment_resources: names(&["payments"]),
        rail_proxies: names(&["rail"]),
    };
    let target = revocation_target("ns1", &ask, &present).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(target.lock_server_url, "http://locks.ns1.svc:8080");
    assert_eq!(target.payment_resource_url, "http://payments.ns1.svc:8080");
    assert_eq!(target.rail_proxy_url, "http://rail.ns1.svc:8080");
    assert_eq!(target.order.operator, "oncall");
    assert_eq!(target.order.expected_token, Some(41));
    let mut bad_key = ask.clone();
    bad_key.order.key = "payout:a/b".to_owned();
    bad_key.order.account_id = "a/b".to_owned();
    assert!(check_ask(&bad_key).is_err());
}

#[test]
fn a_spec_runs_only_the_operators_image_or_one_the_platform_allows() {
    let settings = Settings {
        image: "ghcr.io/dlock/dlock:0.1.0".to_owned(),
        operator_identity: "system:serviceaccount:dlock-system:dlock-operator".to_owned(),
        operator_namespace: "dlock-system".to_owned(),
        allowed_images: names(&["registry.example/dlock:0.1.1"]),
        service_account_roles: Vec::new(),
    };
    let named = |image: &str| settings.image_for("spec.image", Some(&image.to_owned()));
    assert_eq!(
        settings.image_for("spec.image", None),
        Ok(settings.image.clone())
    );
    assert_eq!(
        named("ghcr.io/dlock/dlock:0.1.0"),
        Ok(settings.image.clone())
    );
    assert_eq!(
        named("registry.example/dlock:0.1.1"),
        Ok("registry.example/dlock:0.1.1".to_owned())
    );
    for hostile in [
        "evil.example/exfiltrate:latest",
        "ghcr.io/dlock/dlock:0.1.0-evil",
        "registry.example/dlock:0.1.1@sha256:0000",
        "",
    ] {
        let Err(refused) = named(hostile) else {
            panic!("{hostile:?} was allowed");
        };
        assert_eq!(refused.field, "spec.image");
        assert!(
            refused.message.contains("allowedImages")
                && refused.message.contains("registry.example/dlock:0.1.1"),
            "{refused}"
        );
    }
}
