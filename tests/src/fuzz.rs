//! Seeded random and mutated frames for the datapath, and the property every
//! output of the tc and XDP programs must have: the frame untouched, a drop
//! with a reason, a reject addressed back to the sender, or a translation
//! consistent with the maps and with valid checksums.
//!
//! Pure: no BPF here. The test and the bench that feed the frames through
//! BPF_PROG_TEST_RUN (tests/fuzz_frames.rs, benches/fuzz.rs) describe what
//! they programmed as a [`Universe`] and answer conntrack questions through
//! [`Conntrack`].

use std::{collections::BTreeMap, fmt, net::Ipv4Addr, ops::RangeInclusive};

use crate::frames::{TCP, UDP, csum};

pub const ICMP: u8 = 1;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;

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

    fn routable(&self, dst: Ipv4Addr) -> bool {
        self.routes.iter().any(|(net, len)| {
            let mask = u32::MAX.checked_shl(32 - *len as u32).unwrap_or(0);
            u32::from(dst) & mask == u32::from(*net) & mask
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
    pub const TC_ACT_OK: u32 = 0;
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
    /// BPF_PROG_TEST_RUN refused the frame before any program saw it (too
    /// short for the hook).
    Refused,
    Untouched,
    Dropped(DropReason),
    Reset,
    PortUnreachable,
    /// Sent to a backend of the frontend it addressed (SNATed to the node:
    /// `snat`; the hairpin source: `hairpin`).
    Forward {
        snat: bool,
        hairpin: bool,
    },
    /// A backend's answer, made to come from the frontend.
    Reply {
        snat: bool,
        hairpin: bool,
    },
    /// An IP fragment translated at the IP level.
    Fragment,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Refused => f.write_str("refused by BPF_PROG_TEST_RUN"),
            Outcome::Untouched => f.write_str("untouched"),
            Outcome::Dropped(r) => write!(f, "dropped: {r:?}"),
            Outcome::Reset => f.write_str("rejected: TCP RST"),
            Outcome::PortUnreachable => f.write_str("rejected: ICMP port unreachable"),
            Outcome::Forward { snat, hairpin } => write!(
                f,
                "translated to a backend{}",
                side(*snat, *hairpin, " (SNAT)", " (hairpin)")
            ),
            Outcome::Reply { snat, hairpin } => write!(
                f,
                "reply translated back{}",
                side(*snat, *hairpin, " (SNAT)", " (hairpin)")
            ),
            Outcome::Fragment => f.write_str("fragment translated"),
        }
    }
}

fn side(snat: bool, hairpin: bool, s: &'static str, h: &'static str) -> &'static str {
    match (snat, hairpin) {
        (true, _) => s,
        (_, true) => h,
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

// ---------------------------------------------------------------------------
// Frames.

/// The IPv4 headers of a frame, as far as they can be read.
#[derive(Clone, Copy, Debug)]
struct View {
    ihl: usize,
    tot_len: usize,
    proto: u8,
    ttl: u8,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    more_fragments: bool,
    frag_offset: u16,
    l4: usize,
}

impl View {
    fn fragment(&self) -> bool {
        self.more_fragments || self.frag_offset != 0
    }

    /// The L4 header is in the frame and its ports can be read.
    fn ports(&self, f: &[u8]) -> Option<(u16, u16)> {
        if self.frag_offset != 0 || self.l4 + 4 > f.len() {
            return None;
        }
        Some((be16(f, self.l4), be16(f, self.l4 + 2)))
    }

    fn tuple(&self, f: &[u8]) -> Option<Tuple> {
        let (sport, dport) = self.ports(f)?;
        Some(Tuple {
            proto: self.proto,
            src: self.src,
            sport,
            dst: self.dst,
            dport,
        })
    }

    fn l4_csum_off(&self) -> Option<usize> {
        match self.proto {
            TCP => Some(self.l4 + 16),
            UDP => Some(self.l4 + 6),
            ICMP => Some(self.l4 + 2),
            _ => None,
        }
    }
}

fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

fn put16(f: &mut [u8], at: usize, v: u16) {
    f[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

fn addr(f: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3])
}

/// An IPv4 frame whose version, IHL and header fit; nothing else checked.
fn view(f: &[u8]) -> Option<View> {
    if f.len() < ETH_HLEN + 20 || be16(f, 12) != ETH_P_IP || f[14] >> 4 != 4 {
        return None;
    }
    let ihl = (f[14] & 0x0f) as usize * 4;
    if ihl < 20 || ETH_HLEN + ihl > f.len() {
        return None;
    }
    let frag = be16(f, 20);
    Some(View {
        ihl,
        tot_len: be16(f, 16) as usize,
        proto: f[23],
        ttl: f[22],
        src: addr(f, 26),
        dst: addr(f, 30),
        more_fragments: frag & 0x2000 != 0,
        frag_offset: frag & 0x1fff,
        l4: ETH_HLEN + ihl,
    })
}

fn pseudo_sum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> u32 {
    let mut sum = 0u32;
    for o in [src.octets(), dst.octets()] {
        sum += u16::from_be_bytes([o[0], o[1]]) as u32 + u16::from_be_bytes([o[2], o[3]]) as u32;
    }
    sum + proto as u32 + len as u32
}

/// The IP header's checksum residual: 0 when valid.
fn ip_residual(f: &[u8], v: &View) -> u16 {
    csum(&f[ETH_HLEN..v.l4], 0)
}

/// The L4 checksum residual over the whole segment (0 when valid), where
/// the segment is in the frame and not a fragment. 0 and 0xffff are the
/// same in one's complement: both come out as 0.
fn l4_residual(f: &[u8], v: &View) -> Option<u16> {
    if v.fragment() || v.tot_len < v.ihl || ETH_HLEN + v.tot_len > f.len() {
        return None;
    }
    let seg = &f[v.l4..ETH_HLEN + v.tot_len];
    let r = match v.proto {
        TCP | UDP => csum(seg, pseudo_sum(v.src, v.dst, v.proto, seg.len())),
        ICMP => csum(seg, 0),
        _ => return None,
    };
    Some(if r == 0xffff { 0 } else { r })
}

/// Recomputes the IPv4 header checksum (when the header can be read).
pub fn fix_ip_csum(f: &mut [u8]) {
    if let Some(v) = view(f) {
        put16(f, 24, 0);
        let c = csum(&f[ETH_HLEN..v.l4], 0);
        put16(f, 24, c);
    }
}

/// Recomputes the L4 checksum over what the IP header says the segment is,
/// where that is inside the frame.
pub fn fix_l4_csum(f: &mut [u8]) {
    let Some(v) = view(f) else { return };
    let Some(off) = v.l4_csum_off() else { return };
    let end = ETH_HLEN + v.tot_len;
    if v.fragment() || v.tot_len < v.ihl || end > f.len() || off + 2 > end {
        return;
    }
    put16(f, off, 0);
    let seg = &f[v.l4..end];
    let c = if v.proto == ICMP {
        csum(seg, 0)
    } else {
        csum(seg, pseudo_sum(v.src, v.dst, v.proto, seg.len()))
    };
    let c = if v.proto == UDP && c == 0 { 0xffff } else { c };
    put16(f, off, c);
}

/// A well-formed frame, checksums computed.
#[derive(Clone, Debug)]
pub struct Packet {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub ttl: u8,
    pub id: u16,
    /// Flags and fragment offset, as in the header.
    pub frag: u16,
    /// IP options (padded to 4 bytes when encoded).
    pub options: Vec<u8>,
    pub l4: L4,
}

#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        seq: u32,
        flags: u8,
        options: Vec<u8>,
        payload: Vec<u8>,
    },
    Udp {
        sport: u16,
        dport: u16,
        payload: Vec<u8>,
        no_csum: bool,
    },
    Icmp {
        kind: u8,
        code: u8,
        payload: Vec<u8>,
    },
    Other {
        proto: u8,
        payload: Vec<u8>,
    },
}

impl Packet {
    pub fn encode(&self) -> Vec<u8> {
        let (proto, mut l4) = match &self.l4 {
            L4::Tcp {
                sport,
                dport,
                seq,
                flags,
                options,
                payload,
            } => {
                let mut opts = options.clone();
                opts.resize(opts.len().div_ceil(4) * 4, 0);
                let mut b = Vec::new();
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(&0u32.to_be_bytes());
                b.push((((20 + opts.len()) / 4) as u8) << 4);
                b.push(*flags);
                b.extend_from_slice(&64240u16.to_be_bytes());
                b.extend_from_slice(&[0, 0, 0, 0]);
                b.extend_from_slice(&opts);
                b.extend_from_slice(payload);
                (TCP, b)
            }
            L4::Udp {
                sport,
                dport,
                payload,
                ..
            } => {
                let mut b = Vec::new();
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                b.extend_from_slice(&[0, 0]);
                b.extend_from_slice(payload);
                (UDP, b)
            }
            L4::Icmp {
                kind,
                code,
                payload,
            } => {
                let mut b = vec![*kind, *code, 0, 0, 0, 0, 0, 0];
                b.extend_from_slice(payload);
                (ICMP, b)
            }
            L4::Other { proto, payload } => (*proto, payload.clone()),
        };
        let mut options = self.options.clone();
        options.resize(options.len().div_ceil(4) * 4, 0);
        options.truncate(40);
        let ihl = 20 + options.len();
        let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x08, 0x00];
        f.push(0x40 | (ihl / 4) as u8);
        f.push(0);
        f.extend_from_slice(&((ihl + l4.len()) as u16).to_be_bytes());
        f.extend_from_slice(&self.id.to_be_bytes());
        f.extend_from_slice(&self.frag.to_be_bytes());
        f.extend_from_slice(&[self.ttl, proto, 0, 0]);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        f.extend_from_slice(&options);
        let l4_at = f.len();
        f.append(&mut l4);
        fix_ip_csum(&mut f);
        // The L4 checksum covers the whole datagram: a fragment's is made as
        // if it were whole, which is what its first fragment would carry.
        let frag = self.frag;
        put16(&mut f, 20, 0);
        fix_ip_csum(&mut f);
        fix_l4_csum(&mut f);
        if let L4::Udp { no_csum: true, .. } = self.l4 {
            put16(&mut f, l4_at + 6, 0);
        }
        put16(&mut f, 20, frag);
        fix_ip_csum(&mut f);
        f
    }
}

// ---------------------------------------------------------------------------
// The generator.

/// Makes frames from the flows of a [`Universe`], then mutates them.
pub struct Generator {
    pub universe: Universe,
    /// Translated packets seen lately: their answers are the replies worth
    /// sending (reverse NAT, SNAT replies), and their headers what ICMP
    /// errors quote.
    recent: Vec<Tuple>,
}

const RECENT: usize = 256;
/// Client source ports come from a small pool, so that frames meet the
/// flows earlier frames made.
const SPORT_BASE: u16 = 40000;
const SPORTS: usize = 48;

impl Generator {
    pub fn new(universe: Universe) -> Self {
        Generator {
            universe,
            recent: Vec::new(),
        }
    }

    /// Notes a translated packet whose reply may come later.
    pub fn saw(&mut self, t: Tuple) {
        if self.recent.len() < RECENT {
            self.recent.push(t);
        } else {
            let i = (t.sport as usize ^ t.dport as usize) % RECENT;
            self.recent[i] = t;
        }
    }

    pub fn forget(&mut self) {
        self.recent.clear();
    }

    /// A valid frame of one of the universe's flows (or noise), then up to
    /// three mutations.
    pub fn frame(&mut self, rng: &mut Rng) -> Vec<u8> {
        let mut f = self.base(rng);
        if rng.chance(65) {
            for _ in 0..1 + rng.below(3) {
                mutate(&mut f, rng);
            }
            if rng.chance(30) {
                fix_ip_csum(&mut f);
                fix_l4_csum(&mut f);
            }
        }
        f
    }

    fn base(&mut self, rng: &mut Rng) -> Vec<u8> {
        let u = &self.universe;
        let choice = rng.below(100);
        let (tuple, flags) = if choice < 45 {
            // To a frontend, from a client or a backend (hairpin).
            let fe = rng.pick(&u.frontends).clone();
            let src = if rng.chance(20) {
                match fe.backends.first() {
                    Some(b) => b.0,
                    None => *rng.pick(&u.clients),
                }
            } else {
                *rng.pick(&u.clients)
            };
            let proto = if rng.chance(90) {
                fe.proto
            } else {
                *rng.pick(&[TCP, UDP])
            };
            let t = Tuple {
                proto,
                src,
                sport: SPORT_BASE + rng.below(SPORTS) as u16,
                dst: fe.addr,
                dport: fe.port,
            };
            (t, *rng.pick(&[0x02, 0x10, 0x18, 0x11, 0x04, 0x14, 0x12]))
        } else if choice < 75 && !self.recent.is_empty() {
            // The answer to a packet the datapath translated.
            let t = rng.pick(&self.recent).reversed();
            (t, *rng.pick(&[0x12, 0x10, 0x18, 0x11, 0x04]))
        } else if choice < 85 {
            // A backend's packet to a client, translated or not before.
            let fe = rng.pick(&u.frontends).clone();
            let Some(&(b, bport)) = fe.backends.first() else {
                return self.noise(rng);
            };
            let (dst, dport) = if fe.snat && rng.chance(50) {
                (u.node_ip, *u.snat_ports.start() + rng.below(64) as u16)
            } else {
                (*rng.pick(&u.clients), SPORT_BASE + rng.below(SPORTS) as u16)
            };
            let t = Tuple {
                proto: fe.proto,
                src: b,
                sport: bport,
                dst,
                dport,
            };
            (t, *rng.pick(&[0x12, 0x10, 0x04]))
        } else if choice < 92 {
            return self.icmp_error(rng);
        } else {
            return self.noise(rng);
        };
        let payload_len = *rng.pick(&[0, 0, 0, 1, 14, 100, 600]);
        let l4 = if tuple.proto == TCP {
            L4::Tcp {
                sport: tuple.sport,
                dport: tuple.dport,
                seq: rng.next_u64() as u32,
                flags,
                options: if rng.chance(20) {
                    // MSS, and sometimes garbage.
                    if rng.chance(50) {
                        vec![2, 4, 0x05, 0xb4]
                    } else {
                        {
                            let n = 1 + rng.below(40);
                            rng.bytes(n)
                        }
                    }
                } else {
                    Vec::new()
                },
                payload: rng.bytes(payload_len),
            }
        } else {
            L4::Udp {
                sport: tuple.sport,
                dport: tuple.dport,
                payload: rng.bytes(payload_len),
                no_csum: rng.chance(10),
            }
        };
        Packet {
            src: tuple.src,
            dst: tuple.dst,
            ttl: 64,
            id: rng.next_u64() as u16,
            frag: if rng.chance(50) { 0x4000 } else { 0 },
            options: ip_options(rng),
            l4,
        }
        .encode()
    }

    /// An ICMP error from a backend or a router, quoting a packet the
    /// datapath translated (or something else).
    fn icmp_error(&mut self, rng: &mut Rng) -> Vec<u8> {
        let u = &self.universe;
        let quoted = if self.recent.is_empty() || rng.chance(20) {
            Tuple {
                proto: *rng.pick(&[TCP, UDP]),
                src: *rng.pick(&u.clients),
                sport: SPORT_BASE,
                dst: rng.pick(&u.frontends).addr,
                dport: rng.pick(&u.frontends).port,
            }
        } else {
            *rng.pick(&self.recent)
        };
        let inner = Packet {
            src: quoted.src,
            dst: quoted.dst,
            ttl: 63,
            id: 7,
            frag: 0x4000,
            options: Vec::new(),
            l4: if quoted.proto == TCP {
                L4::Tcp {
                    sport: quoted.sport,
                    dport: quoted.dport,
                    seq: 1,
                    flags: 0x02,
                    options: Vec::new(),
                    payload: Vec::new(),
                }
            } else {
                L4::Udp {
                    sport: quoted.sport,
                    dport: quoted.dport,
                    payload: b"q".to_vec(),
                    no_csum: false,
                }
            },
        }
        .encode();
        // The inner IP header and 8 bytes of its payload (RFC 792), or all.
        let keep = if rng.chance(70) {
            20 + 8
        } else {
            inner.len() - ETH_HLEN
        };
        let payload = inner[ETH_HLEN..ETH_HLEN + keep].to_vec();
        // From where the quoted packet went (its backend) back to its sender.
        let (src, dst) = if rng.chance(80) {
            (quoted.dst, quoted.src)
        } else {
            (Ipv4Addr::new(10, 0, 0, 1), quoted.src)
        };
        Packet {
            src,
            dst,
            ttl: 64,
            id: 0,
            frag: 0,
            options: Vec::new(),
            l4: L4::Icmp {
                kind: *rng.pick(&[3, 3, 3, 11, 12, 5]),
                code: rng.below(16) as u8,
                payload,
            },
        }
        .encode()
    }

    fn noise(&mut self, rng: &mut Rng) -> Vec<u8> {
        let u = &self.universe;
        match rng.below(3) {
            0 => {
                let n = rng.below(200);
                rng.bytes(n)
            }
            1 => {
                let fe = rng.pick(&u.frontends);
                Packet {
                    src: Ipv4Addr::from(rng.next_u64() as u32),
                    dst: if rng.chance(50) {
                        fe.addr
                    } else {
                        Ipv4Addr::from(rng.next_u64() as u32)
                    },
                    ttl: rng.byte(),
                    id: 0,
                    frag: 0,
                    options: Vec::new(),
                    l4: L4::Other {
                        proto: *rng.pick(&[TCP, UDP, ICMP, 47, 132, 0, 255]),
                        payload: {
                            let n = rng.below(80);
                            rng.bytes(n)
                        },
                    },
                }
                .encode()
            }
            _ => {
                let n = 14 + rng.below(120);
                let mut f = rng.bytes(n);
                let ethertype = *rng.pick(&[0x0806u16, 0x86dd, 0x8100, 0x88a8, 0x0800]);
                put16(&mut f, 12, ethertype);
                f
            }
        }
    }
}

fn ip_options(rng: &mut Rng) -> Vec<u8> {
    if !rng.chance(15) {
        return Vec::new();
    }
    match rng.below(4) {
        // No-ops and an end of list.
        0 => vec![1, 1, 1, 0],
        // Router alert.
        1 => vec![0x94, 4, 0, 0],
        // A timestamp option with room for entries.
        2 => {
            let mut o = vec![0x44, 12, 5, 0];
            o.extend_from_slice(&[0; 8]);
            o
        }
        _ => {
            let n = 4 * (1 + rng.below(10));
            rng.bytes(n)
        }
    }
}

/// One mutation of a frame: the kinds of damage and oddity the datapath
/// must survive.
pub fn mutate(f: &mut Vec<u8>, rng: &mut Rng) {
    let v = view(f);
    match rng.below(17) {
        // Truncated anywhere.
        0 => {
            let len = rng.below(f.len() + 1);
            f.truncate(len);
        }
        // Random bytes anywhere.
        1 => {
            for _ in 0..1 + rng.below(4) {
                if !f.is_empty() {
                    let i = rng.below(f.len());
                    f[i] ^= 1 + rng.below(255) as u8;
                }
            }
        }
        // A random byte in the headers.
        2 => {
            let span = f.len().min(ETH_HLEN + 60 + 24);
            if span > 0 {
                let i = rng.below(span);
                f[i] = rng.byte();
            }
        }
        // IPv4 total length.
        3 => {
            if let Some(v) = v {
                let len = f.len() - ETH_HLEN;
                let any = rng.below(0x10000);
                let tot = *rng.pick(&[
                    0,
                    19,
                    20,
                    v.ihl,
                    v.ihl + 7,
                    v.ihl + 8,
                    len.saturating_sub(1),
                    len + 1,
                    0xffff,
                    any,
                ]);
                put16(f, 16, tot as u16);
                if rng.chance(50) {
                    fix_ip_csum(f);
                }
            }
        }
        // IHL.
        4 => {
            if f.len() > ETH_HLEN {
                f[ETH_HLEN] = (f[ETH_HLEN] & 0xf0) | rng.below(16) as u8;
                if rng.chance(50) {
                    fix_ip_csum(f);
                }
            }
        }
        // TCP data offset.
        5 => {
            if let Some(v) = v
                && v.proto == TCP
                && v.l4 + 13 <= f.len()
            {
                f[v.l4 + 12] = (rng.below(16) as u8) << 4;
                if rng.chance(50) {
                    fix_l4_csum(f);
                }
            }
        }
        // UDP length.
        6 => {
            if let Some(v) = v
                && v.proto == UDP
                && v.l4 + 6 <= f.len()
            {
                let l4_len = v.tot_len.saturating_sub(v.ihl);
                let any = rng.below(0x10000);
                let len = *rng.pick(&[0, 7, 8, l4_len, l4_len + 1, 0xffff, any]);
                put16(f, v.l4 + 4, len as u16);
            }
        }
        // A fragment: more-fragments, an offset, or both.
        7 => {
            if view(f).is_some() {
                let frag = match rng.below(3) {
                    0 => 0x2000,
                    1 => 1 + rng.below(0x1fff) as u16,
                    _ => 0x2000 | (1 + rng.below(0x1fff) as u16),
                };
                put16(f, 20, frag);
                fix_ip_csum(f);
            }
        }
        // IP version.
        8 => {
            if f.len() > ETH_HLEN {
                f[ETH_HLEN] = (f[ETH_HLEN] & 0x0f) | ((rng.below(16) as u8) << 4);
            }
        }
        // TTL at the edges.
        9 => {
            if view(f).is_some() {
                f[22] = *rng.pick(&[0, 1, 2, 255]);
                fix_ip_csum(f);
            }
        }
        // Any combination of TCP flags, with a valid checksum.
        10 => {
            if let Some(v) = v
                && v.proto == TCP
                && v.l4 + 14 <= f.len()
            {
                f[v.l4 + 13] = rng.byte();
                fix_l4_csum(f);
            }
        }
        // One or two 802.1Q tags.
        11 => {
            if f.len() >= 12 {
                for _ in 0..1 + rng.below(2) {
                    let tag = [0x81, 0x00, rng.byte() & 0x0f, rng.byte()];
                    f.splice(12..12, tag);
                }
            }
        }
        // Another ethertype.
        12 => {
            if f.len() >= 14 {
                let ethertype =
                    *rng.pick(&[0x0806u16, 0x86dd, 0x8100, 0x88a8, 0x8847, 0x0000, 0xffff]);
                put16(f, 12, ethertype);
            }
        }
        // Ethernet padding after the IP datagram.
        13 => {
            let n = 1 + rng.below(64);
            f.extend(rng.bytes(n));
        }
        // A UDP checksum of 0 ("none").
        14 => {
            if let Some(v) = v
                && v.proto == UDP
                && v.l4 + 8 <= f.len()
            {
                put16(f, v.l4 + 6, 0);
            }
        }
        // Another protocol number.
        15 => {
            if view(f).is_some() {
                let any = rng.byte();
                f[23] = *rng.pick(&[ICMP, TCP, UDP, 132, 47, 0, any]);
                fix_ip_csum(f);
            }
        }
        // The L4 checksum broken.
        _ => {
            if let Some(off) = v.and_then(|v| v.l4_csum_off())
                && off + 2 <= f.len()
            {
                f[off] ^= 1 + rng.below(255) as u8;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The checker.

/// Checks one run of `hook` on `input`: what it did, or what was wrong.
pub fn check(
    u: &Universe,
    ct: &dyn Conntrack,
    hook: Hook,
    input: &[u8],
    verdict: u32,
    output: &[u8],
) -> Result<Outcome, String> {
    use verdict::*;
    let (pass, drop, redirect) = match hook {
        Hook::Tc => (TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT),
        Hook::Xdp => (XDP_PASS, XDP_DROP, XDP_REDIRECT),
    };
    if verdict == drop {
        return explain_drop(u, ct, hook, input).map(Outcome::Dropped);
    }
    if verdict != pass && verdict != redirect {
        return Err(format!("verdict {verdict} is not one {hook:?} may give"));
    }
    if output == input {
        return if verdict == pass {
            Ok(Outcome::Untouched)
        } else {
            Err("redirected without a change (routing always takes one off the TTL)".into())
        };
    }
    if hook == Hook::Tc && verdict == redirect && is_reject(u, input, output)? {
        return Ok(if output.len() == input.len() {
            Outcome::Reset
        } else {
            Outcome::PortUnreachable
        });
    }
    translation(u, ct, input, output, verdict == redirect)
}

/// The drop is one the datapath is meant to make.
fn explain_drop(
    u: &Universe,
    ct: &dyn Conntrack,
    hook: Hook,
    input: &[u8],
) -> Result<DropReason, String> {
    let v = view(input).ok_or("dropped a frame that is not IPv4")?;
    let t = v
        .tuple(input)
        .ok_or("dropped a frame whose ports cannot be read")?;
    if let Some((to, true)) = ct.translation(&t) {
        if v.ttl <= 1 {
            return Ok(DropReason::TtlSpent);
        }
        if !u.routable(to.dst) {
            return Ok(DropReason::Unroutable);
        }
        return Err(format!(
            "dropped {t}, routed to {to}, which has a route (TTL {})",
            v.ttl
        ));
    }
    let Some(fe) = u.frontend(t.proto, t.dst, t.dport) else {
        return Err(format!("dropped {t}, which addresses no frontend"));
    };
    if let Some(allowed) = &fe.allowed
        && !allowed.contains(&t.src)
    {
        return Ok(DropReason::SourceRange);
    }
    if fe.backends.is_empty() {
        return Ok(if fe.drop_when_empty {
            DropReason::NoEndpoint
        } else if hook == Hook::Tc {
            DropReason::RejectImpossible
        } else {
            return Err(format!(
                "XDP dropped {t}, to a frontend without endpoints that rejects (XDP leaves rejects to tc)"
            ));
        });
    }
    if v.ttl <= 1 && fe.snat {
        return Ok(DropReason::TtlSpent);
    }
    Err(format!(
        "dropped {t}, a packet to a frontend with endpoints (TTL {})",
        v.ttl
    ))
}

/// Whether `output` is the reject of `input`; an error when it tries to
/// be one and is wrong.
fn is_reject(u: &Universe, input: &[u8], output: &[u8]) -> Result<bool, String> {
    let (Some(vi), Some(vo)) = (view(input), view(output)) else {
        return Ok(false);
    };
    let reversed = vo.src == vi.dst && vo.dst == vi.src;
    let rst = vo.proto == TCP
        && output.len() == input.len()
        && vo.l4 + 14 <= output.len()
        && output[vo.l4 + 13] & 0x04 != 0;
    let icmp = vo.proto == ICMP && vi.proto != ICMP;
    if !reversed || !(rst || icmp) {
        return Ok(false);
    }
    let t = vi.tuple(input).ok_or("a reject of a frame without ports")?;
    let fe = u
        .frontend(t.proto, t.dst, t.dport)
        .ok_or_else(|| format!("a reject of {t}, which addresses no frontend"))?;
    if !fe.backends.is_empty() || fe.drop_when_empty {
        return Err(format!(
            "a reject of {t}, whose frontend has endpoints or drops"
        ));
    }
    if output[0..6] != input[6..12] || output[6..12] != input[0..6] {
        return Err("the reject's Ethernet addresses are not the sender's swapped".into());
    }
    if rst {
        let l4 = vi.l4;
        if input[l4 + 13] & 0x16 != 0x02 {
            return Err(format!(
                "a RST answering flags {:#04x}, not a bare SYN",
                input[l4 + 13]
            ));
        }
        let seq = u32::from_be_bytes(input[l4 + 4..l4 + 8].try_into().unwrap());
        let ack = u32::from_be_bytes(output[l4 + 8..l4 + 12].try_into().unwrap());
        if output[l4 + 13] != 0x14 || ack != seq.wrapping_add(1) {
            return Err(format!(
                "RST flags {:#04x} ack {ack:#x}: want RST|ACK acknowledging {seq:#x} + 1",
                output[l4 + 13]
            ));
        }
        if be16(output, l4) != t.dport || be16(output, l4 + 2) != t.sport {
            return Err("the RST's ports are not the SYN's swapped".into());
        }
        if ip_residual(output, &vo) != ip_residual(input, &vi) {
            return Err("the RST's IP header checksum is wrong".into());
        }
        if l4_residual(output, &vo) != l4_residual(input, &vi) {
            return Err(format!(
                "the RST's TCP checksum is wrong (residual {:?}, the SYN's {:?})",
                l4_residual(output, &vo),
                l4_residual(input, &vi)
            ));
        }
    } else {
        if output.len() != ETH_HLEN + 20 + 8 + 28 || vo.tot_len != 56 || vo.ihl != 20 {
            return Err(format!(
                "an ICMP error of {} bytes (IP total length {}): want 70 and 56",
                output.len(),
                vo.tot_len
            ));
        }
        if output[34] != 3 || output[35] != 3 {
            return Err(format!(
                "ICMP type {} code {}: want 3/3 (port unreachable)",
                output[34], output[35]
            ));
        }
        if ip_residual(output, &vo) != 0 {
            return Err("the ICMP error's IP header checksum is wrong".into());
        }
        if csum(&output[34..70], 0) != 0 {
            return Err("the ICMP checksum is wrong".into());
        }
        if output[42..70] != input[14..42] {
            return Err("the ICMP error does not quote the IP header and 8 bytes".into());
        }
    }
    Ok(true)
}

/// A translation: the same frame with only addresses, ports, checksums and
/// (when routed) TTL and MACs changed, to where the maps say.
fn translation(
    u: &Universe,
    ct: &dyn Conntrack,
    input: &[u8],
    output: &[u8],
    routed: bool,
) -> Result<Outcome, String> {
    if output.len() != input.len() {
        return Err(format!(
            "a {}-byte frame came out as {} bytes, and is no reject",
            input.len(),
            output.len()
        ));
    }
    let vi = view(input).ok_or("changed a frame that is not IPv4")?;
    if vi.proto != TCP && vi.proto != UDP {
        return Err(format!("changed a packet of protocol {}", vi.proto));
    }
    let vo = view(output).ok_or("made an IPv4 frame unreadable")?;
    let ports_move = vi.frag_offset == 0;
    let csum_off = vi.l4_csum_off().filter(|_| ports_move);
    for i in (0..input.len()).filter(|&i| input[i] != output[i]) {
        let allowed = ((i < 12 || i == 22) && routed)
            || (24..34).contains(&i)
            || (ports_move && (vi.l4..vi.l4 + 4).contains(&i))
            || csum_off.is_some_and(|o| (o..o + 2).contains(&i));
        if !allowed {
            return Err(format!(
                "byte {i} changed ({:#04x} -> {:#04x}), outside addresses, ports, checksums{}",
                input[i],
                output[i],
                if routed { ", TTL and MACs" } else { "" }
            ));
        }
    }
    let want_ttl = if routed {
        vi.ttl.wrapping_sub(1)
    } else {
        vi.ttl
    };
    if vo.ttl != want_ttl || (routed && vi.ttl <= 1) {
        return Err(format!(
            "TTL {} -> {} ({})",
            vi.ttl,
            vo.ttl,
            if routed { "routed" } else { "not routed" }
        ));
    }
    if ip_residual(output, &vo) != ip_residual(input, &vi) {
        return Err(format!(
            "IP header checksum: residual {:#06x}, the input's {:#06x}",
            ip_residual(output, &vo),
            ip_residual(input, &vi)
        ));
    }
    if vi.fragment() {
        return fragment(u, ct, input, output, &vi, &vo);
    }
    let l4_in = l4_residual(input, &vi);
    let l4_out = l4_residual(output, &vo);
    if l4_in.is_none() {
        return Err("translated a segment that is not inside the frame".into());
    }
    let off = csum_off.ok_or("no L4 checksum")?;
    let (cin, cout) = (be16(input, off), be16(output, off));
    if vi.proto == UDP && (cin == 0) != (cout == 0) {
        return Err(format!(
            "UDP checksum {cin:#06x} -> {cout:#06x}: 0 (none) must stay 0, and only 0"
        ));
    }
    if !(vi.proto == UDP && cin == 0) && l4_out != l4_in {
        return Err(format!(
            "L4 checksum: residual {l4_out:?}, the input's {l4_in:?} (valid: Some(0))"
        ));
    }
    let ti = vi.tuple(input).ok_or("no ports")?;
    let to = vo.tuple(output).ok_or("no ports")?;
    match ct.translation(&ti) {
        Some((want, want_routed)) if want == to && want_routed == routed => {}
        other => {
            return Err(format!(
                "{ti} became {to} (routed: {routed}); its conntrack entry says {other:?}"
            ));
        }
    }
    consistent(u, &ti, &to)
}

/// The translation `ti` -> `to` follows the programmed frontends.
fn consistent(u: &Universe, ti: &Tuple, to: &Tuple) -> Result<Outcome, String> {
    if let Some(fe) = u.frontend(ti.proto, ti.dst, ti.dport) {
        let hairpin = to.src == u.hairpin_src && to.dst == ti.src && to.sport == ti.sport;
        let snat = fe.snat && to.src == u.node_ip && u.snat_ports.contains(&to.sport);
        let plain = to.src == ti.src && to.sport == ti.sport;
        if fe.backends.contains(&(to.dst, to.dport)) && (plain || hairpin || snat) {
            return Ok(Outcome::Forward { snat, hairpin });
        }
    }
    for fe in u.served_by(ti.proto, ti.src, ti.sport) {
        if (to.src, to.sport) != (fe.addr, fe.port) {
            continue;
        }
        let hairpin = ti.dst == u.hairpin_src && to.dst == ti.src && to.dport == ti.dport;
        let snat = fe.snat && ti.dst == u.node_ip && u.snat_ports.contains(&ti.dport);
        let plain = to.dst == ti.dst && to.dport == ti.dport;
        if plain || hairpin || snat {
            return Ok(Outcome::Reply { snat, hairpin });
        }
    }
    Err(format!(
        "{ti} became {to}: neither a frontend to one of its backends nor a backend's reply"
    ))
}

/// A fragment may be left alone or translated at the IP level, as a
/// conntrack entry between its addresses says; its L4 checksum covers the
/// whole datagram and cannot be checked from one piece.
fn fragment(
    u: &Universe,
    ct: &dyn Conntrack,
    input: &[u8],
    output: &[u8],
    vi: &View,
    vo: &View,
) -> Result<Outcome, String> {
    if let (Some(ti), Some(to)) = (vi.tuple(input), vo.tuple(output))
        && ti != to
    {
        consistent(u, &ti, &to)?;
    }
    let got = (vo.src, vo.dst);
    if got != (vi.src, vi.dst)
        && !ct
            .address_translations(vi.proto, vi.src, vi.dst)
            .contains(&got)
    {
        return Err(format!(
            "fragment {} -> {} became {} -> {}, which no conntrack entry between them says",
            vi.src, vi.dst, vo.src, vo.dst
        ));
    }
    Ok(Outcome::Fragment)
}

/// The addresses and ports of an IPv4 TCP or UDP frame whose L4 header is
/// there.
pub fn tuple_of(f: &[u8]) -> Option<Tuple> {
    view(f)?.tuple(f)
}

/// Hex of a frame, for failure messages.
pub fn hex(f: &[u8]) -> String {
    f.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 2);
    const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
    const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
    const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 11);

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
            node_ip: Ipv4Addr::new(192, 168, 50, 1),
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
        assert_eq!(
            tc_check(&input, verdict::TC_ACT_OK, &good),
            Ok(Outcome::Forward {
                snat: false,
                hairpin: false
            })
        );
        let mut bad_l4 = good.clone();
        bad_l4[14 + 20 + 16] ^= 1;
        assert!(
            tc_check(&input, 0, &bad_l4)
                .unwrap_err()
                .contains("L4 checksum")
        );
        let mut bad_ip = good.clone();
        bad_ip[24] ^= 1;
        assert!(
            tc_check(&input, 0, &bad_ip)
                .unwrap_err()
                .contains("IP header checksum")
        );
        let other_backend = dnat(&input, Ipv4Addr::new(10, 200, 0, 99), 8080);
        assert!(
            tc_check(&input, 0, &other_backend)
                .unwrap_err()
                .contains("conntrack")
        );
        let mut seq = good.clone();
        seq[14 + 20 + 4] ^= 1;
        assert!(tc_check(&input, 0, &seq).unwrap_err().contains("byte 38"));
        assert!(
            tc_check(&input, 9, &input).unwrap_err().contains("verdict"),
            "an unknown verdict"
        );
        assert_eq!(tc_check(&input, 0, &input), Ok(Outcome::Untouched));
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
