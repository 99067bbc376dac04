//! The per-packet pipeline shared by every hook: conntrack, then frontend
//! lookup, then translation or reject.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use proxy_common::{PROTO_SCTP, PROTO_TCP, counter, ct_dir, ct_flags, is_v4_mapped, service_flags};

use crate::{
    conntrack, lb,
    maps::count,
    nat::{self, Side},
    packet::{self, Flow, Skip},
    reject,
};

#[inline(always)]
pub fn handle(ctx: &TcContext) -> i32 {
    let flow = match packet::parse(ctx) {
        Ok(flow) => flow,
        Err(Skip::NotOurs) => return TC_ACT_OK,
        Err(Skip::Malformed) => {
            count(counter::PASS_MALFORMED);
            return TC_ACT_OK;
        }
    };
    if flow.proto == PROTO_SCTP {
        // SCTP needs its CRC32c recomputed on every rewrite, which the
        // datapath does not do yet: such packets are counted and passed, and
        // the agent says so when it programs an SCTP frontend.
        if lb::lookup_service(flow.dst_be, flow.dport_be, flow.proto).is_some() {
            count(counter::UNSUPPORTED_PROTO);
        }
        return TC_ACT_OK;
    }
    let now = conntrack::now_ns();
    if let Some((ptr, entry)) = conntrack::lookup(&flow, now) {
        conntrack::touch(ptr, &entry, &flow, now);
        let (side, which) = if entry.dir == ct_dir::FORWARD {
            (Side::Destination, counter::DNAT_ESTABLISHED)
        } else {
            (Side::Source, counter::REV_NAT)
        };
        if !is_v4_mapped(&entry.nat_addr_be) {
            count(counter::LOOKUP_MISS);
            return TC_ACT_OK;
        }
        count(which);
        let mut result = nat::rewrite(ctx, &flow, side, entry.nat_addr_be[3], entry.nat_port_be);
        if result.is_ok() && entry.flags & ct_flags::HAIRPIN != 0 {
            // The other address of a hairpin flow: the hairpin source on the
            // way in, the pod itself on the way back.
            result = if entry.dir == ct_dir::FORWARD {
                nat::rewrite(
                    ctx,
                    &flow,
                    Side::Source,
                    conntrack::hairpin_addr(),
                    flow.sport_be,
                )
            } else {
                nat::rewrite(ctx, &flow, Side::Destination, flow.src_be, flow.dport_be)
            };
        }
        return verdict(result);
    }
    let Some(svc) = lb::lookup_service(flow.dst_be, flow.dport_be, flow.proto) else {
        return TC_ACT_OK;
    };
    new_flow(ctx, &flow, &svc, now)
}

#[inline(always)]
fn new_flow(ctx: &TcContext, flow: &Flow, svc: &proxy_common::ServiceValue, now: u64) -> i32 {
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            count(counter::DROP_NO_ENDPOINT);
            return TC_ACT_SHOT;
        }
        count(counter::REJECT);
        let rejected = if flow.proto == PROTO_TCP {
            reject::tcp_reset(ctx, flow)
        } else {
            reject::icmp_port_unreachable(ctx, flow)
        };
        return rejected.unwrap_or(TC_ACT_SHOT);
    }
    let Some((backend_id, backend)) = lb::select(svc, flow.src_be, now) else {
        // The agent is between writing a slot set and its backends; the
        // next packet (a retransmit) will find them.
        count(counter::LOOKUP_MISS);
        return TC_ACT_OK;
    };
    if !is_v4_mapped(&backend.addr_be) {
        count(counter::LOOKUP_MISS);
        return TC_ACT_OK;
    }
    let hairpin = backend.addr_be[3] == flow.src_be;
    conntrack::create(
        flow,
        backend.addr_be,
        backend.port_be,
        backend_id,
        svc.service_id,
        hairpin,
        now,
    );
    count(counter::DNAT_NEW);
    let mut result = nat::rewrite(
        ctx,
        flow,
        Side::Destination,
        backend.addr_be[3],
        backend.port_be,
    );
    if hairpin && result.is_ok() {
        count(counter::HAIRPIN);
        result = nat::rewrite(
            ctx,
            flow,
            Side::Source,
            conntrack::hairpin_addr(),
            flow.sport_be,
        );
    }
    verdict(result)
}

/// A rewrite that failed half-way leaves a packet with a wrong checksum:
/// drop it rather than send garbage.
#[inline(always)]
fn verdict(result: Result<(), i64>) -> i32 {
    match result {
        Ok(()) => TC_ACT_OK,
        Err(_) => TC_ACT_SHOT,
    }
}
