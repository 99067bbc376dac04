//! The address policy and the frontend budget (docs/security.md): each
//! refusal reason in both families, the rest of a Service served all the
//! same, the older Service winning an address whatever order the agent
//! learns of the two in, and the budget counted from the spec's sizes.

use std::{net::IpAddr, sync::Arc};

use k8s_openapi::api::core::v1::Service;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::{
    source::{Kind, Object, ObjectKey, SourceEvent},
    state::ClusterState,
};

// ---- builders -------------------------------------------------------------

/// `namespace/name`, ClusterIP `cluster_ip`, ports `ports` (80/TCP alone
/// when empty), created at `created` seconds after the epoch when given.
fn service_json(
    namespace: &str,
    name: &str,
    cluster_ip: &str,
    external_ips: &[&str],
    created: Option<u32>,
) -> Value {
    let mut service = json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            "externalIPs": external_ips,
        },
    });
    if let Some(seconds) = created {
        service["metadata"]["creationTimestamp"] = json!(format!(
            "2024-01-01T00:{:02}:{:02}Z",
            seconds / 60,
            seconds % 60
        ));
    }
    service
}

fn decode(value: Value) -> Service {
    serde_json::from_value(value).expect("a valid Service")
}

/// The same Service as a LoadBalancer whose ingress is `ingress`.
fn with_ingress(mut service: Value, ingress: &[&str]) -> Value {
    service["spec"]["type"] = json!("LoadBalancer");
    service["status"] = json!({"loadBalancer": {"ingress":
        ingress.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}});
    service
}

fn compact(value: Value) -> CompactService {
    CompactService::from(&decode(value))
}

fn modelled(service: &CompactService, claims: &AddressClaims, config: &ModelConfig) -> Modelled {
    service
        .modelled(&[], &NodeInfo::default(), config, claims)
        .expect("a valid Service")
}

/// The external frontends' addresses (Scope Any), in order.
fn external_addresses(modelled: &Modelled) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = modelled
        .frontends
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FrontendKind::ExternalIp | FrontendKind::LoadBalancer
            )
        })
        .map(|f| f.key.ip)
        .collect();
    out.dedup();
    out
}

fn reasons(modelled: &Modelled) -> Vec<(Reason, Option<IpAddr>)> {
    modelled
        .refusals
        .iter()
        .map(|r| (r.reason, r.address.map(|a| a.ip)))
        .collect()
}

/// `got`'s one refusal is of `address` as the ClusterIP of `owner`, whom
/// its detail names.
fn assert_cluster_ip_refusal(got: &Modelled, address: &str, owner: &str, context: &str) {
    assert_eq!(
        reasons(got),
        vec![(Reason::ClusterIp, Some(ip(address)))],
        "{context}"
    );
    assert!(
        got.refusals[0].detail.contains(owner),
        "{context}: the refusal names {owner}: {}",
        got.refusals[0].detail
    );
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

// ---- addresses refused for what they are -------------------------------------

#[test]
fn special_addresses_are_refused_in_both_families_and_the_rest_is_served() {
    let cases: [(&str, &str, &str, Reason); 13] = [
        // (ClusterIP, legal external address, refused one, reason)
        ("10.96.0.20", "203.0.113.7", "127.0.0.1", Reason::Loopback),
        ("10.96.0.20", "203.0.113.7", "127.9.9.9", Reason::Loopback),
        (
            "10.96.0.20",
            "203.0.113.7",
            "169.254.169.254",
            Reason::LinkLocal,
        ),
        (
            "10.96.0.20",
            "203.0.113.7",
            "224.0.0.251",
            Reason::Multicast,
        ),
        ("10.96.0.20", "203.0.113.7", "239.1.2.3", Reason::Multicast),
        (
            "10.96.0.20",
            "203.0.113.7",
            "255.255.255.255",
            Reason::Broadcast,
        ),
        ("10.96.0.20", "203.0.113.7", "0.0.0.0", Reason::Unspecified),
        ("fd00:96::20", "2001:db8::7", "::1", Reason::Loopback),
        ("fd00:96::20", "2001:db8::7", "fe80::1", Reason::LinkLocal),
        ("fd00:96::20", "2001:db8::7", "febf::1", Reason::LinkLocal),
        ("fd00:96::20", "2001:db8::7", "ff02::fb", Reason::Multicast),
        ("fd00:96::20", "2001:db8::7", "::", Reason::Unspecified),
        // An IPv4-mapped address is read as the IPv4 address it maps.
        (
            "10.96.0.20",
            "203.0.113.7",
            "::ffff:127.0.0.1",
            Reason::Loopback,
        ),
    ];
    let claims = AddressClaims::default();
    let config = ModelConfig::default();
    for (cluster_ip, legal, refused, reason) in cases {
        for lb in [false, true] {
            let mut json = service_json("demo", "web", cluster_ip, &[legal], None);
            if lb {
                json = with_ingress(json, &[refused]);
            } else {
                json["spec"]["externalIPs"] = json!([legal, refused]);
            }
            let got = modelled(&compact(json), &claims, &config);
            let how = if lb { "load balancer IP" } else { "externalIP" };
            assert_eq!(
                external_addresses(&got),
                vec![ip(legal)],
                "{how} {refused}: the legal address alone is programmed"
            );
            assert_eq!(
                reasons(&got),
                vec![(reason, Some(ip(refused).to_canonical()))],
                "{how} {refused}: refused for {reason:?}"
            );
            assert!(
                got.frontends
                    .iter()
                    .any(|f| f.kind == FrontendKind::ClusterIp && f.key.ip == ip(cluster_ip)),
                "{how} {refused}: the ClusterIP is served all the same"
            );
        }
    }
    assert_eq!(special_address(ip("169.253.255.255")), None);
    assert_eq!(special_address(ip("169.255.0.0")), None);
    assert_eq!(
        special_address(ip("fec0::1")),
        None,
        "site-local is not link-local"
    );
    assert_eq!(special_address(ip("2001:db8::1")), None);
    assert_eq!(
        special_address(ip("::ffff:169.254.169.254")),
        Some(Reason::LinkLocal),
        "read as the IPv4 address it maps"
    );
}

#[test]
fn another_services_cluster_ip_is_refused_in_both_families_via_external_ips_and_ingress() {
    for (victim_ip, attacker_ip, legal) in [
        ("10.96.0.10", "10.96.0.99", "203.0.113.9"),
        ("fd00:96::10", "fd00:96::99", "2001:db8::9"),
    ] {
        let mut claims = AddressClaims::default();
        let victim = compact(service_json(
            "kube-system",
            "kube-dns",
            victim_ip,
            &[],
            Some(100),
        ));
        claims.add(&victim);
        // Older than the victim: ClusterIPs win whatever the ages.
        for (how, json) in [
            (
                "externalIPs",
                service_json("tenant", "evil", attacker_ip, &[victim_ip, legal], Some(1)),
            ),
            (
                "load balancer ingress",
                with_ingress(
                    service_json("tenant", "evil", attacker_ip, &[legal], Some(1)),
                    &[victim_ip],
                ),
            ),
        ] {
            let attacker = compact(json);
            claims.add(&attacker);
            let got = modelled(&attacker, &claims, &ModelConfig::default());
            assert_eq!(
                external_addresses(&got),
                vec![ip(legal)],
                "{victim_ip} via {how}: only the legal address is programmed"
            );
            assert_cluster_ip_refusal(
                &got,
                victim_ip,
                "kube-system/kube-dns",
                &format!("{victim_ip} via {how}"),
            );
            claims.remove(&attacker);
        }
        // The victim's own frontends are untouched by the attacker's claim.
        let own = modelled(&victim, &claims, &ModelConfig::default());
        assert!(own.refusals.is_empty(), "{:?}", own.refusals);
    }
}

#[test]
fn a_cluster_ip_two_services_hold_stays_theirs_until_both_are_gone() {
    // The API server gives each ClusterIP to one Service; manifests may
    // give one to two. Each holder is an owner until it leaves.
    let mut claims = AddressClaims::default();
    let first = compact(service_json("a", "first", "10.96.0.10", &[], Some(1)));
    let second = compact(service_json("b", "second", "10.96.0.10", &[], Some(2)));
    claims.add(&first);
    claims.add(&second);
    let owners = claims.cluster_ip_owners(ip("10.96.0.10"));
    let names: Vec<&str> = owners.iter().map(|r| &*r.name).collect();
    assert_eq!(names, ["first", "second"], "both hold the ClusterIP");
    assert!(
        Arc::ptr_eq(&owners[0].name, first.name.as_ref().expect("named")),
        "the rank shares the Service's name rather than copying it"
    );

    let claimant = compact(service_json(
        "c",
        "claimant",
        "10.96.0.20",
        &["10.96.0.10"],
        None,
    ));
    claims.remove(&first);
    let got = modelled(&claimant, &claims, &ModelConfig::default());
    assert_cluster_ip_refusal(
        &got,
        "10.96.0.10",
        "b/second",
        "still the second Service's ClusterIP once the first left",
    );
    claims.remove(&second);
    let got = modelled(&claimant, &claims, &ModelConfig::default());
    assert_eq!(
        external_addresses(&got),
        vec![ip("10.96.0.10")],
        "nobody's ClusterIP once both left: {:?}",
        got.refusals
    );
}

#[test]
fn node_addresses_from_the_node_and_its_interfaces_are_refused() {
    for (cluster_ip, status_ip, interface_ip, legal) in [
        ("10.96.0.20", "192.168.50.1", "10.0.2.15", "203.0.113.7"),
        ("fd00:96::20", "fd00:50::1", "fd00:2::15", "2001:db8::7"),
    ] {
        let mut claims = AddressClaims::default();
        let changed = claims.set_node_status(vec![ip(status_ip)]);
        assert_eq!(changed, vec![ip(status_ip)]);
        let changed = claims.set_node_interfaces(vec![ip(interface_ip)]);
        assert_eq!(changed, vec![ip(interface_ip)]);
        let service = compact(service_json(
            "tenant",
            "web",
            cluster_ip,
            &[status_ip, legal, interface_ip],
            None,
        ));
        let got = modelled(&service, &claims, &ModelConfig::default());
        assert_eq!(external_addresses(&got), vec![ip(legal)], "{cluster_ip}");
        assert_eq!(
            reasons(&got),
            vec![
                (Reason::NodeAddress, Some(ip(status_ip))),
                (Reason::NodeAddress, Some(ip(interface_ip)))
            ]
        );
        // The interface address goes: it is legal again.
        let changed = claims.set_node_interfaces(Vec::new());
        assert_eq!(changed, vec![ip(interface_ip)]);
        let got = modelled(&service, &claims, &ModelConfig::default());
        assert_eq!(external_addresses(&got), vec![ip(legal), ip(interface_ip)]);
    }
}

#[test]
fn the_allow_list_refuses_external_ips_outside_it_but_not_load_balancer_ips() {
    let config = ModelConfig {
        external_ip_cidrs: Some(vec![
            Cidr::parse("203.0.113.0/24").unwrap(),
            Cidr::parse("2001:db8:1::/48").unwrap(),
        ]),
        ..ModelConfig::default()
    };
    let claims = AddressClaims::default();
    let v4 = compact(with_ingress(
        service_json(
            "t",
            "a",
            "10.96.0.20",
            &["203.0.113.5", "198.51.100.5"],
            None,
        ),
        &["198.51.100.6"],
    ));
    let got = modelled(&v4, &claims, &config);
    assert_eq!(
        external_addresses(&got),
        vec![ip("203.0.113.5"), ip("198.51.100.6")],
        "inside the list, and the load balancer's IP (a controller's, not the tenant's)"
    );
    assert_eq!(
        reasons(&got),
        vec![(Reason::NotAllowed, Some(ip("198.51.100.5")))]
    );

    let v6 = compact(service_json(
        "t",
        "b",
        "fd00:96::20",
        &["2001:db8:1::5", "2001:db8:2::5"],
        None,
    ));
    let got = modelled(&v6, &claims, &config);
    assert_eq!(external_addresses(&got), vec![ip("2001:db8:1::5")]);
    assert_eq!(
        reasons(&got),
        vec![(Reason::NotAllowed, Some(ip("2001:db8:2::5")))]
    );

    let off = modelled(&v4, &claims, &ModelConfig::default());
    assert_eq!(off.refusals, Vec::new(), "no list: nothing refused for it");
}

// ---- two Services on one address ---------------------------------------------

/// Services claiming 203.0.113.50:80/TCP, each (name, created); the one
/// that should win.
fn claimants(created: &[Option<u32>]) -> (Vec<Value>, usize) {
    let services: Vec<Value> = created
        .iter()
        .enumerate()
        .map(|(i, at)| {
            service_json(
                &format!("ns-{}", (b'a' + (i * 7 % 26) as u8) as char),
                &format!("svc-{i}"),
                &format!("10.96.1.{}", i + 1),
                &["203.0.113.50"],
                *at,
            )
        })
        .collect();
    let ranks: Vec<Rank> = services
        .iter()
        .map(|s| Rank::of(&compact(s.clone())).unwrap())
        .collect();
    let winner = (0..ranks.len()).min_by_key(|i| &ranks[*i]).unwrap();
    (services, winner)
}

fn key_of(service: &Value) -> ObjectKey {
    ObjectKey {
        namespace: service["metadata"]["namespace"].as_str().unwrap().into(),
        name: service["metadata"]["name"].as_str().unwrap().into(),
    }
}

/// Which of `services` the state gives 203.0.113.50:80, and what it says
/// of the others.
fn holders(state: &ClusterState, services: &[Value]) -> Vec<usize> {
    let config = ModelConfig::default();
    let mut holders = Vec::new();
    for (i, service) in services.iter().enumerate() {
        let key = key_of(service);
        let got = state
            .modelled_of(&key, state.service(&key), &config)
            .unwrap();
        if external_addresses(&got).contains(&ip("203.0.113.50")) {
            holders.push(i);
        } else {
            assert_eq!(
                reasons(&got),
                vec![(Reason::Conflict, Some(ip("203.0.113.50")))],
                "{key}: refused for the conflict alone"
            );
        }
    }
    holders
}

#[test]
fn the_older_service_wins_an_address_and_the_loser_gets_it_once_the_winner_goes() {
    // The younger in the first namespace: the listing's order would pick it.
    let young = service_json("aaa", "young", "10.96.1.1", &["203.0.113.50"], Some(500));
    let old = service_json("zzz", "old", "10.96.1.2", &["203.0.113.50"], Some(10));
    let services = [young.clone(), old.clone()];
    for order in [[0, 1], [1, 0]] {
        let mut state = ClusterState::new("node-a");
        for i in order {
            state.apply(SourceEvent::Apply(Object::service(&decode(
                services[i].clone(),
            ))));
        }
        assert_eq!(holders(&state, &services), vec![1], "order {order:?}");
        let changes = state.apply(SourceEvent::Delete {
            kind: Kind::Service,
            key: key_of(&old),
        });
        assert!(
            changes.services.contains(&key_of(&young)),
            "the loser is synced again when the winner goes: {changes:?}"
        );
        assert_eq!(holders(&state, &services[..1]), vec![0], "the winner gone");
    }
    // Without creation times (manifests), namespace and name decide.
    let a = service_json("aaa", "x", "10.96.1.1", &["203.0.113.50"], None);
    let b = service_json("bbb", "x", "10.96.1.2", &["203.0.113.50"], None);
    let mut state = ClusterState::new("node-a");
    for s in [&b, &a] {
        state.apply(SourceEvent::Apply(Object::service(&decode(s.clone()))));
    }
    assert_eq!(holders(&state, &[a, b]), vec![0]);
}

#[test]
fn a_conflict_is_per_port_and_protocol() {
    let mut first = service_json("a", "first", "10.96.1.1", &["203.0.113.50"], Some(1));
    first["spec"]["ports"] = json!([{"name": "dns", "port": 53, "protocol": "UDP"}]);
    let second = service_json("b", "second", "10.96.1.2", &["203.0.113.50"], Some(2));
    let mut state = ClusterState::new("node-a");
    for s in [&first, &second] {
        state.apply(SourceEvent::Apply(Object::service(&decode(s.clone()))));
    }
    let key = key_of(&second);
    let got = state
        .modelled_of(&key, state.service(&key), &ModelConfig::default())
        .unwrap();
    assert_eq!(
        external_addresses(&got),
        vec![ip("203.0.113.50")],
        "53/UDP and 80/TCP of one address are two Services' without conflict"
    );
}

#[test]
fn a_claim_that_is_not_programmed_wins_nothing() {
    // The older Service is another proxy's, over its budget, or its
    // externalIP is outside the allow-list: the younger is served.
    let mut other_proxy = service_json("a", "older", "10.96.1.1", &["203.0.113.50"], Some(1));
    other_proxy["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "someone-else"});
    let mut too_big = service_json("a", "older", "10.96.1.1", &["203.0.113.50"], Some(1));
    too_big["spec"]["ports"] = json!(
        (1..=5)
            .map(|p| json!({"name": format!("p{p}"), "port": p, "protocol": "TCP"}))
            .chain([json!({"name": "http", "port": 80, "protocol": "TCP"})])
            .collect::<Vec<_>>()
    );
    let young = service_json("b", "younger", "10.96.1.2", &["203.0.113.50"], Some(2));
    let mut young_lb = with_ingress(
        service_json("b", "younger", "10.96.1.2", &[], Some(2)),
        &["203.0.113.50"],
    );
    young_lb["spec"]["externalIPs"] = json!([]);
    let small = ModelConfig {
        max_frontends_per_service: 10,
        ..ModelConfig::default()
    };
    let listed = ModelConfig {
        external_ip_cidrs: Some(vec![Cidr::parse("198.51.100.0/24").unwrap()]),
        ..ModelConfig::default()
    };
    for (what, older, younger, config) in [
        (
            "another proxy's",
            &other_proxy,
            &young,
            ModelConfig::default(),
        ),
        ("over its budget", &too_big, &young, small),
        ("outside the allow-list", &other_proxy, &young_lb, listed),
    ] {
        let mut older = older.clone();
        if what == "outside the allow-list" {
            older["metadata"]["labels"] = json!({});
        }
        let mut state = ClusterState::new("node-a");
        for s in [&older, younger] {
            state.apply(SourceEvent::Apply(Object::service(&decode(s.clone()))));
        }
        let key = key_of(younger);
        let got = state
            .modelled_of(&key, state.service(&key), &config)
            .unwrap();
        assert_eq!(
            external_addresses(&got),
            vec![ip("203.0.113.50")],
            "the older is {what}: the younger is served ({:?})",
            got.refusals
        );
    }
    // The control: an older claim that is programmed wins.
    let mut state = ClusterState::new("node-a");
    let mut older = other_proxy;
    older["metadata"]["labels"] = json!({});
    for s in [&older, &young] {
        state.apply(SourceEvent::Apply(Object::service(&decode(s.clone()))));
    }
    assert_eq!(holders(&state, &[older, young]), vec![0]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the creation times (some missing, some equal) and whatever
    /// order the Services arrive in (one by one, or in listings of any
    /// order, or re-listed after a restart of the agent), the same Service
    /// holds the address: the least by (creation time, namespace, name).
    #[test]
    fn the_winner_does_not_depend_on_arrival_order(
        created in proptest::collection::vec(proptest::option::weighted(0.8, 0_u32..4), 2..6),
        order in Just((0..6).collect::<Vec<usize>>()).prop_shuffle(),
        as_listing in any::<bool>(),
    ) {
        let (services, winner) = claimants(&created);
        let order: Vec<usize> = order.into_iter().filter(|i| *i < services.len()).collect();
        let mut state = ClusterState::new("node-a");
        let objects = || -> Vec<Object> {
            order
                .iter()
                .map(|i| Object::service(&decode(services[*i].clone())))
                .collect()
        };
        if as_listing {
            state.apply(SourceEvent::Replace { kind: Kind::Service, objects: objects() });
        } else {
            for object in objects() {
                state.apply(SourceEvent::Apply(object));
            }
        }
        prop_assert_eq!(holders(&state, &services), vec![winner]);
        // An agent restarted: a fresh state, the listing in reverse.
        let mut restarted = ClusterState::new("node-a");
        let mut listing = objects();
        listing.reverse();
        restarted.apply(SourceEvent::Replace { kind: Kind::Service, objects: listing });
        prop_assert_eq!(holders(&restarted, &services), vec![winner]);
    }
}

// ---- budgets -------------------------------------------------------------------

#[test]
fn the_budget_counts_ports_times_addresses_as_the_model_makes_frontends() {
    let claims = AddressClaims::default();
    let unlimited = ModelConfig {
        max_frontends_per_service: u64::MAX,
        ..ModelConfig::default()
    };
    let ips: Vec<String> = (1..=5).map(|i| format!("203.0.113.{i}")).collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let mut cases: Vec<(&str, Value)> = Vec::new();
    cases.push((
        "ClusterIP alone",
        service_json("t", "a", "10.96.0.20", &[], None),
    ));
    let mut two_ports = service_json("t", "a", "10.96.0.20", &ips, None);
    two_ports["spec"]["ports"] = json!([
        {"name": "http", "port": 80, "protocol": "TCP"},
        {"name": "dns", "port": 53, "protocol": "UDP"},
    ]);
    cases.push(("2 ports x (ClusterIP + 5 externalIPs)", two_ports.clone()));
    let mut lb = with_ingress(two_ports.clone(), &["198.51.100.1", "2001:db8::1"]);
    lb["spec"]["ports"][0]["nodePort"] = json!(30080);
    cases.push((
        "with NodePort, LB IPs, one of a family without a ClusterIP",
        lb.clone(),
    ));
    let mut local = lb.clone();
    local["spec"]["externalTrafficPolicy"] = json!("Local");
    cases.push((
        "externalTrafficPolicy Local doubles the external ones",
        local,
    ));
    let mut dual = lb;
    dual["spec"]["clusterIPs"] = json!(["10.96.0.20", "fd00:96::20"]);
    dual["spec"]["externalIPs"] = json!(["203.0.113.1", "2001:db8::2"]);
    cases.push(("dual stack", dual));
    for (what, json) in cases {
        let service = compact(json);
        let made = modelled(&service, &claims, &unlimited).frontends.len() as u64;
        assert_eq!(service.frontend_count(), made, "{what}: counted as made");
        let at = ModelConfig {
            max_frontends_per_service: made,
            ..ModelConfig::default()
        };
        assert!(
            modelled(&service, &claims, &at).refusals.is_empty(),
            "{what}: exactly the budget is within it"
        );
        let below = ModelConfig {
            max_frontends_per_service: made - 1,
            ..ModelConfig::default()
        };
        let got = modelled(&service, &claims, &below);
        assert_eq!(
            got.frontends,
            Vec::new(),
            "{what}: over: refused as a whole"
        );
        assert_eq!(reasons(&got), vec![(Reason::Budget, None)], "{what}");
    }
}

#[test]
fn a_service_over_its_budget_is_kept_without_its_addresses() {
    let ips: Vec<String> = (0..3000)
        .map(|i| format!("198.18.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let mut json = service_json("t", "huge", "10.96.0.20", &ips, None);
    json["spec"]["ports"] = json!([
        {"name": "http", "port": 80, "protocol": "TCP"},
        {"name": "https", "port": 443, "protocol": "TCP"},
    ]);
    let mut service = compact(json);
    assert_eq!(service.frontend_count(), 2 * 3001);
    let kept = service.clone();
    assert!(service.shed_over(DEFAULT_MAX_FRONTENDS_PER_SERVICE));
    assert!(
        !service.shed_over(DEFAULT_MAX_FRONTENDS_PER_SERVICE),
        "once"
    );
    assert_eq!(
        AddressClaims::addresses_of(&service),
        vec![ip("10.96.0.20")]
    );
    assert_eq!(AddressClaims::addresses_of(&kept).len(), 3001);
    // Refused as a whole even by a model with a larger budget: what it
    // asked for is no longer known.
    let config = ModelConfig {
        max_frontends_per_service: 10_000,
        ..ModelConfig::default()
    };
    let got = modelled(&service, &AddressClaims::default(), &config);
    assert_eq!(got.frontends, Vec::new());
    assert_eq!(reasons(&got), vec![(Reason::Budget, None)]);
    let mut small = kept;
    assert!(!small.shed_over(6002), "within: kept whole");
}
