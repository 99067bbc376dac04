//! The per-packet pipeline of IPv6 at tc (`tc_ingress6`): conntrack, then
//! the frontend lookup, then what the packet becomes, with the tc verdict.
//! A program of its own rather than more of `tc_ingress`, whose stack is
//! nearly full (docs/architecture.md): IPv4 packets never run this code,
//! IPv6 ones never run IPv4's.
//!
//! This covers the frontends in-cluster clients reach (ClusterIPs, TCP and
//! UDP). Frontends of external traffic (`service_flags::EXTERNAL`) are
//! passed untranslated and counted (`pass_v6_external`); SCTP is passed.
//! ICMPv6 errors quoting a translated flow's packet are translated back
//! (`icmp6_error`); every other ICMPv6 message, neighbour discovery among
//! them, passes untouched. Fragments follow IPv4's rules
//! (`crate::frag`): a later fragment takes its first fragment's ports and
//! its flow's translation, or passes, counted.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use proxy_common::{PROTO_TCP, counter, ct_dir, is_v4_mapped, service_flags};

use crate::{
    conntrack::now_ns,
    conntrack6, frag, frontend, icmp6_error,
    maps::count,
    nat6::Nat6,
    packet::frag::{FIRST, LATER},
    packet6::{self, Flow6, Skip6},
    reject6,
};

/// tc's verdict for an IPv6 packet, after the translation or reply it
/// calls for.
#[inline(always)]
pub fn handle(ctx: &TcContext) -> i32 {
    let mut flow = match packet6::parse(ctx) {
        Ok(flow) => flow,
        Err(Skip6::NotOurs) => return TC_ACT_OK,
        Err(Skip6::Icmp6(icmp_off)) => return icmp6_error::handle(ctx, icmp_off),
        Err(Skip6::Malformed | Skip6::Truncated) => {
            count(counter::PASS_MALFORMED);
            return TC_ACT_OK;
        }
        Err(Skip6::ExtHeaders) => {
            count(counter::PASS_V6_EXT_HEADERS);
            return TC_ACT_OK;
        }
    };
    let now = now_ns();
    if flow.frag == LATER {
        // Translated as its datagram's first fragment was, or not at all.
        let Some((sport_be, dport_be, proto)) = frag::ports6(&flow, now) else {
            count(counter::FRAG_UNTRACKED);
            return TC_ACT_OK;
        };
        flow.sport_be = sport_be;
        flow.dport_be = dport_be;
        flow.proto = proto;
    }
    let key = conntrack6::flow_key(&flow);
    if let Some(ptr) = conntrack6::lookup(&key, &flow, now) {
        // SAFETY: a valid map value pointer for the duration of this program.
        let entry = unsafe { &*ptr };
        let nat = conntrack6::translation(entry, &flow);
        let dir = entry.dir;
        conntrack6::touch(ptr, &flow, &nat, now);
        count(if dir == ct_dir::FORWARD {
            counter::DNAT_ESTABLISHED
        } else {
            counter::REV_NAT
        });
        return finish(ctx, &flow, &nat, now);
    }
    if flow.frag == LATER {
        // Its first fragment made no flow (rejected, dropped, or its
        // conntrack entry gone since): a later fragment never starts one.
        count(counter::FRAG_UNTRACKED);
        return TC_ACT_OK;
    }
    let Some(svc) = frontend::lookup6(flow.dst_be, flow.dport_be, flow.proto) else {
        return TC_ACT_OK;
    };
    if svc.flags & service_flags::EXTERNAL != 0 {
        count(counter::PASS_V6_EXTERNAL);
        return TC_ACT_OK;
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            count(counter::DROP_NO_ENDPOINT);
            return TC_ACT_SHOT;
        }
        count(counter::REJECT);
        return reject(ctx, &flow);
    }
    let Some((backend_id, backend)) = frontend::select_for(&svc, flow.src_be, now) else {
        // The agent is between writing a slot set and its backends; the
        // next packet (a retransmit) will find them.
        count(counter::LOOKUP_MISS);
        return TC_ACT_OK;
    };
    if is_v4_mapped(&backend.addr_be) {
        // An IPv4 backend behind an IPv6 frontend: the planner never
        // writes one, as each family's frontends get that family's
        // endpoints.
        count(counter::LOOKUP_MISS);
        return TC_ACT_OK;
    }
    let nat = Nat6 {
        dst_be: backend.addr_be,
        dport_be: backend.port_be,
        ..Nat6::identity(&flow)
    };
    conntrack6::create(&flow, &nat, backend_id, svc.service_id, now);
    count(counter::DNAT_NEW);
    finish(ctx, &flow, &nat, now)
}

/// Writes the translation; a rewrite that failed half-way leaves a packet
/// with a wrong checksum, which is dropped rather than sent. A first
/// fragment leaves its ports for the later ones first (keyed by its header
/// as it arrived, which they share).
#[inline(always)]
fn finish(ctx: &TcContext, flow: &Flow6, nat: &Nat6, now: u64) -> i32 {
    match flow.frag {
        FIRST => frag::remember6(flow, now),
        LATER => count(counter::FRAG_TRANSLATED),
        _ => {}
    }
    if nat.apply(ctx, flow).is_err() {
        count(counter::DROP_REWRITE);
        return TC_ACT_SHOT;
    }
    TC_ACT_OK
}

#[inline(always)]
fn reject(ctx: &TcContext, flow: &Flow6) -> i32 {
    let rejected = if flow.proto == PROTO_TCP {
        reject6::tcp_reset(ctx, flow)
    } else {
        reject6::icmp_port_unreachable(ctx, flow)
    };
    rejected.unwrap_or_else(|_| {
        count(counter::DROP_REJECT_FAILED);
        TC_ACT_SHOT
    })
}
