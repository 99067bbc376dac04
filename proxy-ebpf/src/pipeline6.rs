//! The per-packet pipeline of IPv6 at tc (`tc_ingress6`): conntrack, then
//! the frontend lookup, then what the packet becomes, with the tc verdict.
//! A program of its own rather than more of `tc_ingress`, whose stack is
//! nearly full (docs/architecture.md): IPv4 packets never run this code,
//! IPv6 ones never run IPv4's.
//!
//! Every frontend of TCP and UDP, as IPv4's: ClusterIPs, NodePorts on the
//! node's IPv6 addresses, LoadBalancer IPs and ExternalIPs, with their
//! traffic policies, source ranges, SNAT and hairpin. A packet whose new
//! source is an address of this node is routed and redirected (`route6`).
//! XDP passes IPv6 to tc, so every IPv6 translation happens here. ICMPv6
//! errors quoting a translated flow's packet are translated back
//! (`icmp6_error`); every other ICMPv6 message, neighbour discovery among
//! them, passes untouched, as SCTP does. Fragments follow
//! IPv4's rules (`crate::frag`): a later fragment takes its first
//! fragment's ports and its flow's translation, or passes, counted.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use proxy_common::{
    PROTO_TCP, backend_flags, counter, ct_dir, ct_flags, is_v4_mapped, service_flags,
};

use crate::{
    conntrack::now_ns,
    conntrack6::{self, NewFlow6},
    frag, icmp6_error,
    frontend::{self, Frontend},
    maps::{count, node_addr6, node_config},
    nat6::Nat6,
    packet::frag::{FIRST, LATER},
    packet6::{self, Flow6, Skip6},
    reject6, route6,
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
    let Some(frontend) =
        frontend::lookup_frontend_of6(flow.dst_be, flow.dport_be, flow.proto, || {
            frontend::in_cluster6(flow.src_be)
        })
    else {
        return TC_ACT_OK;
    };
    new_flow(ctx, &flow, &frontend, now)
}

/// The first packet of a flow to `frontend`: IPv4's decisions
/// (`pipeline::new_flow`) for IPv6. Source ranges, then the backend, then
/// the client's source: this node's IPv6 address for a flow from outside
/// to a backend elsewhere (externalTrafficPolicy Cluster), and for a
/// hairpin flow; kept otherwise. Its conntrack entries are built in
/// `SCRATCH6`, not on the stack (docs/architecture.md, "IPv6").
#[inline(always)]
fn new_flow(ctx: &TcContext, flow: &Flow6, frontend: &Frontend, now: u64) -> i32 {
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0
        && !frontend::source_allowed_for6(frontend, flow.src_be)
    {
        count(counter::DROP_SOURCE_RANGE);
        return TC_ACT_SHOT;
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            count(counter::DROP_NO_ENDPOINT);
            return TC_ACT_SHOT;
        }
        count(counter::REJECT);
        return reject(ctx, flow);
    }
    let Some((backend_id, backend)) = frontend::select_for(svc, flow.src_be, now) else {
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
    let mut nf = NewFlow6 {
        nat: Nat6 {
            dst_be: backend.addr_be,
            dport_be: backend.port_be,
            ..Nat6::identity(flow)
        },
        backend_id,
        service_id: svc.service_id,
        kind: 0,
        reply_redirect: frontend.on_node,
    };
    let node = node_addr6();
    let hairpin = backend.addr_be == flow.src_be;
    let snat = !hairpin
        && svc.flags & service_flags::EXTERNAL != 0
        && backend.flags & backend_flags::LOCAL == 0;
    if (hairpin || snat) && node != [0; 4] {
        // Hairpin flows take the node's address too, where IPv4 takes the
        // fixed `HAIRPIN_ADDR` and keeps the port: an IPv6 link-local
        // source is neither forwarded by the stack nor answered by the pod
        // (its reply would need neighbour discovery for an address no
        // interface holds), and the node's address is what kube-proxy's
        // masquerade gives them (docs/kube-proxy-semantics.md). Its port
        // comes from the SNAT range, below the node's own sockets' ports.
        nf.kind = if hairpin {
            ct_flags::HAIRPIN
        } else {
            ct_flags::SNAT
        };
        nf.nat.src_be = node;
        nf.nat.redirect = true;
        let config = node_config();
        if !conntrack6::create_snat(
            flow,
            &mut nf,
            config.snat_port_min,
            config.snat_port_max,
            now,
        ) {
            count(counter::SNAT_EXHAUSTED);
            return TC_ACT_SHOT;
        }
        count(if hairpin {
            counter::HAIRPIN
        } else {
            counter::SNAT_NEW
        });
    } else {
        conntrack6::create(flow, &nf, now);
    }
    count(counter::DNAT_NEW);
    finish(ctx, flow, &nf.nat, now)
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
    if !nat.redirect {
        return TC_ACT_OK;
    }
    count(counter::REDIRECT);
    route6::redirect(ctx, flow.proto, &nat.src_be, &nat.dst_be)
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
