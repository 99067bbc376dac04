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
//! IPv4 and IPv6 share the map and this code (over `Family`, whose
//! `frag_key` says what ties a family's fragments): IPv4 keyed by
//! IPv4-mapped addresses and its 16-bit id widened, IPv6 by its addresses
//! and its fragment header's 32-bit id. An IPv6
//! first fragment's extension headers past its fragment header are walked
//! to its transport header (`packet6`), whose protocol the later fragments
//! take from here.

use proxy_common::{FRAG_TIMEOUT_NS, FragValue};

use crate::{family::Family, maps::FRAGMENTS, packet::FlowOf};

/// Notes the ports of a first fragment about to be translated, for its
/// datagram's later fragments; where the family's key has no protocol
/// (IPv6's), the protocol too.
#[inline(always)]
pub fn remember<F: Family>(flow: &FlowOf<F::Addr>, now: u64) {
    let value = FragValue {
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto6: if F::FRAG_KEY_HAS_PROTO {
            0
        } else {
            u32::from(flow.proto)
        },
        seen_ns: now,
    };
    let _ = FRAGMENTS.insert(&F::frag_key(flow), &value, 0);
}

/// The ports and transport protocol of a later fragment's datagram, as its
/// first fragment showed them, if that was translated here within the
/// reassembly timeout.
#[inline(always)]
pub fn ports<F: Family>(flow: &FlowOf<F::Addr>, now: u64) -> Option<(u16, u16, u8)> {
    // SAFETY: a valid map value pointer for this program's run.
    let seen = FRAGMENTS
        .get_ptr(&F::frag_key(flow))
        .map(|p| unsafe { *p })?;
    if now.saturating_sub(seen.seen_ns) > FRAG_TIMEOUT_NS {
        return None;
    }
    let proto = if F::FRAG_KEY_HAS_PROTO {
        flow.proto
    } else {
        seen.proto6 as u8
    };
    Some((seen.sport_be, seen.dport_be, proto))
}
