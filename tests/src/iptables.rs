//! kube-proxy's iptables mode, reproduced: the nat rules it writes for a ClusterIP
//! service, loaded into a namespace with `iptables-restore`, so a test can measure the
//! kernel's `statistic` cascade next to our datapath on the same endpoints.
//!
//! What is copied exactly (k/k `pkg/proxy/iptables/proxier.go`, see
//! docs/kube-proxy-semantics.md §1 and §2):
//! - chain names `KUBE-SVC-`/`KUBE-SEP-` + base32(sha256(...))[:16];
//! - endpoints sorted by their `ip:port` string;
//! - rule i of n has `-m statistic --mode random --probability` printed with `%0.10f`
//!   from 1/(n-i), the last rule has none;
//! - the KUBE-SEP chain marks hairpin traffic for masquerade and DNATs;
//! - sessionAffinity ClientIP (§2.1): one `-m recent --rcheck --seconds N --reap` rule
//!   per endpoint at the head of the KUBE-SVC chain, in the same sorted order, before
//!   the statistic rules, and `-m recent --set` in each KUBE-SEP chain before its DNAT;
//! - KUBE-SERVICES hooked from PREROUTING and OUTPUT, KUBE-POSTROUTING from POSTROUTING;
//! - NodePorts with externalTrafficPolicy Cluster (§2, [`nat_table_with_node_ports`]):
//!   KUBE-SERVICES ends with `-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS` (the
//!   default `localhostNodePorts`, so no `! -d 127.0.0.0/8`), which kube-proxy writes
//!   whether or not any Service has a NodePort; KUBE-NODEPORTS has one
//!   `--dport <nodePort> -j KUBE-EXT-<hash>` rule per node port, and the KUBE-EXT chain
//!   marks for masquerade (`-j KUBE-MARK-MASQ`) and then jumps to the KUBE-SVC chain.
//!
//! - IPv6 (kube-proxy runs one proxier per family): the same rules for `ip6tables`
//!   ([`KubeService6`]), endpoints written `[ip]:port` as Go's `net.JoinHostPort`
//!   does, which is also the string the chain names hash and the endpoints sort by;
//! - services without endpoints ([`filter_table`]): no nat chains, but in the filter
//!   table's KUBE-SERVICES, hooked from INPUT, FORWARD and OUTPUT for new
//!   connections, `-d <clusterIP> --dport <port> -j REJECT` with the comment
//!   `"<ns/name:port> has no endpoints"`. A REJECT without `--reject-with` answers
//!   `icmp-port-unreachable` (iptables) or `icmp6-port-unreachable` (ip6tables) to
//!   TCP and UDP alike, which a TCP `connect()` reports as "connection refused" too.
//!
//! - the backend ([`Backend`]): [`apply`] and its siblings run the family's
//!   `iptables-restore`, the nftables backend (`iptables-nft`) on Debian 12; the
//!   `*_with_backend` variants name the backend's own tool, `iptables-legacy-restore`
//!   for the legacy one (`x_tables`' `ip_tables`/`ip6_tables`), which kube-proxy uses on
//!   nodes whose other rules are there. The two backends do not see each other's
//!   rules: a legacy rule is only in `iptables-legacy-save`'s output.
//!
//! Left out: the optional "masquerade off-cluster traffic" rule (needs a local-traffic
//! detector; no client here is off-cluster), externalTrafficPolicy Local, externalIPs
//! and load-balancer IPs, and the rest of the filter table (KUBE-FORWARD's ACCEPTs,
//! which a namespace's ACCEPT policy makes moot, KUBE-EXTERNAL-SERVICES, the
//! firewall chains).

use std::{
    fmt::{Debug, Display},
    hash::Hash,
    io::Write,
    net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6},
    process::Stdio,
};

use anyhow::{Context, Result, bail};

use crate::{Protocol, describe, netns::NetNs};

/// kube-proxy's default masquerade mark (1 << 14).
const MASQ_MARK: &str = "0x4000";

/// An IP family kube-proxy writes rules for, one proxier each: its addresses
/// (`Ipv4Addr`, `Ipv6Addr`), its endpoints, and the names its tools give it.
pub trait Family: Copy + Ord + Hash + Display + Debug + Send + Sync + 'static {
    /// An endpoint: address and port. Its `Display` is Go's `net.JoinHostPort`
    /// (`10.0.0.1:80`, `[fd00::1]:80`), the string kube-proxy sorts endpoints by and
    /// hashes into chain names.
    type Endpoint: Copy + Ord + Hash + Display + Debug + Send + Sync + 'static;
    /// The restore tool of the family's rules.
    const RESTORE: &'static str;
    /// The family's name in iptables' tools (`iptables`, `ip6tables`), which
    /// [`Backend`] completes (`iptables-legacy-restore`).
    const XTABLES: &'static str;
    /// nftables' family of kube-proxy's table (`ip`, `ip6`), which is also the
    /// keyword of its address matches (`ip daddr`, `ip6 daddr`).
    const NFT_FAMILY: &'static str;
    /// nftables' type of the family's addresses.
    const NFT_ADDR: &'static str;
    fn endpoint(ip: Self, port: u16) -> Self::Endpoint;
    fn endpoint_ip(ep: Self::Endpoint) -> Self;
    fn endpoint_port(ep: Self::Endpoint) -> u16;
}

impl Family for Ipv4Addr {
    type Endpoint = SocketAddrV4;
    const RESTORE: &'static str = "iptables-restore";
    const XTABLES: &'static str = "iptables";
    const NFT_FAMILY: &'static str = "ip";
    const NFT_ADDR: &'static str = "ipv4_addr";
    fn endpoint(ip: Self, port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(ip, port)
    }
    fn endpoint_ip(ep: SocketAddrV4) -> Self {
        *ep.ip()
    }
    fn endpoint_port(ep: SocketAddrV4) -> u16 {
        ep.port()
    }
}

impl Family for Ipv6Addr {
    type Endpoint = SocketAddrV6;
    const RESTORE: &'static str = "ip6tables-restore";
    const XTABLES: &'static str = "ip6tables";
    const NFT_FAMILY: &'static str = "ip6";
    const NFT_ADDR: &'static str = "ipv6_addr";
    fn endpoint(ip: Self, port: u16) -> SocketAddrV6 {
        SocketAddrV6::new(ip, port, 0, 0)
    }
    fn endpoint_ip(ep: SocketAddrV6) -> Self {
        *ep.ip()
    }
    fn endpoint_port(ep: SocketAddrV6) -> u16 {
        ep.port()
    }
}

/// Which of iptables' two implementations holds kube-proxy's rules: kube-proxy
/// runs on nodes with either (it uses whichever the node's other rules are in), and
/// neither sees the other's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// `iptables-nft`: rules in nftables, as Debian 12's `iptables-restore` writes
    /// them.
    Nft,
    /// `iptables-legacy`: rules in `x_tables`' own tables (`ip_tables`, `ip6_tables`).
    Legacy,
}

impl Backend {
    /// The backend's restore tool for family `A` (`iptables-legacy-restore`,
    /// `ip6tables-nft-restore`, ...).
    pub fn restore<A: Family>(self) -> String {
        self.tool::<A>("restore")
    }

    /// The backend's save tool for family `A` (`iptables-legacy-save`, ...): the only
    /// one that prints the backend's rules.
    pub fn save<A: Family>(self) -> String {
        self.tool::<A>("save")
    }

    fn tool<A: Family>(self, verb: &str) -> String {
        let backend = match self {
            Self::Nft => "nft",
            Self::Legacy => "legacy",
        };
        format!("{}-{backend}-{verb}", A::XTABLES)
    }
}

/// One service port as kube-proxy's iptables mode sees it, of one IP family (IPv4
/// unless named: a dual-stack Service is one of these per family, as kube-proxy has
/// one proxier per family).
#[derive(Debug, Clone)]
pub struct KubeService<A: Family = Ipv4Addr> {
    pub namespace: String,
    pub name: String,
    /// The port's name; empty for an unnamed port.
    pub port_name: String,
    pub protocol: Protocol,
    pub cluster_ip: A,
    pub port: u16,
    /// The endpoints its service chain uses, in any order: the ready ones, or the
    /// serving-terminating fallback when none is ready.
    pub endpoints: Vec<A::Endpoint>,
    /// sessionAffinity ClientIP with this `timeoutSeconds` (kube-proxy's
    /// `StickyMaxAgeSeconds`); None for no affinity.
    pub affinity_timeout: Option<u32>,
}

/// An IPv6 service port, for `ip6tables`.
pub type KubeService6 = KubeService<Ipv6Addr>;

impl<A: Family> KubeService<A> {
    /// `ns/name:port` (or `ns/name` for an unnamed port), kube-proxy's `ServicePortName`.
    pub fn service_port_name(&self) -> String {
        if self.port_name.is_empty() {
            format!("{}/{}", self.namespace, self.name)
        } else {
            format!("{}/{}:{}", self.namespace, self.name, self.port_name)
        }
    }

    /// `KUBE-SVC-<hash>` (`servicePortChainName`).
    pub fn svc_chain(&self) -> String {
        format!(
            "KUBE-SVC-{}",
            chain_hash(&format!(
                "{}{}",
                self.service_port_name(),
                self.protocol.lower()
            ))
        )
    }

    /// `KUBE-EXT-<hash>` (`servicePortExternalChainName`): the same hash as the
    /// KUBE-SVC chain's.
    pub fn ext_chain(&self) -> String {
        format!(
            "KUBE-EXT-{}",
            chain_hash(&format!(
                "{}{}",
                self.service_port_name(),
                self.protocol.lower()
            ))
        )
    }

    /// `KUBE-SEP-<hash>` (`servicePortEndpointChainName`).
    pub fn sep_chain(&self, endpoint: A::Endpoint) -> String {
        format!(
            "KUBE-SEP-{}",
            chain_hash(&format!(
                "{}{}{endpoint}",
                self.service_port_name(),
                self.protocol.lower()
            ))
        )
    }

    /// Endpoints in kube-proxy's order: sorted by the `ip:port` string, which is
    /// lexicographic (`10.0.0.10:80` before `10.0.0.2:80`).
    pub fn sorted_endpoints(&self) -> Vec<A::Endpoint> {
        let mut eps = self.endpoints.clone();
        eps.sort_by_key(ToString::to_string);
        eps.dedup();
        eps
    }
}

/// `fmt.Sprintf("%0.10f", 1.0/float64(n))`. Rust's `{:.10}` rounds the exact binary
/// value correctly, like Go's formatter, so the strings are identical.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

/// The kernel's threshold for a `--probability` string: iptables parses it with strtod
/// and stores `lround(0x80000000 * p)`; `xt_statistic` matches when
/// `(get_random_u32() & 0x7fffffff) < threshold`.
pub fn statistic_threshold(probability: &str) -> u32 {
    let p: f64 = probability.parse().expect("a decimal probability");
    // f64::round rounds half away from zero, as lround does.
    (p * 2_147_483_648.0).round() as u32
}

/// The exact probability with which kube-proxy's cascade for `n` endpoints picks each
/// one (in sorted order): rule i matches with T(n-i)/2^31 given that no earlier rule
/// matched, and the last rule always matches.
pub fn cascade_probabilities(n: usize) -> Vec<f64> {
    assert!(n > 0);
    let mut remaining = 1.0f64;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let p = if i + 1 == n {
            1.0
        } else {
            f64::from(statistic_threshold(&probability(n - i))) / 2_147_483_648.0
        };
        out.push(remaining * p);
        remaining *= 1.0 - p;
    }
    out
}

/// The nat table kube-proxy would write for `services`, in `iptables-restore` format.
pub fn nat_table<A: Family>(services: &[KubeService<A>]) -> Result<String> {
    nat_rules(services.iter().map(|svc| (svc, None)))
}

/// [`nat_table`] for service ports that may have a `nodePort` (externalTrafficPolicy
/// Cluster): `(port, Some(nodePort))`, or `(port, None)` for a ClusterIP-only one.
pub fn nat_table_with_node_ports<A: Family>(
    services: &[(KubeService<A>, Option<u16>)],
) -> Result<String> {
    nat_rules(services.iter().map(|(svc, node_port)| (svc, *node_port)))
}

/// The filter table kube-proxy would write for `services`: for each one without
/// endpoints, the REJECT of its ClusterIP port (see the module doc); the others
/// have no rule in it. In `iptables-restore` format.
pub fn filter_table<A: Family>(services: &[KubeService<A>]) -> String {
    let mut out = String::from("*filter\n:KUBE-SERVICES - [0:0]\n");
    for hook in ["INPUT", "FORWARD", "OUTPUT"] {
        out.push_str(&format!(
            "-A {hook} -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n"
        ));
    }
    for svc in services.iter().filter(|s| s.endpoints.is_empty()) {
        let proto = svc.protocol.lower();
        out.push_str(&format!(
            "-A KUBE-SERVICES -m comment --comment {} -m {proto} -p {proto} -d {} --dport {} -j REJECT\n",
            quote(&format!("{} has no endpoints", svc.service_port_name())),
            svc.cluster_ip,
            svc.port
        ));
    }
    out.push_str("COMMIT\n");
    out
}

#[expect(
    clippy::too_many_lines,
    reason = "kube-proxy's rules for a Service, written in the order iptables-save prints them"
)]
fn nat_rules<'a, A: Family>(
    services: impl Iterator<Item = (&'a KubeService<A>, Option<u16>)>,
) -> Result<String> {
    let mut chains = vec![
        "KUBE-SERVICES".to_owned(),
        "KUBE-NODEPORTS".to_owned(),
        "KUBE-POSTROUTING".to_owned(),
        "KUBE-MARK-MASQ".to_owned(),
    ];
    let mut rules = vec![
        r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#
            .to_owned(),
        r#"-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#
            .to_owned(),
        r#"-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#
            .to_owned(),
        format!("-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"),
        format!("-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}"),
        r#"-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE"#
            .to_owned(),
        format!("-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}"),
    ];
    for (svc, node_port) in services {
        let endpoints = svc.sorted_endpoints();
        if endpoints.is_empty() {
            bail!(
                "{}: a service without endpoints gets a filter-table REJECT in kube-proxy, \
                 which this writer does not produce",
                svc.service_port_name()
            );
        }
        let spn = svc.service_port_name();
        let proto = svc.protocol.lower();
        let svc_chain = svc.svc_chain();
        chains.push(svc_chain.clone());
        rules.push(format!(
            "-A KUBE-SERVICES -m comment --comment {} -m {proto} -p {proto} -d {} --dport {} -j {svc_chain}",
            quote(&format!("{spn} cluster IP")),
            svc.cluster_ip,
            svc.port
        ));
        if let Some(node_port) = node_port {
            // externalTrafficPolicy Cluster: whatever comes in on the node port may go
            // to another node's endpoint, so it is masqueraded, then load-balanced
            // like the ClusterIP.
            let ext_chain = svc.ext_chain();
            chains.push(ext_chain.clone());
            rules.push(format!(
                "-A KUBE-NODEPORTS -m comment --comment {} -m {proto} -p {proto} --dport {node_port} -j {ext_chain}",
                quote(&spn)
            ));
            rules.push(format!(
                "-A {ext_chain} -m comment --comment {} -j KUBE-MARK-MASQ",
                quote(&format!(
                    "masquerade traffic for {spn} external destinations"
                ))
            ));
            rules.push(format!("-A {ext_chain} -j {svc_chain}"));
        }
        if let Some(seconds) = svc.affinity_timeout {
            // Clients seen recently by an endpoint's chain go straight back to it; the
            // first match in sorted endpoint order wins (`writeServiceToEndpointRules`).
            for ep in &endpoints {
                let sep = svc.sep_chain(*ep);
                rules.push(format!(
                    "-A {svc_chain} -m comment --comment {} -m recent --name {sep} \
                     --rcheck --seconds {seconds} --reap -j {sep}",
                    quote(&format!("{spn} -> {ep}"))
                ));
            }
        }
        let n = endpoints.len();
        for (i, ep) in endpoints.iter().enumerate() {
            let sep = svc.sep_chain(*ep);
            let statistic = if i + 1 < n {
                format!(
                    " -m statistic --mode random --probability {}",
                    probability(n - i)
                )
            } else {
                // The final rule is a guaranteed match.
                String::new()
            };
            rules.push(format!(
                "-A {svc_chain} -m comment --comment {}{statistic} -j {sep}",
                quote(&format!("{spn} -> {ep}"))
            ));
        }
        for ep in &endpoints {
            let sep = svc.sep_chain(*ep);
            chains.push(sep.clone());
            rules.push(format!(
                "-A {sep} -m comment --comment {} -s {} -j KUBE-MARK-MASQ",
                quote(&spn),
                A::endpoint_ip(*ep)
            ));
            // nat chains see only the first packet of a connection, so `--set` stamps
            // the client once per new connection to this endpoint.
            let recent = if svc.affinity_timeout.is_some() {
                format!(" -m recent --name {sep} --set")
            } else {
                String::new()
            };
            rules.push(format!(
                "-A {sep} -m comment --comment {}{recent} -m {proto} -p {proto} -j DNAT --to-destination {ep}",
                quote(&spn)
            ));
        }
    }
    // After every service's rules: whatever is addressed to the node itself may be
    // for a node port.
    rules.push(
        r#"-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"#
            .to_owned(),
    );
    let mut out = String::from("*nat\n");
    for chain in chains {
        out.push_str(&format!(":{chain} - [0:0]\n"));
    }
    for rule in rules {
        out.push_str(&rule);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    Ok(out)
}

/// Replaces the nat table of `ns` (of `services`' family) with kube-proxy's rules for
/// `services`, with the family's `iptables-restore`.
pub fn apply<A: Family>(ns: &NetNs, services: &[KubeService<A>]) -> Result<()> {
    restore(ns, A::RESTORE, &nat_table(services)?)
}

/// [`apply`] in `backend`'s tables, with its own restore tool
/// ([`Backend::restore`]).
pub fn apply_with_backend<A: Family>(
    ns: &NetNs,
    services: &[KubeService<A>],
    backend: Backend,
) -> Result<()> {
    restore(ns, &backend.restore::<A>(), &nat_table(services)?)
}

/// [`apply`] with node ports ([`nat_table_with_node_ports`]).
pub fn apply_with_node_ports<A: Family>(
    ns: &NetNs,
    services: &[(KubeService<A>, Option<u16>)],
) -> Result<()> {
    restore(ns, A::RESTORE, &nat_table_with_node_ports(services)?)
}

/// [`apply_with_node_ports`] in `backend`'s tables, with its own restore tool
/// ([`Backend::restore`]).
pub fn apply_with_node_ports_with_backend<A: Family>(
    ns: &NetNs,
    services: &[(KubeService<A>, Option<u16>)],
    backend: Backend,
) -> Result<()> {
    restore(
        ns,
        &backend.restore::<A>(),
        &nat_table_with_node_ports(services)?,
    )
}

/// [`apply`] for services with or without endpoints: the nat table for those with
/// endpoints, and the filter table's REJECTs ([`filter_table`]) for those without.
pub fn apply_with_rejects<A: Family>(ns: &NetNs, services: &[KubeService<A>]) -> Result<()> {
    let with: Vec<KubeService<A>> = services
        .iter()
        .filter(|s| !s.endpoints.is_empty())
        .cloned()
        .collect();
    restore(
        ns,
        A::RESTORE,
        &format!("{}{}", nat_table(&with)?, filter_table(services)),
    )
}

/// `tool` (`iptables-restore` or another restore tool) of `input` in `ns`.
fn restore(ns: &NetNs, tool: &str, input: &str) -> Result<()> {
    let mut cmd = ns.command(tool);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", describe(&cmd)))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes())?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "{tool} in {} failed ({}): {}\ninput was:\n{input}",
            ns.name(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Quotes a comment the way kube-proxy's rule writer does: only when it has spaces.
fn quote(s: &str) -> String {
    if s.contains(' ') {
        format!("\"{s}\"")
    } else {
        s.to_owned()
    }
}

/// `base32.StdEncoding.EncodeToString(sha256.Sum256(s))[:16]`, kube-proxy's
/// `portProtoHash`.
fn chain_hash(s: &str) -> String {
    let digest = sha256(s.as_bytes());
    base32(&digest)[..16].to_owned()
}

/// RFC 4648 base32 (standard alphabet); padding is irrelevant for a 16-char prefix.
/// Shared with [`crate::nftables`], whose chain names hash the same way.
pub(crate) fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::new();
    let mut buffer = 0u32;
    let mut bits = 0;
    for &byte in data {
        buffer = (buffer << 8) | u32::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// FIPS 180-4 SHA-256, only for chain names (a crypto crate would be the harness's
/// heaviest dependency for a few hashes per test).
#[expect(
    clippy::many_single_char_names,
    reason = "the names FIPS 180-4 gives the working variables, so the rounds can be checked against it"
)]
pub(crate) fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes(word.try_into().expect("4 bytes"));
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (acc, v) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *acc = acc.wrapping_add(v);
        }
    }
    let mut out = [0u8; 32];
    for (chunk, word) in out.chunks_exact_mut(4).zip(h) {
        chunk.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn sha256_matches_fips_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
    }

    #[test]
    fn base32_matches_rfc4648_vectors() {
        assert_eq!(base32(b"f"), "MY");
        assert_eq!(base32(b"foob"), "MZXW6YQ");
        assert_eq!(base32(b"foobar"), "MZXW6YTBOI");
    }

    fn svc1() -> KubeService {
        KubeService {
            namespace: "ns1".into(),
            name: "svc1".into(),
            port_name: "p80".into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(10, 20, 30, 41),
            port: 80,
            endpoints: vec!["10.180.0.1:80".parse().unwrap()],
            affinity_timeout: None,
        }
    }

    #[test]
    fn backends_name_their_own_tools() {
        assert_eq!(
            Backend::Legacy.restore::<Ipv4Addr>(),
            "iptables-legacy-restore"
        );
        assert_eq!(Backend::Legacy.save::<Ipv6Addr>(), "ip6tables-legacy-save");
        assert_eq!(Backend::Nft.restore::<Ipv6Addr>(), "ip6tables-nft-restore");
        assert_eq!(Backend::Nft.save::<Ipv4Addr>(), "iptables-nft-save");
    }

    #[test]
    fn chain_names_match_kube_proxy() {
        // From kube-proxy's own test data (pkg/proxy/iptables/proxier_test.go).
        let svc = svc1();
        assert_eq!(svc.svc_chain(), "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert_eq!(
            svc.sep_chain("10.180.0.1:80".parse().unwrap()),
            "KUBE-SEP-SXIVWICOYRO3J4NJ"
        );
    }

    #[test]
    fn rules_match_kube_proxy_for_one_endpoint() {
        let table = nat_table(&[svc1()]).unwrap();
        for line in [
            r#"-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 10.20.30.41 --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O"#,
            r#"-A KUBE-SVC-XPGD46QRK7WJZT7O -m comment --comment "ns1/svc1:p80 -> 10.180.0.1:80" -j KUBE-SEP-SXIVWICOYRO3J4NJ"#,
            "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -s 10.180.0.1 -j KUBE-MARK-MASQ",
            "-A KUBE-SEP-SXIVWICOYRO3J4NJ -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.1:80",
            ":KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]",
        ] {
            assert!(
                table.lines().any(|l| l == line),
                "missing {line}\nin\n{table}"
            );
        }
    }

    #[test]
    fn node_port_rules_match_kube_proxy() {
        // kube-proxy's own expectations for an externalTrafficPolicy Cluster NodePort
        // (pkg/proxy/iptables/proxier_test.go, TestOverallIPTablesRules' ns3/svc3),
        // next to a ClusterIP-only Service (ns1/svc1), minus the off-cluster
        // masquerade rule this writer leaves out.
        let svc3 = KubeService {
            namespace: "ns3".into(),
            name: "svc3".into(),
            port_name: "p80".into(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(172, 30, 0, 43),
            port: 80,
            endpoints: vec!["10.180.0.3:80".parse().unwrap()],
            affinity_timeout: None,
        };
        assert_eq!(svc3.ext_chain(), "KUBE-EXT-X27LE4BHSL4DOUIK");
        let table = nat_table_with_node_ports(&[(svc1(), None), (svc3, Some(3003))]).unwrap();
        for line in [
            ":KUBE-NODEPORTS - [0:0]",
            ":KUBE-EXT-X27LE4BHSL4DOUIK - [0:0]",
            r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
            r#"-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
            r#"-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING"#,
            "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
            "-A KUBE-NODEPORTS -m comment --comment ns3/svc3:p80 -m tcp -p tcp --dport 3003 -j KUBE-EXT-X27LE4BHSL4DOUIK",
            r#"-A KUBE-SVC-X27LE4BHSL4DOUIK -m comment --comment "ns3/svc3:p80 -> 10.180.0.3:80" -j KUBE-SEP-OYPFS5VJICHGATKP"#,
            "-A KUBE-SEP-OYPFS5VJICHGATKP -m comment --comment ns3/svc3:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.3:80",
        ] {
            assert!(
                table.lines().any(|l| l == line),
                "missing {line}\nin\n{table}"
            );
        }
        let chain = |name: &str| -> Vec<&str> {
            table
                .lines()
                .filter(|l| l.starts_with(&format!("-A {name} ")))
                .collect()
        };
        assert_eq!(
            chain("KUBE-EXT-X27LE4BHSL4DOUIK"),
            [
                r#"-A KUBE-EXT-X27LE4BHSL4DOUIK -m comment --comment "masquerade traffic for ns3/svc3:p80 external destinations" -j KUBE-MARK-MASQ"#,
                "-A KUBE-EXT-X27LE4BHSL4DOUIK -j KUBE-SVC-X27LE4BHSL4DOUIK",
            ],
            "in\n{table}"
        );
        // Masquerade only what was marked, and clear the mark first.
        assert_eq!(
            chain("KUBE-POSTROUTING"),
            [
                "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
                "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
                r#"-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE"#,
            ],
            "in\n{table}"
        );
        // Only the NodePort Service has a node port rule, and the jump to
        // KUBE-NODEPORTS comes after every ClusterIP rule.
        assert_eq!(chain("KUBE-NODEPORTS").len(), 1, "{table}");
        let services = chain("KUBE-SERVICES");
        assert_eq!(services.len(), 3, "{table}");
        assert_eq!(
            services[2],
            r#"-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"#
        );
        // A table without node ports is what nat_table writes.
        assert_eq!(
            nat_table_with_node_ports(&[(svc1(), None)]).unwrap(),
            nat_table(&[svc1()]).unwrap()
        );
    }

    #[test]
    fn affinity_rules_match_kube_proxy() {
        // kube-proxy's own expectations (pkg/proxy/iptables/proxier_test.go, the
        // terminating-endpoints table with sessionAffinity ClientIP), minus the
        // off-cluster masquerade rule this writer leaves out.
        let svc = KubeService {
            namespace: "ns1".into(),
            name: "svc1".into(),
            port_name: String::new(),
            protocol: Protocol::Tcp,
            cluster_ip: Ipv4Addr::new(172, 30, 1, 1),
            port: 80,
            endpoints: ["10.0.1.5:80", "10.0.1.1:80", "10.0.1.2:80"]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect(),
            affinity_timeout: Some(10_800),
        };
        let table = nat_table(std::slice::from_ref(&svc)).unwrap();
        let svc_rules: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SVC-AQI2S6QIMU7PVVRP "))
            .collect();
        assert_eq!(
            svc_rules,
            [
                r#"-A KUBE-SVC-AQI2S6QIMU7PVVRP -m comment --comment "ns1/svc1 -> 10.0.1.1:80" -m recent --name KUBE-SEP-3JOIVZTXZZRGORX4 --rcheck --seconds 10800 --reap -j KUBE-SEP-3JOIVZTXZZRGORX4"#,
                r#"-A KUBE-SVC-AQI2S6QIMU7PVVRP -m comment --comment "ns1/svc1 -> 10.0.1.2:80" -m recent --name KUBE-SEP-IO5XOSKPAXIFQXAJ --rcheck --seconds 10800 --reap -j KUBE-SEP-IO5XOSKPAXIFQXAJ"#,
                r#"-A KUBE-SVC-AQI2S6QIMU7PVVRP -m comment --comment "ns1/svc1 -> 10.0.1.5:80" -m recent --name KUBE-SEP-EQCHZ7S2PJ72OHAY --rcheck --seconds 10800 --reap -j KUBE-SEP-EQCHZ7S2PJ72OHAY"#,
                r#"-A KUBE-SVC-AQI2S6QIMU7PVVRP -m comment --comment "ns1/svc1 -> 10.0.1.1:80" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-3JOIVZTXZZRGORX4"#,
                r#"-A KUBE-SVC-AQI2S6QIMU7PVVRP -m comment --comment "ns1/svc1 -> 10.0.1.2:80" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-IO5XOSKPAXIFQXAJ"#,
                r#"-A KUBE-SVC-AQI2S6QIMU7PVVRP -m comment --comment "ns1/svc1 -> 10.0.1.5:80" -j KUBE-SEP-EQCHZ7S2PJ72OHAY"#,
            ],
            "in\n{table}"
        );
        let sep_rules: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SEP-IO5XOSKPAXIFQXAJ "))
            .collect();
        assert_eq!(
            sep_rules,
            [
                "-A KUBE-SEP-IO5XOSKPAXIFQXAJ -m comment --comment ns1/svc1 -s 10.0.1.2 -j KUBE-MARK-MASQ",
                "-A KUBE-SEP-IO5XOSKPAXIFQXAJ -m comment --comment ns1/svc1 -m recent --name KUBE-SEP-IO5XOSKPAXIFQXAJ --set -m tcp -p tcp -j DNAT --to-destination 10.0.1.2:80",
            ],
            "in\n{table}"
        );
        // Without affinity, no `recent` anywhere.
        let plain = KubeService {
            affinity_timeout: None,
            ..svc
        };
        let table = nat_table(&[plain]).unwrap();
        assert!(!table.contains("recent"), "{table}");
    }

    #[test]
    fn ipv6_rules_bracket_endpoints_and_sort_them_as_strings() {
        let svc = KubeService6 {
            namespace: "ns1".into(),
            name: "svc6".into(),
            port_name: "p80".into(),
            protocol: Protocol::Tcp,
            cluster_ip: "fd00:96::1".parse().unwrap(),
            port: 80,
            endpoints: ["[fd00:10::9]:8080", "[fd00:10::10]:8080"]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect(),
            affinity_timeout: None,
        };
        let table = nat_table(std::slice::from_ref(&svc)).unwrap();
        let first: SocketAddrV6 = "[fd00:10::10]:8080".parse().unwrap();
        let sep = svc.sep_chain(first);
        assert_eq!(
            sep,
            format!(
                "KUBE-SEP-{}",
                chain_hash("ns1/svc6:p80tcp[fd00:10::10]:8080")
            )
        );
        for line in [
            format!(
                r#"-A KUBE-SERVICES -m comment --comment "ns1/svc6:p80 cluster IP" -m tcp -p tcp -d fd00:96::1 --dport 80 -j {}"#,
                svc.svc_chain()
            ),
            // "[fd00:10::10]:8080" sorts before "[fd00:10::9]:8080".
            format!(
                r#"-A {} -m comment --comment "ns1/svc6:p80 -> [fd00:10::10]:8080" -m statistic --mode random --probability 0.5000000000 -j {sep}"#,
                svc.svc_chain()
            ),
            format!("-A {sep} -m comment --comment ns1/svc6:p80 -s fd00:10::10 -j KUBE-MARK-MASQ"),
            format!(
                "-A {sep} -m comment --comment ns1/svc6:p80 -m tcp -p tcp -j DNAT --to-destination [fd00:10::10]:8080"
            ),
        ] {
            assert!(
                table.lines().any(|l| l == line),
                "missing {line}\nin\n{table}"
            );
        }
    }

    #[test]
    fn services_without_endpoints_are_rejected_in_the_filter_table() {
        let empty = KubeService {
            endpoints: vec![],
            ..svc1()
        };
        let udp6 = KubeService6 {
            namespace: "ns2".into(),
            name: "svc2".into(),
            port_name: "dns".into(),
            protocol: Protocol::Udp,
            cluster_ip: "fd00:96::2".parse().unwrap(),
            port: 53,
            endpoints: vec![],
            affinity_timeout: None,
        };
        let table = filter_table(&[empty, svc1()]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines,
            [
                "*filter",
                ":KUBE-SERVICES - [0:0]",
                r#"-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
                r#"-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
                r#"-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
                r#"-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 has no endpoints" -m tcp -p tcp -d 10.20.30.41 --dport 80 -j REJECT"#,
                "COMMIT",
            ],
            "the service with an endpoint has no rule here"
        );
        assert!(
            filter_table(&[udp6]).lines().any(|l| l
                == r#"-A KUBE-SERVICES -m comment --comment "ns2/svc2:dns has no endpoints" -m udp -p udp -d fd00:96::2 --dport 53 -j REJECT"#),
            "{}",
            filter_table::<Ipv6Addr>(&[])
        );
    }

    #[test]
    fn cascade_is_sorted_as_strings_with_decreasing_denominators() {
        let mut svc = svc1();
        svc.endpoints = ["10.0.0.2:80", "10.0.0.10:80", "10.0.0.3:80"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let table = nat_table(&[svc.clone()]).unwrap();
        let svc_rules: Vec<&str> = table
            .lines()
            .filter(|l| l.starts_with(&format!("-A {}", svc.svc_chain())))
            .collect();
        assert_eq!(svc_rules.len(), 3, "{table}");
        assert!(svc_rules[0].contains(
            "-> 10.0.0.10:80\" -m statistic --mode random --probability 0.3333333333 -j"
        ));
        assert!(
            svc_rules[1].contains(
                "-> 10.0.0.2:80\" -m statistic --mode random --probability 0.5000000000 -j"
            )
        );
        assert!(svc_rules[2].contains("-> 10.0.0.3:80\" -j"));
    }

    #[test]
    fn thresholds_match_the_reference_table() {
        // docs/kube-proxy-semantics.md §1.
        let expected = [
            (2, 0x40000000),
            (3, 0x2aaaaaab),
            (4, 0x20000000),
            (5, 0x1999999a),
            (6, 0x15555555),
            (7, 0x12492492),
            (8, 0x10000000),
            (9, 0x0e38e38e),
            (10, 0x0ccccccd),
        ];
        for (n, t) in expected {
            assert_eq!(statistic_threshold(&probability(n)), t, "n = {n}");
        }
        assert_eq!(probability(3), "0.3333333333");
        assert_eq!(probability(6), "0.1666666667");
    }

    #[test]
    fn cascade_is_uniform_to_1e_9() {
        for n in 1..=64 {
            let p = cascade_probabilities(n);
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
            for (i, pi) in p.iter().enumerate() {
                assert!((pi - 1.0 / n as f64).abs() < 1e-9, "n {n} slot {i}: {pi}");
            }
        }
    }
}
