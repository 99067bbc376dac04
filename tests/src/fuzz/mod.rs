//! Seeded random and mutated frames for the datapath, and the property every
//! output of the tc and XDP programs must have: the frame untouched, a drop
//! with a reason, a reject addressed back to the sender, or a translation
//! consistent with the maps and with valid checksums.
//!
//! Pure: no BPF here. The test and the bench that feed the frames through
//! `BPF_PROG_TEST_RUN` (`tests/fuzz_frames.rs`, benches/fuzz.rs) describe what
//! they programmed as a [`Universe`] and answer conntrack questions through
//! [`Conntrack`].

mod check;
mod frame;
mod generate;

use std::{collections::BTreeMap, fmt, net::Ipv4Addr, ops::RangeInclusive};

pub use check::check;
pub use frame::{L4, Packet, fix_ip_csum, fix_l4_csum, hex, tuple_of};
pub use generate::{Generator, mutate};

pub const ICMP: u8 = 1;

/// splitmix64: small, seedable, and the same sequence everywhere, so a seed
/// printed by a failing run replays it.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
}

/// A frontend as programmed, in the terms a frame sees: a NodePort appears
/// at the node's address.
#[derive(Clone, Debug)]
pub struct Frontend {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub proto: u8,
    pub backends: Vec<(Ipv4Addr, u16)>,
    /// Without backends: drop (true) rather than reject.
    pub drop_when_empty: bool,
    /// New flows from outside are SNATed to the node (remote backends,
    /// externalTrafficPolicy Cluster) and routed by the datapath.
    pub snat: bool,
    /// loadBalancerSourceRanges, as the client addresses they allow.
    pub allowed: Option<Vec<Ipv4Addr>>,
}

/// Everything the datapath was given, as the checker needs it.
#[derive(Clone, Debug)]
pub struct Universe {
    pub frontends: Vec<Frontend>,
    pub node_ip: Ipv4Addr,
    pub snat_ports: RangeInclusive<u16>,
    pub hairpin_src: Ipv4Addr,
    /// Addresses the generator sends from (besides the backends).
    pub clients: Vec<Ipv4Addr>,
    /// Prefixes the node has routes to, for the packets the datapath
    /// routes itself.
    pub routes: Vec<(Ipv4Addr, u8)>,
}

impl Universe {
    fn frontend(&self, proto: u8, addr: Ipv4Addr, port: u16) -> Option<&Frontend> {
        self.frontends
            .iter()
            .find(|f| f.proto == proto && f.addr == addr && f.port == port)
    }

    /// Whether a packet the datapath routes itself to `dst` has somewhere to
    /// go: a host of one of the routes, not this node's own address or a
    /// route's broadcast address (the FIB forwards to neither).
    fn routable(&self, dst: Ipv4Addr) -> bool {
        dst != self.node_ip
            && self.routes.iter().any(|(net, len)| {
                let mask = u32::MAX.checked_shl(32 - u32::from(*len)).unwrap_or(0);
                let broadcast = *len <= 30 && u32::from(dst) | mask == u32::MAX;
                u32::from(dst) & mask == u32::from(*net) & mask && !broadcast
            })
    }

    /// Frontends `addr:port` is a backend of.
    fn served_by(&self, proto: u8, addr: Ipv4Addr, port: u16) -> impl Iterator<Item = &Frontend> {
        self.frontends
            .iter()
            .filter(move |f| f.proto == proto && f.backends.contains(&(addr, port)))
    }
}

/// Addresses and ports of a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    pub proto: u8,
    pub src: Ipv4Addr,
    pub sport: u16,
    pub dst: Ipv4Addr,
    pub dport: u16,
}

impl Tuple {
    pub fn reversed(&self) -> Tuple {
        Tuple {
            proto: self.proto,
            src: self.dst,
            sport: self.dport,
            dst: self.src,
            dport: self.sport,
        }
    }
}

impl fmt::Display for Tuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}:{} -> {}:{}",
            self.proto, self.src, self.sport, self.dst, self.dport
        )
    }
}

/// What the conntrack map says, read after the packet.
pub trait Conntrack {
    /// The tuple the entry keyed by `t` (as on the wire) translates a packet
    /// to, and whether such packets are routed by the datapath.
    fn translation(&self, t: &Tuple) -> Option<(Tuple, bool)>;
    /// Source and destination the entries between `src` and `dst` translate
    /// to, whatever their ports: what a fragment without ports may get.
    fn address_translations(
        &self,
        proto: u8,
        src: Ipv4Addr,
        dst: Ipv4Addr,
    ) -> Vec<(Ipv4Addr, Ipv4Addr)>;
}

/// Which program ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Hook {
    Tc,
    Xdp,
}

pub mod verdict {
    /// `TCX_NEXT` (-1): on to the next program of the tcx chain and the
    /// interface's legacy filters, which is how tc passes a packet,
    /// translated or not.
    pub const TCX_NEXT: u32 = u32::MAX;
    pub const TC_ACT_SHOT: u32 = 2;
    pub const TC_ACT_REDIRECT: u32 = 7;
    pub const XDP_DROP: u32 = 1;
    pub const XDP_PASS: u32 = 2;
    pub const XDP_REDIRECT: u32 = 4;
}

/// Why a drop was the right outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropReason {
    /// A frontend without endpoints whose policy is to drop.
    NoEndpoint,
    /// A client outside a frontend's source ranges.
    SourceRange,
    /// A frontend without endpoints at tc, whose packet cannot be turned
    /// into a reject (not a bare SYN; a datagram with IP options).
    RejectImpossible,
    /// A packet the datapath routes itself, with its TTL spent.
    TtlSpent,
    /// A packet the datapath routes itself, to where the FIB has no route
    /// (the answer to a client no route leads back to).
    Unroutable,
}

/// What a program did to one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// `BPF_PROG_TEST_RUN` refused the frame before any program saw it (too
    /// short for the hook).
    Refused,
    Untouched,
    Dropped(DropReason),
    Reset,
    PortUnreachable,
    /// Sent to a backend of the frontend it addressed (SNATed to the node:
    /// `snat`; the hairpin source: `hairpin`; the client's address or the
    /// hairpin source with another port, its tuple at the backend another
    /// flow's: `remapped`).
    Forward {
        snat: bool,
        hairpin: bool,
        remapped: bool,
    },
    /// A backend's answer, made to come from the frontend.
    Reply {
        snat: bool,
        hairpin: bool,
        remapped: bool,
    },
    /// An IP fragment translated at the IP level.
    Fragment,
    /// An ICMP error about a translated flow, its quote and addresses
    /// translated as the flow's packets going its way are.
    IcmpError,
    /// Such an error, translated, then dropped by the routing that its new
    /// source (an address of this node) takes.
    IcmpErrorDropped(DropReason),
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Refused => f.write_str("refused by BPF_PROG_TEST_RUN"),
            Outcome::Untouched => f.write_str("untouched"),
            Outcome::Dropped(r) => write!(f, "dropped: {r:?}"),
            Outcome::Reset => f.write_str("rejected: TCP RST"),
            Outcome::IcmpError => f.write_str("an ICMP error about a flow, translated"),
            Outcome::IcmpErrorDropped(r) => write!(f, "an ICMP error, translated, dropped: {r:?}"),
            Outcome::PortUnreachable => f.write_str("rejected: ICMP port unreachable"),
            Outcome::Forward {
                snat,
                hairpin,
                remapped,
            } => write!(
                f,
                "translated to a backend{}",
                side(*snat, *hairpin, *remapped)
            ),
            Outcome::Reply {
                snat,
                hairpin,
                remapped,
            } => write!(
                f,
                "reply translated back{}",
                side(*snat, *hairpin, *remapped)
            ),
            Outcome::Fragment => f.write_str("fragment translated"),
        }
    }
}

fn side(snat: bool, hairpin: bool, remapped: bool) -> &'static str {
    match (snat, hairpin, remapped) {
        (true, _, _) => " (SNAT)",
        (_, true, true) => " (hairpin, port remapped)",
        (_, true, _) => " (hairpin)",
        (_, _, true) => " (port remapped)",
        _ => "",
    }
}

/// Outcome counts per hook, for the report.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    pub counts: BTreeMap<(Outcome, Hook), u64>,
}

impl Tally {
    pub fn add(&mut self, hook: Hook, outcome: Outcome) {
        *self.counts.entry((outcome, hook)).or_default() += 1;
    }

    pub fn get(&self, hook: Hook, outcome: Outcome) -> u64 {
        self.counts.get(&(outcome, hook)).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    pub fn merge(&mut self, other: &Tally) {
        for (k, v) in &other.counts {
            *self.counts.entry(*k).or_default() += v;
        }
    }

    /// A markdown table: one row per outcome, a column per hook.
    pub fn table(&self) -> String {
        let mut rows: BTreeMap<Outcome, (u64, u64)> = BTreeMap::new();
        for ((outcome, hook), n) in &self.counts {
            let row = rows.entry(*outcome).or_default();
            match hook {
                Hook::Tc => row.0 += n,
                Hook::Xdp => row.1 += n,
            }
        }
        let mut out = String::from("| outcome | tc | XDP |\n|---|---:|---:|\n");
        let (mut tc, mut xdp) = (0, 0);
        for (outcome, (t, x)) in rows {
            out += &format!("| {outcome} | {t} | {x} |\n");
            tc += t;
            xdp += x;
        }
        out += &format!("| **frames** | {tc} | {xdp} |\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{
        frame::{be16, ip_residual, l4_residual, put16, view},
        *,
    };
    use crate::{
        frames::TCP,
        topology::{one_node, two_node},
    };

    const CLIENT: Ipv4Addr = one_node::CLIENT.1;
    const VIP: Ipv4Addr = one_node::CLUSTER_IP;
    const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
    const BACKEND: Ipv4Addr = one_node::BACKEND_IPS[0];

    fn universe() -> Universe {
        let fe = |addr, backends: Vec<(Ipv4Addr, u16)>| Frontend {
            addr,
            port: 80,
            proto: TCP,
            backends,
            drop_when_empty: false,
            snat: false,
            allowed: None,
        };
        Universe {
            frontends: vec![fe(VIP, vec![(BACKEND, 8080)]), fe(EMPTY, vec![])],
            node_ip: two_node::NODE_A_IP,
            snat_ports: 1024..=29999,
            hairpin_src: Ipv4Addr::new(169, 254, 42, 1),
            clients: vec![CLIENT],
            routes: Vec::new(),
        }
    }

    /// A conntrack holding the one flow CLIENT:40000 -> VIP:80 to BACKEND.
    struct OneFlow;
    impl Conntrack for OneFlow {
        fn translation(&self, t: &Tuple) -> Option<(Tuple, bool)> {
            let fwd = syn_tuple();
            let to = Tuple {
                dst: BACKEND,
                dport: 8080,
                ..fwd
            };
            (*t == fwd).then_some((to, false))
        }
        fn address_translations(
            &self,
            _: u8,
            _: Ipv4Addr,
            _: Ipv4Addr,
        ) -> Vec<(Ipv4Addr, Ipv4Addr)> {
            Vec::new()
        }
    }

    fn syn_tuple() -> Tuple {
        Tuple {
            proto: TCP,
            src: CLIENT,
            sport: 40000,
            dst: VIP,
            dport: 80,
        }
    }

    fn syn(dst: Ipv4Addr) -> Vec<u8> {
        Packet {
            src: CLIENT,
            dst,
            ttl: 64,
            id: 1,
            frag: 0x4000,
            options: Vec::new(),
            l4: L4::Tcp {
                sport: 40000,
                dport: 80,
                seq: 0x1234_5678,
                flags: 0x02,
                options: Vec::new(),
                payload: Vec::new(),
            },
        }
        .encode()
    }

    /// The DNAT the datapath should do, by hand: addresses and port
    /// written, checksums recomputed.
    fn dnat(f: &[u8], to: Ipv4Addr, port: u16) -> Vec<u8> {
        let mut out = f.to_vec();
        out[30..34].copy_from_slice(&to.octets());
        put16(&mut out, 36, port);
        fix_ip_csum(&mut out);
        fix_l4_csum(&mut out);
        out
    }

    fn tc_check(input: &[u8], verdict: u32, output: &[u8]) -> Result<Outcome, String> {
        check(&universe(), &OneFlow, Hook::Tc, input, verdict, output)
    }

    #[test]
    fn encoded_frames_have_valid_checksums() {
        let f = syn(VIP);
        let v = view(&f).expect("IPv4");
        assert_eq!((ip_residual(&f, &v), l4_residual(&f, &v)), (0, Some(0)));
        crate::frames::parse_checked(&f, "encoded SYN");
    }

    #[test]
    fn a_right_translation_passes_and_each_wrong_one_is_named() {
        let input = syn(VIP);
        let good = dnat(&input, BACKEND, 8080);
        let pass = verdict::TCX_NEXT;
        assert_eq!(
            tc_check(&input, pass, &good),
            Ok(Outcome::Forward {
                snat: false,
                hairpin: false,
                remapped: false,
            })
        );
        let mut bad_l4 = good.clone();
        bad_l4[14 + 20 + 16] ^= 1;
        assert!(
            tc_check(&input, pass, &bad_l4)
                .unwrap_err()
                .contains("L4 checksum")
        );
        let mut bad_ip = good.clone();
        bad_ip[24] ^= 1;
        assert!(
            tc_check(&input, pass, &bad_ip)
                .unwrap_err()
                .contains("IP header checksum")
        );
        let other_backend = dnat(&input, Ipv4Addr::new(10, 200, 0, 99), 8080);
        assert!(
            tc_check(&input, pass, &other_backend)
                .unwrap_err()
                .contains("conntrack")
        );
        let mut seq = good.clone();
        seq[14 + 20 + 4] ^= 1;
        assert!(
            tc_check(&input, pass, &seq)
                .unwrap_err()
                .contains("byte 38")
        );
        assert!(
            tc_check(&input, 9, &input).unwrap_err().contains("verdict"),
            "an unknown verdict"
        );
        assert_eq!(tc_check(&input, pass, &input), Ok(Outcome::Untouched));
        assert!(
            tc_check(&input, 0, &input).unwrap_err().contains("verdict"),
            "TC_ACT_OK, which would end the interface's tc processing"
        );
        assert!(
            tc_check(&input, 2, &input)
                .unwrap_err()
                .contains("frontend with endpoints")
        );
    }

    #[test]
    fn a_reset_must_answer_a_bare_syn_correctly() {
        let input = syn(EMPTY);
        let mut rst = input.clone();
        let (a, b) = (rst[0..6].to_vec(), rst[6..12].to_vec());
        rst[0..6].copy_from_slice(&b);
        rst[6..12].copy_from_slice(&a);
        let (s, d) = (rst[26..30].to_vec(), rst[30..34].to_vec());
        rst[26..30].copy_from_slice(&d);
        rst[30..34].copy_from_slice(&s);
        rst[34..36].copy_from_slice(&80u16.to_be_bytes());
        rst[36..38].copy_from_slice(&40000u16.to_be_bytes());
        rst[38..42].copy_from_slice(&[0; 4]);
        rst[42..46].copy_from_slice(&0x1234_5679u32.to_be_bytes());
        rst[47] = 0x14;
        rst[48..50].copy_from_slice(&[0, 0]);
        fix_l4_csum(&mut rst);
        assert_eq!(
            tc_check(&input, verdict::TC_ACT_REDIRECT, &rst),
            Ok(Outcome::Reset)
        );
        let mut wrong_ack = rst.clone();
        wrong_ack[45] ^= 1;
        fix_l4_csum(&mut wrong_ack);
        assert!(
            tc_check(&input, verdict::TC_ACT_REDIRECT, &wrong_ack)
                .unwrap_err()
                .contains("ack")
        );
        let mut bad_csum = rst.clone();
        bad_csum[50] ^= 1;
        assert!(
            tc_check(&input, verdict::TC_ACT_REDIRECT, &bad_csum)
                .unwrap_err()
                .contains("TCP checksum")
        );
    }

    #[test]
    fn mutations_keep_to_the_frame_and_cover_every_kind() {
        let mut rng = Rng::new(7);
        let mut g = Generator::new(universe());
        let mut fragments = 0;
        let mut tagged = 0;
        for _ in 0..20_000 {
            let f = g.frame(&mut rng);
            if view(&f).is_some_and(|v| v.fragment()) {
                fragments += 1;
            }
            if f.len() >= 14 && be16(&f, 12) == 0x8100 {
                tagged += 1;
            }
        }
        assert!(
            fragments > 100 && tagged > 100,
            "fragments {fragments}, tagged {tagged}"
        );
    }
}
