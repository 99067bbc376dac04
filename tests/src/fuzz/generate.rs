//! Frames from the flows of a [`Universe`] (and noise), and the kinds of
//! damage and oddity they are then given.

use std::net::Ipv4Addr;

use super::{
    ICMP, Rng, Tuple, Universe,
    frame::{ETH_HLEN, L4, Packet, fix_ip_csum, fix_l4_csum, put16, view},
};
use crate::frames::{TCP, UDP};

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
            for _ in 0..=rng.below(3) {
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
#[expect(
    clippy::too_many_lines,
    reason = "one match arm per kind of mutation; splitting it would scatter the list of what the fuzzer does"
)]
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
            for _ in 0..=rng.below(4) {
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
                for _ in 0..=rng.below(2) {
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
