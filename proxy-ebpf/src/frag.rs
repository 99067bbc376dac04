//! IP fragments. Only a datagram's first fragment carries the L4 header, so
//! only it shows the ports that conntrack and the frontends are keyed by.
//! When the datapath translates a first fragment, it notes the datagram's
//! ports in `FRAGMENTS`, keyed by what ties the fragments together on the
//! wire (addresses, protocol, identification) as they arrived; the later
//! fragments look their ports up there and take the flow's translation, at
//! the IP header only (the L4 checksum sits in the first fragment and was
//! updated there, for the whole datagram). A later fragment whose first one
//! was not translated here (another flow's, or one that arrives first) is
//! passed as it is, and counted: never translated by a guess.
//!
//! IPv4 and IPv6 share the map: IPv4 keyed by IPv4-mapped addresses and its
//! 16-bit id widened, IPv6 by its addresses and its fragment header's 32-bit
//! id. `tc_ingress6` follows the same rules as IPv4's pipeline; an IPv6
//! first fragment's extension headers past its fragment header are walked
//! to its transport header (`packet6`), whose protocol the later fragments
//! take from here.

use proxy_common::{FRAG_TIMEOUT_NS, FragKey, FragValue, v4_mapped};

use crate::{maps::FRAGMENTS, packet::Flow, packet6::Flow6};

#[inline(always)]
fn key(flow: &Flow) -> FragKey {
    FragKey {
        src_be: v4_mapped(flow.src_be),
        dst_be: v4_mapped(flow.dst_be),
        id_be: flow.frag_id_be,
        proto: flow.proto,
        _pad0: 0,
        _pad1: 0,
    }
}

/// IPv6's key: the addresses and the fragment header's identification,
/// what RFC 8200 4.5 reassembles by. Not the protocol: the header after
/// the fragment header may be a destination options header, which a later
/// fragment does not carry past; the first fragment's value holds the
/// transport protocol its chain led to.
#[inline(always)]
fn key6(flow: &Flow6) -> FragKey {
    FragKey {
        src_be: flow.src_be,
        dst_be: flow.dst_be,
        id_be: flow.frag_id_be,
        proto: 0,
        _pad0: 0,
        _pad1: 0,
    }
}

/// Notes the ports of a first fragment about to be translated, for its
/// datagram's later fragments.
#[inline(always)]
pub fn remember(flow: &Flow, now: u64) {
    let value = FragValue {
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto6: 0,
        seen_ns: now,
    };
    let _ = FRAGMENTS.insert(&key(flow), &value, 0);
}

/// `remember` for IPv6.
#[inline(always)]
pub fn remember6(flow: &Flow6, now: u64) {
    let value = FragValue {
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto6: u32::from(flow.proto),
        seen_ns: now,
    };
    let _ = FRAGMENTS.insert(&key6(flow), &value, 0);
}

/// The ports of a later fragment's datagram, as its first fragment showed
/// them, if that was translated here within the reassembly timeout.
#[inline(always)]
pub fn ports(flow: &Flow, now: u64) -> Option<(u16, u16)> {
    lookup(&key(flow), now)
}

/// `ports` for IPv6, with the datagram's transport protocol.
#[inline(always)]
pub fn ports6(flow: &Flow6, now: u64) -> Option<(u16, u16, u8)> {
    // SAFETY: a valid map value pointer for this program's run.
    let seen = FRAGMENTS.get_ptr(&key6(flow)).map(|p| unsafe { *p })?;
    if now.saturating_sub(seen.seen_ns) > FRAG_TIMEOUT_NS {
        return None;
    }
    Some((seen.sport_be, seen.dport_be, seen.proto6 as u8))
}

#[inline(always)]
fn lookup(key: &FragKey, now: u64) -> Option<(u16, u16)> {
    // SAFETY: a valid map value pointer for this program's run.
    let seen = FRAGMENTS.get_ptr(key).map(|p| unsafe { *p })?;
    if now.saturating_sub(seen.seen_ns) > FRAG_TIMEOUT_NS {
        return None;
    }
    Some((seen.sport_be, seen.dport_be))
}
