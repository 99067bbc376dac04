//! Each test builds kube-proxy's rules next to other software's in a network
//! namespace of its own (so they run in parallel and touch nothing of the
//! host's), then removes kube-proxy's and compares what is left with what was
//! there before.

use super::*;

/// Runs `f` on a thread of its own in a fresh network namespace with `lo` up;
/// every command `f` runs inherits the namespace.
fn in_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests create network namespaces and netfilter rules: run them as root"
    );
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        sh("ip", &["link", "set", "lo", "up"], None);
        f()
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

fn sh(program: &str, args: &[&str], stdin: Option<&str>) -> String {
    let path = tool(program).unwrap_or_else(|| panic!("{program} is needed by the tests"));
    run(&path, args, stdin).unwrap_or_else(|e| panic!("{e}"))
}

/// `*-save` output without its dated comments and with counters zeroed.
fn saved(backend: IptablesBackend, family: IpFamily) -> String {
    sh(&backend.tool(family, "save"), &[], None)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.rfind(" [")) {
            (true, Some(at)) => format!("{} [0:0]", &l[..at]),
            _ => l.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn restore(backend: IptablesBackend, family: IpFamily, rules: &str) {
    sh(
        &backend.tool(family, "restore"),
        &["--noflush", XTABLES_WAIT_SECONDS],
        Some(rules),
    );
}

/// Addresses of one family for the rule templates below.
fn fill(template: &str, family: IpFamily) -> String {
    let v4 = [
        ("{SVC1}", "10.96.0.10/32"),
        ("{SVC2}", "10.96.0.11/32"),
        ("{EP1}", "10.180.0.1/32"),
        ("{EP1:80}", "10.180.0.1:80"),
        ("{EP3:80}", "10.180.0.3:80"),
        ("{DOCKER_NET}", "172.17.0.0/16"),
        ("{LOOPBACK}", "127.0.0.0/8"),
        ("{UNREACHABLE}", "icmp-port-unreachable"),
    ];
    let v6 = [
        ("{SVC1}", "fd00:96::10/128"),
        ("{SVC2}", "fd00:96::11/128"),
        ("{EP1}", "fd00:180::1/128"),
        ("{EP1:80}", "[fd00:180::1]:80"),
        ("{EP3:80}", "[fd00:180::3]:80"),
        ("{DOCKER_NET}", "fd00:17::/64"),
        ("{LOOPBACK}", "::1/128"),
        ("{UNREACHABLE}", "icmp6-port-unreachable"),
    ];
    let pairs = match family {
        IpFamily::V4 => v4,
        IpFamily::V6 => v6,
    };
    pairs
        .iter()
        .fold(template.to_owned(), |s, (k, v)| s.replace(k, v))
}

/// Docker's and the kubelet's rules, which must come through untouched.
const OTHERS: &str = r#"*mangle
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-IPTABLES-HINT - [0:0]
COMMIT
*nat
:DOCKER - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-DROP - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A OUTPUT ! -d {LOOPBACK} -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -s {DOCKER_NET} ! -o docker0 -j MASQUERADE
-A DOCKER -i docker0 -j RETURN
-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000
COMMIT
*filter
:DOCKER - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -o docker0 -j DOCKER
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FIREWALL ! -s {LOOPBACK} -d {LOOPBACK} -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
COMMIT
"#;

/// kube-proxy's iptables mode (k/k pkg/proxy/iptables/proxier.go): a ClusterIP
/// service with one endpoint, a NodePort service, a service without endpoints,
/// the canaries, and the jumps it inserts at the head of the built-in chains.
const KUBE_PROXY: &str = r#"*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
:KUBE-EXT-X27LE4BHSL4DOUIK - [0:0]
:KUBE-SVC-X27LE4BHSL4DOUIK - [0:0]
:KUBE-SEP-OYPFS5VJICHGATKP - [0:0]
-I PREROUTING 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I OUTPUT 1 -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I POSTROUTING 1 -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-SERVICES -d {SVC1} -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-NODEPORTS -p tcp -m comment --comment "ns3/svc3:p80" -m tcp --dport 30080 -j KUBE-EXT-X27LE4BHSL4DOUIK
-A KUBE-EXT-X27LE4BHSL4DOUIK -m comment --comment "masquerade traffic for ns3/svc3:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-X27LE4BHSL4DOUIK -j KUBE-SVC-X27LE4BHSL4DOUIK
-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> {EP1:80}" -j KUBE-SEP-SXIVWICOYRO3J4NJ
-A KUBE-SEP-SXIVWICOYRO3J4NJ -s {EP1} -m comment --comment "ns1/svc1:p80" -j KUBE-MARK-MASQ
-A KUBE-SEP-SXIVWICOYRO3J4NJ -p tcp -m comment --comment "ns1/svc1:p80" -m tcp -j DNAT --to-destination {EP1:80}
-A KUBE-SVC-X27LE4BHSL4DOUIK -j KUBE-SEP-OYPFS5VJICHGATKP
-A KUBE-SEP-OYPFS5VJICHGATKP -p tcp -m tcp -j DNAT --to-destination {EP3:80}
COMMIT
*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-PROXY-CANARY - [0:0]
-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I INPUT 1 -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-I INPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I FORWARD 1 -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-I FORWARD 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-I OUTPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-I OUTPUT 1 -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A KUBE-SERVICES -d {SVC2} -p tcp -m comment --comment "ns2/svc2:p80 has no endpoints" -m tcp --dport 80 -j REJECT --reject-with {UNREACHABLE}
COMMIT
"#;

/// (table, chains, rules, jumps) per table, sorted by table.
fn shape(ipt: &IptablesLeftovers) -> Vec<(String, usize, usize, usize)> {
    let mut shape: Vec<_> = ipt
        .tables
        .iter()
        .map(|t| (t.table.clone(), t.chains.len(), t.rules, t.jumps.len()))
        .collect();
    shape.sort();
    shape
}

fn iptables_rules_are_removed_exactly(backend: IptablesBackend) {
    in_netns(move || {
        let families = [IpFamily::V4, IpFamily::V6];
        for family in families {
            restore(backend, family, &fill(OTHERS, family));
        }
        let before: Vec<String> = families.iter().map(|f| saved(backend, *f)).collect();
        for saved in &before {
            for other in [
                ":DOCKER - [0:0]",
                "-A INPUT -j KUBE-FIREWALL",
                "-A KUBE-MARK-DROP",
            ] {
                assert!(saved.contains(other), "{other} not in {saved}");
            }
        }
        for family in families {
            restore(backend, family, &fill(KUBE_PROXY, family));
        }

        let found = find().unwrap();
        eprintln!("{found}");
        assert!(found.nftables.is_empty() && !found.ipvs_link, "{found}");
        assert_eq!(
            found
                .iptables
                .iter()
                .map(|i| (i.backend, i.family))
                .collect::<Vec<_>>(),
            vec![(backend, IpFamily::V4), (backend, IpFamily::V6)],
            "{found}"
        );
        for ipt in &found.iptables {
            assert_eq!(
                shape(ipt),
                vec![
                    ("filter".to_owned(), 6, 4, 9),
                    ("mangle".to_owned(), 1, 0, 0),
                    ("nat".to_owned(), 10, 14, 3),
                ],
                "{found}"
            );
            for t in &ipt.tables {
                for kubelets in ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-MARK-DROP"] {
                    assert!(!t.chains.iter().any(|c| c == kubelets), "{t:?}");
                }
            }
        }
        let display = found.to_string();
        for part in [
            format!("{backend} IPv4: "),
            format!("{backend} IPv6: "),
            "nat (10 chains, 14 rules, 3 jumps from other chains)".to_owned(),
            "filter (6 chains, 4 rules, 9 jumps from other chains)".to_owned(),
            "mangle (1 chains, 0 rules, 0 jumps from other chains)".to_owned(),
        ] {
            assert!(display.contains(&part), "{part} not in {display}");
        }

        let removed = remove(&found).unwrap();
        eprintln!("{removed}");
        assert_eq!(removed.0.iptables.len(), 2, "{removed}");
        for (r, f) in removed.0.iptables.iter().zip(&found.iptables) {
            assert_eq!(shape(r), shape(f));
        }
        let after: Vec<String> = families.iter().map(|f| saved(backend, *f)).collect();
        assert_eq!(after, before, "other rules changed");

        let again = find().unwrap();
        assert!(again.is_empty(), "{again}");
        assert!(remove(&again).unwrap().0.is_empty());
        // A stale report removes nothing more either.
        assert!(remove(&found).unwrap().0.is_empty());
        assert_eq!(
            families
                .iter()
                .map(|f| saved(backend, *f))
                .collect::<Vec<_>>(),
            before
        );
    });
}

#[test]
fn iptables_legacy_rules_are_removed_exactly() {
    iptables_rules_are_removed_exactly(IptablesBackend::Legacy);
}

#[test]
fn iptables_nft_rules_are_removed_exactly() {
    iptables_rules_are_removed_exactly(IptablesBackend::Nft);
}

/// kube-proxy's nftables mode (k/k pkg/proxy/nftables/proxier.go), in the
/// command form knftables feeds `nft -f`: base chains, masquerading, the
/// services verdict map and one service with one endpoint. `{F}` is both the
/// table's family and the address match keyword.
const KUBE_PROXY_NFT: &str = r#"add table {F} kube-proxy { comment "rules for kube-proxy" ; }
add chain {F} kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }
add chain {F} kube-proxy nat-output { type nat hook output priority -100 ; }
add chain {F} kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }
add chain {F} kube-proxy filter-forward { type filter hook forward priority -110 ; }
add chain {F} kube-proxy services
add chain {F} kube-proxy masquerading
add chain {F} kube-proxy mark-for-masquerade
add chain {F} kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80
add chain {F} kube-proxy {EPCHAIN}
add set {F} kube-proxy cluster-ips { type {ADDR} ; comment "Active ClusterIPs" ; }
add map {F} kube-proxy service-ips { type {ADDR} . inet_proto . inet_service : verdict ; comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }
add rule {F} kube-proxy nat-prerouting jump services
add rule {F} kube-proxy nat-output jump services
add rule {F} kube-proxy nat-postrouting jump masquerading
add rule {F} kube-proxy masquerading meta mark & 0x4000 == 0 return
add rule {F} kube-proxy masquerading meta mark set meta mark ^ 0x4000
add rule {F} kube-proxy masquerading masquerade fully-random
add rule {F} kube-proxy mark-for-masquerade meta mark set meta mark | 0x4000
add rule {F} kube-proxy services {F} daddr . meta l4proto . th dport vmap @service-ips
add rule {F} kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto {EPCHAIN} }
add rule {F} kube-proxy {EPCHAIN} {F} saddr {EP} jump mark-for-masquerade
add rule {F} kube-proxy {EPCHAIN} meta l4proto tcp dnat to {EP:80}
add element {F} kube-proxy cluster-ips { {VIP} }
add element {F} kube-proxy service-ips { {VIP} . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }
"#;

fn kube_proxy_nft(family: IpFamily) -> String {
    let (f, addr, ep, ep80, vip, chain) = match family {
        IpFamily::V4 => (
            "ip",
            "ipv4_addr",
            "10.180.0.1",
            "10.180.0.1:80",
            "10.96.0.10",
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80",
        ),
        IpFamily::V6 => (
            "ip6",
            "ipv6_addr",
            "fd00:180::1",
            "[fd00:180::1]:80",
            "fd00:96::10",
            "endpoint-2DLOXV2K-ns1/svc1/tcp/p80__fd00.180..1/80",
        ),
    };
    KUBE_PROXY_NFT
        .replace("{EPCHAIN}", chain)
        .replace("{ADDR}", addr)
        .replace("{EP:80}", ep80)
        .replace("{EP}", ep)
        .replace("{VIP}", vip)
        .replace("{F}", f)
}

#[test]
fn nftables_kube_proxy_tables_are_removed_and_others_kept() {
    in_netns(|| {
        sh(
            "nft",
            &["-f", "-"],
            Some(
                "table inet filter { chain input { type filter hook input priority 0; policy accept; tcp dport 22 accept; }; }\n\
                 table ip docker-nat { chain post { type nat hook postrouting priority 100; ip saddr 172.17.0.0/16 masquerade; }; }\n\
                 table ip6 kube-proxy-not { chain c { ip6 saddr ::1 accept; }; }\n",
            ),
        );
        let before = sh("nft", &["list", "ruleset"], None);
        for family in [IpFamily::V4, IpFamily::V6] {
            sh("nft", &["-f", "-"], Some(&kube_proxy_nft(family)));
        }

        let found = find().unwrap();
        eprintln!("{found}");
        assert!(found.iptables.is_empty(), "{found}");
        let expected = |family: &str| NftLeftovers {
            family: family.to_owned(),
            chains: 9,
            rules: 11,
            sets: 2,
        };
        assert_eq!(found.nftables, vec![expected("ip"), expected("ip6")]);
        assert!(
            found
                .to_string()
                .contains("nftables table ip6 kube-proxy (9 chains, 11 rules, 2 sets and maps)"),
            "{found}"
        );

        let removed = remove(&found).unwrap();
        assert_eq!(removed.0.nftables, found.nftables);
        assert_eq!(sh("nft", &["list", "ruleset"], None), before);
        let again = find().unwrap();
        assert!(again.is_empty(), "{again}");
        assert!(remove(&found).unwrap().0.is_empty());
    });
}

#[test]
fn ipvs_link_is_removed_and_others_kept() {
    in_netns(|| {
        // This kernel has no dummy driver: a bridge stands in for kube-ipvs0,
        // whose removal goes by name alone.
        sh("ip", &["link", "add", IPVS_LINK, "type", "bridge"], None);
        sh("ip", &["link", "add", "docker0", "type", "bridge"], None);
        let found = find().unwrap();
        assert!(found.ipvs_link, "{found}");
        assert!(found.to_string().contains("link kube-ipvs0"), "{found}");
        let removed = remove(&found).unwrap();
        assert!(removed.0.ipvs_link, "{removed}");
        assert!(!link_exists(IPVS_LINK));
        assert!(link_exists("docker0"));
        assert!(find().unwrap().is_empty());
        assert!(remove(&found).unwrap().0.is_empty());
    });
}

#[test]
fn nat_keepalive_tables_come_and_go() {
    in_netns(|| {
        let tables = || sh("nft", &["list", "tables"], None);
        keep_nat_alive().unwrap();
        keep_nat_alive().unwrap();
        let listed = tables();
        assert!(listed.contains("table ip ebpf-proxy-nat"), "{listed}");
        assert!(listed.contains("table ip6 ebpf-proxy-nat"), "{listed}");
        for family in ["ip", "ip6"] {
            let table = sh("nft", &["list", "table", family, NAT_KEEPALIVE_TABLE], None);
            assert!(
                table.contains("type nat hook postrouting priority srcnat + 1; policy accept;"),
                "{table}"
            );
            assert_eq!(table.matches("chain ").count(), 1, "{table}");
            assert_eq!(table.matches("ct state new accept").count(), 1, "{table}");
        }
        assert!(
            find().unwrap().is_empty(),
            "the keep-alive is not kube-proxy's"
        );
        assert!(release_nat().unwrap());
        assert!(!tables().contains(NAT_KEEPALIVE_TABLE), "{}", tables());
        assert!(!release_nat().unwrap());
    });
}

#[test]
fn jumps_are_read_past_quotes() {
    assert_eq!(
        target(r#"-A OUTPUT -m comment --comment "a \"q\" -j KUBE-SERVICES" -j DOCKER"#),
        Some("DOCKER".to_owned())
    );
    assert_eq!(
        target("-A FORWARD -g KUBE-FORWARD"),
        Some("KUBE-FORWARD".to_owned())
    );
    assert_eq!(target("-A KUBE-POSTROUTING -m mark --mark 0x4000"), None);
}

#[test]
fn restore_input_unlinks_flushes_and_deletes() {
    let save = "# Generated\n*nat\n:PREROUTING ACCEPT [3:180]\n:DOCKER - [0:0]\n\
                :KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n\
                -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                -A PREROUTING -j DOCKER\n-A DOCKER -g KUBE-SVC-X\n\
                -A KUBE-SERVICES -j KUBE-SVC-X\nCOMMIT\n\
                *filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n";
    let tables = leftovers_in(save);
    assert_eq!(
        tables.len(),
        1,
        "the filter table holds nothing of kube-proxy's"
    );
    assert_eq!(
        restore_input(&tables[0]),
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n\
         -D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -D DOCKER -g KUBE-SVC-X\n-X KUBE-SERVICES\n-X KUBE-SVC-X\nCOMMIT\n"
    );
}

/// How kube-proxy's DNAT of 10.96.0.10:80 to 127.0.0.1:8080 is loaded.
#[derive(Clone, Copy)]
enum Mode {
    Nftables,
    Iptables(IptablesBackend),
}

/// A connection kube-proxy's rules translated, then `hold` run and kube-proxy's
/// rules removed: whether the connection still echoes, and the echo afterwards
/// for `then`.
fn flow_after_removal(
    mode: Mode,
    hold: impl FnOnce() + Send + 'static,
    then: impl FnOnce() + Send + 'static,
) -> (bool, bool) {
    use std::{
        io::{Read as _, Write as _},
        net::{TcpListener, TcpStream},
        time::Duration,
    };
    in_netns(move || {
        sh("ip", &["addr", "add", "10.96.0.10/32", "dev", "lo"], None);
        match mode {
            Mode::Nftables => {
                sh(
                    "nft",
                    &["-f", "-"],
                    Some(
                        "table ip kube-proxy {\n\
                         chain nat-output { type nat hook output priority -100; ip daddr 10.96.0.10 tcp dport 80 dnat to 127.0.0.1:8080; }\n\
                         }\n",
                    ),
                );
            }
            Mode::Iptables(backend) => restore(
                backend,
                IpFamily::V4,
                "*nat\n:KUBE-SERVICES - [0:0]\n\
                 -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                 -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination 127.0.0.1:8080\n\
                 COMMIT\n",
            ),
        }
        let listener = TcpListener::bind("127.0.0.1:8080").unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1];
            while conn.read_exact(&mut buf).is_ok() && conn.write_all(&buf).is_ok() {}
        });
        let mut client = TcpStream::connect("10.96.0.10:80").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let mut echo = |byte: u8| {
            let mut buf = [0u8; 1];
            client.write_all(&[byte]).is_ok()
                && client.read_exact(&mut buf).is_ok()
                && buf[0] == byte
        };
        assert!(echo(1), "translated by kube-proxy's rule");

        hold();
        let removed = remove(&find().unwrap()).unwrap();
        assert!(!removed.0.is_empty(), "{removed}");
        let kept = echo(2);
        then();
        (kept, echo(3))
    })
}

/// The reason for [`keep_nat_alive`]: a connection kube-proxy's rules
/// translated keeps being translated by its conntrack entry once the rules are
/// gone, while the keep-alive exists, and is cut once that goes too.
#[test]
fn nat_keepalive_keeps_established_flows_translated() {
    let (kept, after_release) = flow_after_removal(
        Mode::Nftables,
        || keep_nat_alive().unwrap(),
        || assert!(release_nat().unwrap()),
    );
    assert!(kept, "translated by its conntrack entry alone");
    assert!(!after_release, "no hook left to translate it");
}

/// The same for kube-proxy's iptables mode: the nat table and its built-in
/// chains, which outlive kube-proxy's rules, do not keep a flow translated
/// either, and the keep-alive does.
#[test]
fn nat_keepalive_keeps_flows_of_iptables_mode_translated() {
    for backend in [IptablesBackend::Legacy, IptablesBackend::Nft] {
        let (kept, _) = flow_after_removal(Mode::Iptables(backend), || {}, || {});
        assert!(!kept, "{backend}: kept without the keep-alive");
        let (kept, _) =
            flow_after_removal(Mode::Iptables(backend), || keep_nat_alive().unwrap(), || {});
        assert!(kept, "{backend}: translated by its conntrack entry alone");
    }
}

/// Why the keep-alive chain holds a `ct` rule: an empty nat chain keeps NAT's
/// hooks but not conntrack's, and the connection is cut all the same.
#[test]
fn an_empty_nat_chain_does_not_keep_flows_translated() {
    let (kept, _) = flow_after_removal(
        Mode::Nftables,
        || {
            sh(
                "nft",
                &["-f", "-"],
                Some(
                    "add table ip empty-nat\nadd chain ip empty-nat c { type nat hook postrouting priority srcnat + 1 ; policy accept ; }\n",
                ),
            );
        },
        || {},
    );
    assert!(
        !kept,
        "this kernel kept conntrack's hooks for an empty nat chain"
    );
}
