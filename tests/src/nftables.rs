//! kube-proxy's nftables mode, reproduced: the `ip kube-proxy` table it writes for
//! ClusterIP services (`ip6 kube-proxy` for IPv6 ones, [`crate::iptables::KubeService6`]:
//! kube-proxy runs one proxier, and so one table, per family), loaded into a namespace with `nft -f`, so a benchmark can put
//! kube-proxy's O(1) verdict-map datapath next to ours and next to the iptables
//! cascade on the same endpoints.
//!
//! What is copied (k/k `pkg/proxy/nftables/proxier.go` @b0f823e6, `setupNFTables`,
//! `syncProxyRules`, `writeServiceToEndpointRules`; docs/kube-proxy-semantics.md
//! §1.4 and §2.2), in the text form knftables hands to `nft -f`:
//! - the base chains with their hooks and numeric priorities (knftables turns
//!   `dstnat-10` into `-110` because older nft refuses some named priorities), and the
//!   jump rules from them, `ct state new` filters included;
//! - dispatch through the `service-ips` verdict map keyed by
//!   `ipv4_addr . inet_proto . inet_service`, each element a `goto` to the service chain;
//! - chain names `service-`/`endpoint-`/`affinity-` + base32(sha256(name))[:8] + `-` +
//!   `ns/name/proto/port[__ip/port]`, an IPv6 endpoint's colons written as dots (a
//!   chain name cannot hold a colon);
//! - IPv6: `ip6` for `ip` in the table's family and in every address match, and
//!   `ipv6_addr` for `ipv4_addr` in every set and map type;
//! - one draw per connection: `numgen random mod N vmap { 0 : goto endpoint-…, … }`
//!   over the endpoints sorted by their `ip:port` string (the order kube-proxy's shared
//!   endpoint cache gives both modes);
//! - endpoint chains that mark hairpin traffic for masquerade and `dnat to ip:port`;
//! - sessionAffinity ClientIP: a timeout set per endpoint, `ip saddr @affinity-… goto
//!   endpoint-…` ahead of the numgen rule, `update @affinity-… { ip saddr }` before the
//!   DNAT;
//! - the `cluster-ips` set, the masquerade chains, the (empty) no-endpoint and firewall
//!   maps every new connection is looked up in, and `nodeport-ips` holding the node's
//!   addresses (kube-proxy's default `--nodeport-addresses primary`).
//!
//! Left out, as in [`crate::iptables`]: the "masquerade off-cluster traffic" rule (needs
//! the cluster CIDR; no client here is off-cluster), the "drop traffic to unallocated
//! ClusterIPs" rule (needs the service CIDRs), externalTrafficPolicy Local, external
//! IPs and load balancers.
//!
//! NodePorts with externalTrafficPolicy Cluster ([`ruleset_with_node_ports`]): an
//! `external-HASH-…` chain per port that jumps to `mark-for-masquerade` (all of it
//! is masqueraded, as it may cross nodes) and goes to the service
//! chain, and its `service-nodeports` element `proto . nodePort : goto external-…`,
//! which the `services` chain consults for `nodeport-ips`. A service without endpoints is refused rather than written into
//! `no-endpoint-services`, as the iptables writer does.

use std::{fmt::Write as _, io::Write, process::Stdio};

use anyhow::{Context, Result, bail};

use crate::{
    describe,
    iptables::{Family, KubeService, base32, sha256},
    netns::NetNs,
};

/// kube-proxy's table; everything it writes lives inside it.
pub const TABLE: &str = "kube-proxy";

/// kube-proxy's default masquerade mark (1 << 14).
const MASQ_MARK: &str = "0x4000";

/// `ip kube-proxy` (`ip6 kube-proxy`): the table every command names.
fn table<A: Family>() -> String {
    format!("{} {TABLE}", A::NFT_FAMILY)
}

/// knftables' `NameLengthMax` (256) minus `chainNamePrefixLengthMax` (16).
const CHAIN_NAME_BASE_LENGTH_MAX: usize = 240;

/// The base chains: name, type, hook, priority (numeric, as knftables writes it).
const BASE_CHAINS: [(&str, &str, &str, i32); 8] = [
    ("filter-prerouting", "filter", "prerouting", -110),
    ("filter-input", "filter", "input", -110),
    ("filter-forward", "filter", "forward", -110),
    ("filter-output", "filter", "output", -110),
    ("filter-output-post-dnat", "filter", "output", -90),
    ("nat-prerouting", "nat", "prerouting", -100),
    ("nat-output", "nat", "output", -100),
    ("nat-postrouting", "nat", "postrouting", 100),
];

/// `nftablesJumpChains`: (destination, source base chain, condition), in kube-proxy's
/// order.
const JUMP_CHAINS: [(&str, &str, &str); 11] = [
    ("nodeport-endpoints-check", "filter-input", "ct state new "),
    ("service-endpoints-check", "filter-input", "ct state new "),
    ("service-endpoints-check", "filter-forward", "ct state new "),
    ("service-endpoints-check", "filter-output", "ct state new "),
    ("firewall-check", "filter-prerouting", "ct state new "),
    ("firewall-check", "filter-output", "ct state new "),
    ("services", "nat-output", ""),
    ("services", "nat-prerouting", ""),
    ("masquerading", "nat-postrouting", ""),
    ("cluster-ips-check", "filter-forward", "ct state new "),
    (
        "cluster-ips-check",
        "filter-output-post-dnat",
        "ct state new ",
    ),
];

/// `hashAndTruncate`: the name prefixed with base32(sha256(name))[:8], truncated to
/// what a chain name may hold.
fn hash_and_truncate(name: &str) -> String {
    let hash = base32(&sha256(name.as_bytes()));
    let mut out = format!("{}-{name}", &hash[..8]);
    if out.len() > CHAIN_NAME_BASE_LENGTH_MAX {
        out.truncate(CHAIN_NAME_BASE_LENGTH_MAX - 3);
        out.push_str("...");
    }
    out
}

/// `servicePortChainNameBase`: `HASH-ns/name/proto/port`.
fn service_base<A: Family>(svc: &KubeService<A>) -> String {
    hash_and_truncate(&format!(
        "{}/{}/{}/{}",
        svc.namespace,
        svc.name,
        svc.protocol.lower(),
        svc.port_name
    ))
}

/// `servicePortEndpointChainNameBase`: `HASH-ns/name/proto/port__ip/port`, an IPv6
/// address's colons replaced by dots.
fn endpoint_base<A: Family>(svc: &KubeService<A>, ep: A::Endpoint) -> String {
    hash_and_truncate(&format!(
        "{}/{}/{}/{}__{}/{}",
        svc.namespace,
        svc.name,
        svc.protocol.lower(),
        svc.port_name,
        A::endpoint_ip(ep).to_string().replace(':', "."),
        A::endpoint_port(ep)
    ))
}

/// The service port's cluster-policy chain, `service-HASH-ns/name/proto/port`.
pub fn service_chain<A: Family>(svc: &KubeService<A>) -> String {
    format!("service-{}", service_base(svc))
}

/// The service port's external-traffic chain (NodePorts),
/// `external-HASH-ns/name/proto/port`.
pub fn external_chain<A: Family>(svc: &KubeService<A>) -> String {
    format!("external-{}", service_base(svc))
}

/// An endpoint's chain, `endpoint-HASH-ns/name/proto/port__ip/port`.
pub fn endpoint_chain<A: Family>(svc: &KubeService<A>, ep: A::Endpoint) -> String {
    format!("endpoint-{}", endpoint_base(svc, ep))
}

/// An endpoint's sessionAffinity set, `affinity-HASH-…` (same base as its chain).
pub fn affinity_set<A: Family>(svc: &KubeService<A>, ep: A::Endpoint) -> String {
    format!("affinity-{}", endpoint_base(svc, ep))
}

/// The transaction kube-proxy's first full sync would run for `services`, as `nft -f`
/// input. It starts by deleting any previous `ip kube-proxy` (`ip6 kube-proxy`) table (the `add` first
/// makes the `delete` valid when there is none), so applying it twice replaces.
/// `node_ips` fill `nodeport-ips`.
pub fn ruleset<A: Family>(services: &[KubeService<A>], node_ips: &[A]) -> Result<String> {
    ruleset_of(services.iter().map(|svc| (svc, None)), node_ips)
}

/// [`ruleset`] for service ports that may have a `nodePort` (externalTrafficPolicy
/// Cluster): `(port, Some(nodePort))`, or `(port, None)` for a ClusterIP-only one.
pub fn ruleset_with_node_ports<A: Family>(
    services: &[(KubeService<A>, Option<u16>)],
    node_ips: &[A],
) -> Result<String> {
    ruleset_of(services.iter().map(|(svc, np)| (svc, *np)), node_ips)
}

#[expect(
    clippy::too_many_lines,
    reason = "the ruleset, written in the order nft prints it"
)]
fn ruleset_of<'a, A: Family>(
    services: impl Iterator<Item = (&'a KubeService<A>, Option<u16>)>,
    node_ips: &[A],
) -> Result<String> {
    let t = table::<A>();
    let (ip, addr) = (A::NFT_FAMILY, A::NFT_ADDR);
    let mut out = String::new();
    let mut w = |line: String| {
        out.push_str(&line);
        out.push('\n');
    };
    w(format!("add table {t}"));
    w(format!("delete table {t}"));
    w(format!(
        "add table {t} {{ comment \"rules for kube-proxy\" ; }}"
    ));

    // Containers and chains first: a rule or element may only refer to what exists.
    for (name, kind, hook, priority) in BASE_CHAINS {
        w(format!(
            "add chain {t} {name} {{ type {kind} hook {hook} priority {priority} ; }}"
        ));
    }
    for chain in [
        "nodeport-endpoints-check",
        "service-endpoints-check",
        "firewall-check",
        "services",
        "masquerading",
        "cluster-ips-check",
        "mark-for-masquerade",
    ] {
        w(format!("add chain {t} {chain}"));
    }
    w(format!(
        "add chain {t} reject-chain {{ comment \"helper for @no-endpoint-services / @no-endpoint-nodeports\" ; }}"
    ));
    w(format!(
        "add set {t} cluster-ips {{ type {addr} ; comment \"Active ClusterIPs\" ; }}"
    ));
    w(format!(
        "add set {t} nodeport-ips {{ type {addr} ; comment \"IPs that accept NodePort traffic\" ; }}"
    ));
    let addr_proto_port = format!("{addr} . inet_proto . inet_service : verdict");
    let proto_port = "inet_proto . inet_service : verdict";
    for (map, key, comment) in [
        (
            "no-endpoint-services",
            addr_proto_port.as_str(),
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            "no-endpoint-nodeports",
            proto_port,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            "firewall-ips",
            addr_proto_port.as_str(),
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        (
            "service-ips",
            addr_proto_port.as_str(),
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        ("service-nodeports", proto_port, "NodePort traffic"),
    ] {
        w(format!(
            "add map {t} {map} {{ type {key} ; comment \"{comment}\" ; }}"
        ));
    }

    for (dst, src, condition) in JUMP_CHAINS {
        w(format!("add rule {t} {src} {condition}jump {dst}"));
    }
    w(format!(
        "add rule {t} mark-for-masquerade mark set mark or {MASQ_MARK}"
    ));
    w(format!(
        "add rule {t} masquerading mark and {MASQ_MARK} == 0 return"
    ));
    w(format!(
        "add rule {t} masquerading mark set mark xor {MASQ_MARK}"
    ));
    w(format!("add rule {t} masquerading masquerade fully-random"));
    w(format!(
        "add rule {t} cluster-ips-check {ip} daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\""
    ));
    for node_ip in node_ips {
        w(format!("add element {t} nodeport-ips {{ {node_ip} }}"));
    }
    w(format!("add rule {t} reject-chain reject"));
    w(format!(
        "add rule {t} service-endpoints-check {ip} daddr . meta l4proto . th dport vmap @no-endpoint-services"
    ));
    w(format!(
        "add rule {t} nodeport-endpoints-check {ip} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports"
    ));
    w(format!(
        "add rule {t} firewall-check {ip} daddr . meta l4proto . th dport vmap @firewall-ips"
    ));
    w(format!(
        "add rule {t} services {ip} daddr . meta l4proto . th dport vmap @service-ips"
    ));
    w(format!(
        "add rule {t} services {ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports"
    ));

    for (svc, node_port) in services {
        write_service(&mut w, svc, node_port)?;
    }
    Ok(out)
}

/// One service port: its endpoint chains (and affinity sets), its service chain, and
/// its elements in `cluster-ips` and `service-ips`, in the order `syncProxyRules`
/// emits them (chains before anything that points at them).
fn write_service<A: Family>(
    w: &mut impl FnMut(String),
    svc: &KubeService<A>,
    node_port: Option<u16>,
) -> Result<()> {
    let t = table::<A>();
    let (ip, addr) = (A::NFT_FAMILY, A::NFT_ADDR);
    let endpoints = svc.sorted_endpoints();
    if endpoints.is_empty() {
        bail!(
            "{}: a service without endpoints goes to kube-proxy's no-endpoint-services \
             map, which this writer does not produce",
            svc.service_port_name()
        );
    }
    let proto = svc.protocol.lower();
    let svc_chain = service_chain(svc);
    if let Some(seconds) = svc.affinity_timeout {
        for ep in &endpoints {
            w(format!(
                "add set {t} {} {{ type {addr} ; flags dynamic,timeout ; timeout {seconds}s ; }}",
                affinity_set(svc, *ep)
            ));
        }
    }
    for ep in &endpoints {
        let chain = endpoint_chain(svc, *ep);
        w(format!("add chain {t} {chain}"));
        // Hairpin: a backend reaching itself through the service must be SNATed.
        w(format!(
            "add rule {t} {chain} {ip} saddr {} jump mark-for-masquerade",
            A::endpoint_ip(*ep)
        ));
        if svc.affinity_timeout.is_some() {
            w(format!(
                "add rule {t} {chain} update @{} {{ {ip} saddr }}",
                affinity_set(svc, *ep)
            ));
        }
        w(format!(
            "add rule {t} {chain} meta l4proto {proto} dnat to {ep}"
        ));
    }
    w(format!("add chain {t} {svc_chain}"));
    if svc.affinity_timeout.is_some() {
        for ep in &endpoints {
            w(format!(
                "add rule {t} {svc_chain} {ip} saddr @{} goto {}",
                affinity_set(svc, *ep),
                endpoint_chain(svc, *ep)
            ));
        }
    }
    let mut vmap = String::new();
    for (i, ep) in endpoints.iter().enumerate() {
        if i > 0 {
            vmap.push_str(" , ");
        }
        let _ = write!(vmap, "{i} : goto {}", endpoint_chain(svc, *ep));
    }
    w(format!(
        "add rule {t} {svc_chain} numgen random mod {} vmap {{ {vmap} }}",
        endpoints.len()
    ));
    w(format!(
        "add element {t} cluster-ips {{ {} }}",
        svc.cluster_ip
    ));
    w(format!(
        "add element {t} service-ips {{ {} . {proto} . {} : goto {svc_chain} }}",
        svc.cluster_ip, svc.port
    ));
    if let Some(node_port) = node_port {
        // externalTrafficPolicy Cluster: what comes in on the node port may go to
        // another node's endpoint, so it is masqueraded, then load-balanced like
        // the ClusterIP.
        let ext_chain = external_chain(svc);
        w(format!("add chain {t} {ext_chain}"));
        w(format!("add rule {t} {ext_chain} jump mark-for-masquerade"));
        w(format!("add rule {t} {ext_chain} goto {svc_chain}"));
        w(format!(
            "add element {t} service-nodeports {{ {proto} . {node_port} : goto {ext_chain} }}"
        ));
    }
    Ok(())
}

/// Replaces the `ip kube-proxy` (`ip6 kube-proxy`) table of `ns` with kube-proxy's
/// rules for `services`.
pub fn apply<A: Family>(ns: &NetNs, services: &[KubeService<A>], node_ips: &[A]) -> Result<()> {
    load(ns, &ruleset(services, node_ips)?)
}

/// [`apply`] with node ports ([`ruleset_with_node_ports`]).
pub fn apply_with_node_ports<A: Family>(
    ns: &NetNs,
    services: &[(KubeService<A>, Option<u16>)],
    node_ips: &[A],
) -> Result<()> {
    load(ns, &ruleset_with_node_ports(services, node_ips)?)
}

/// `nft -f -` of `input` in `ns`.
pub fn load(ns: &NetNs, input: &str) -> Result<()> {
    let mut cmd = ns.command("nft");
    cmd.args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {} (is nft installed?)", describe(&cmd)))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes())
        .with_context(|| format!("write the ruleset to {}", describe(&cmd)))?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        // nft names the failing line; the whole input can be tens of thousands of lines.
        let head: String = input.lines().take(60).collect::<Vec<_>>().join("\n");
        bail!(
            "nft -f in {} failed ({}): {}\nfirst lines of the input:\n{head}",
            ns.name(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::{
        Protocol,
        manifest::{Service, SessionAffinity},
    };

    fn ep(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    /// The service port through the manifest type, so the test does not depend on
    /// every field of [`KubeService`].
    fn kube(ns: &str, name: &str, vip: &str, eps: &[&str], affinity: Option<u32>) -> KubeService {
        let mut svc =
            Service::new(ns, name, vip.parse().unwrap()).port("p80", 80, Protocol::Tcp, 80);
        if affinity.is_some() {
            svc = svc.session_affinity(SessionAffinity::ClientIp {
                timeout_seconds: affinity,
            });
        }
        let ips: Vec<Ipv4Addr> = eps.iter().map(|s| ep(s)).collect();
        svc.kube_service("p80", svc.cluster_ip, &ips)
    }

    fn assert_has(ruleset: &str, lines: &[&str]) {
        for line in lines {
            assert!(
                ruleset.lines().any(|l| l == *line),
                "missing\n{line}\nin\n{ruleset}"
            );
        }
    }

    #[test]
    fn ipv6_table_matches_ip6_addresses_and_dots_endpoint_colons() {
        let svc = crate::iptables::KubeService6 {
            namespace: "ns1".into(),
            name: "svc1".into(),
            port_name: "p80".into(),
            protocol: Protocol::Tcp,
            cluster_ip: "fd00:96::1".parse().unwrap(),
            port: 80,
            endpoints: vec!["[fd00:10::1]:8080".parse().unwrap()],
            affinity_timeout: None,
        };
        let ep = svc.endpoints[0];
        let chain = endpoint_chain(&svc, ep);
        assert!(
            chain.starts_with("endpoint-") && chain.ends_with("-ns1/svc1/tcp/p80__fd00.10..1/8080"),
            "{chain}"
        );
        let rules = ruleset(
            std::slice::from_ref(&svc),
            &["fd00:100::1".parse().unwrap()],
        )
        .unwrap();
        assert_has(
            &rules,
            &[
                "add table ip6 kube-proxy { comment \"rules for kube-proxy\" ; }",
                "add set ip6 kube-proxy cluster-ips { type ipv6_addr ; comment \"Active ClusterIPs\" ; }",
                "add map ip6 kube-proxy service-ips { type ipv6_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }",
                "add rule ip6 kube-proxy services ip6 daddr . meta l4proto . th dport vmap @service-ips",
                "add element ip6 kube-proxy nodeport-ips { fd00:100::1 }",
                &format!(
                    "add rule ip6 kube-proxy {chain} ip6 saddr fd00:10::1 jump mark-for-masquerade"
                ),
                &format!(
                    "add rule ip6 kube-proxy {chain} meta l4proto tcp dnat to [fd00:10::1]:8080"
                ),
                &format!(
                    "add element ip6 kube-proxy service-ips {{ fd00:96::1 . tcp . 80 : goto {} }}",
                    service_chain(&svc)
                ),
            ],
        );
        assert!(
            !rules.contains(" ip ") && !rules.contains("ipv4_addr"),
            "IPv4 words in the IPv6 table:\n{rules}"
        );
    }

    #[test]
    fn names_match_kube_proxy() {
        // The examples in kube-proxy's own comments and test data
        // (pkg/proxy/nftables/proxier.go, proxier_test.go).
        let svc = kube("ns1", "svc1", "172.30.0.41", &["10.180.0.1"], None);
        assert_eq!(service_chain(&svc), "service-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(
            endpoint_chain(&svc, "10.180.0.1:80".parse().unwrap()),
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        let long = "x".repeat(300);
        assert_eq!(hash_and_truncate(&long).len(), CHAIN_NAME_BASE_LENGTH_MAX);
        assert!(hash_and_truncate(&long).ends_with("..."));
    }

    #[test]
    fn rules_match_kube_proxy() {
        // kube-proxy's TestOverallNFTablesRules expectations for ns1/svc1, ns4/svc4
        // (two endpoints) and ns5/svc5 (affinity), minus the off-cluster masquerade rule
        // this writer leaves out.
        let services = [
            kube("ns1", "svc1", "172.30.0.41", &["10.180.0.1"], None),
            kube(
                "ns4",
                "svc4",
                "172.30.0.44",
                &["10.180.0.5", "10.180.0.4"],
                None,
            ),
            kube("ns5", "svc5", "172.30.0.45", &["10.180.0.3"], Some(10_800)),
        ];
        let r = ruleset(&services, &[ep("192.168.0.2")]).unwrap();
        assert_has(
            &r,
            &[
                "add table ip kube-proxy { comment \"rules for kube-proxy\" ; }",
                "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }",
                "add chain ip kube-proxy filter-forward { type filter hook forward priority -110 ; }",
                "add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }",
                "add rule ip kube-proxy nat-prerouting jump services",
                "add rule ip kube-proxy filter-forward ct state new jump service-endpoints-check",
                "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
                "add rule ip kube-proxy services ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports",
                "add rule ip kube-proxy masquerading mark and 0x4000 == 0 return",
                "add rule ip kube-proxy masquerading masquerade fully-random",
                "add element ip kube-proxy nodeport-ips { 192.168.0.2 }",
                // ns1/svc1
                "add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80",
                "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 }",
                "add chain ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80",
                "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 ip saddr 10.180.0.1 jump mark-for-masquerade",
                "add rule ip kube-proxy endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 meta l4proto tcp dnat to 10.180.0.1:80",
                "add element ip kube-proxy cluster-ips { 172.30.0.41 }",
                "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }",
                // ns4/svc4: endpoints in sorted order whatever order they came in.
                "add rule ip kube-proxy service-LAUZTJTB-ns4/svc4/tcp/p80 numgen random mod 2 vmap { 0 : goto endpoint-UNZV3OEC-ns4/svc4/tcp/p80__10.180.0.4/80 , 1 : goto endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80 }",
                "add rule ip kube-proxy endpoint-5RFCDDV7-ns4/svc4/tcp/p80__10.180.0.5/80 meta l4proto tcp dnat to 10.180.0.5:80",
                // ns5/svc5 with sessionAffinity ClientIP.
                "add set ip kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }",
                "add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80",
                "add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 }",
                "add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 update @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { ip saddr }",
            ],
        );
        // The affinity check comes before the draw, and the update before the DNAT.
        let pos = |needle: &str| r.find(needle).unwrap_or_else(|| panic!("{needle}"));
        assert!(
            pos("ip saddr @affinity-GTK6MW7G") < pos("service-HVFWP5L3-ns5/svc5/tcp/p80 numgen")
        );
        assert!(pos("update @affinity-GTK6MW7G") < pos("dnat to 10.180.0.3:80"));
        // Every chain is added before anything refers to it.
        for (i, line) in r.lines().enumerate() {
            for target in line
                .split_whitespace()
                .collect::<Vec<_>>()
                .windows(2)
                .filter(|w| w[0] == "goto" || w[0] == "jump")
                .map(|w| w[1])
            {
                let added = r
                    .lines()
                    .position(|l| l.starts_with(&format!("add chain ip kube-proxy {target}")));
                assert!(
                    added.is_some_and(|a| a < i),
                    "line {i} refers to {target} before it exists: {line}"
                );
            }
        }
        assert!(!r.contains("recent"), "no iptables syntax: {r}");
    }

    #[test]
    fn node_ports_match_kube_proxy() {
        // kube-proxy's TestOverallNFTablesRules expectations for ns3/svc3, a NodePort
        // with externalTrafficPolicy Cluster.
        let svc = kube("ns3", "svc3", "172.30.0.43", &["10.180.0.3"], None);
        let r =
            ruleset_with_node_ports(&[(svc.clone(), Some(3003))], &[ep("192.168.0.2")]).unwrap();
        assert_has(
            &r,
            &[
                "add chain ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80",
                "add rule ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80 jump mark-for-masquerade",
                "add rule ip kube-proxy external-4AT6LBPK-ns3/svc3/tcp/p80 goto service-4AT6LBPK-ns3/svc3/tcp/p80",
                "add element ip kube-proxy service-nodeports { tcp . 3003 : goto external-4AT6LBPK-ns3/svc3/tcp/p80 }",
                "add element ip kube-proxy service-ips { 172.30.0.43 . tcp . 80 : goto service-4AT6LBPK-ns3/svc3/tcp/p80 }",
            ],
        );
        let pos = |needle: &str| r.find(needle).unwrap_or_else(|| panic!("{needle}"));
        assert!(pos("add chain ip kube-proxy external-") < pos("service-nodeports { tcp"));
        // Without a node port, the ruleset of `ruleset`.
        assert_eq!(
            ruleset_with_node_ports(&[(svc.clone(), None)], &[]).unwrap(),
            ruleset(&[svc], &[]).unwrap()
        );
    }

    #[test]
    fn services_without_endpoints_are_refused() {
        let svc = kube("ns1", "svc1", "172.30.0.41", &[], None);
        let err = ruleset(&[svc], &[]).unwrap_err();
        assert!(format!("{err:#}").contains("ns1/svc1:p80"), "{err:#}");
    }
}
