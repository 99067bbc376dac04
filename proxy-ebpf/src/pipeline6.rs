//! The per-packet pipeline of IPv6 (`tc_ingress6`, `xdp_ingress6`):
//! conntrack, then the frontend lookup, then what the packet becomes, with
//! the hook's verdict (`verdict::Verdicts`). Programs of their own rather than more of
//! `tc_ingress` and `xdp_ingress`, whose stacks are nearly full
//! (docs/architecture.md): IPv4 packets never run this code, IPv6 ones
//! never run IPv4's.
//!
//! Every frontend of TCP and UDP, as IPv4's: ClusterIPs, NodePorts on the
//! node's IPv6 addresses, LoadBalancer IPs and ExternalIPs, with their
//! traffic policies, source ranges, SNAT and hairpin. A packet whose new
//! source is an address of this node is routed and redirected (`route`).
//! At XDP a packet is finished only where it can be sent back out of the
//! interface it came in on (or passed to the stack translated); everything
//! else is left untouched to tc, as IPv4's pipeline does. ICMPv6
//! errors quoting a translated flow's packet are translated back
//! (`icmp_error`); every other ICMPv6 message, neighbour discovery among
//! them, passes untouched. SCTP passes untranslated, counted when it was
//! meant for a frontend, as over IPv4. Fragments follow
//! IPv4's rules (`crate::frag`): a later fragment takes its first
//! fragment's ports and its flow's translation, or passes, counted.
//! Established flows are served from this CPU's flow cache
//! (`flow_cache::get`), new ones start in `CT_NEW6` (`conntrack`), and
//! rare events go to the datapath log, as IPv4's.

use proxy_common::{
    PROTO_SCTP, backend_flags, counter, ct_flags, is_v4_mapped, node_config_flags, service_flags,
    trace::reason,
};

use crate::{
    conntrack::{self, NewFlow, now_ns},
    event_log::{self, Event},
    family::V6,
    flow_cache, frag,
    frontend::{self, Frontend},
    maps::{FLOW_KEY6, count, node_addr6, node_config, node_flags, node_flags6},
    nat::NatOf,
    netfilter_ct,
    packet::frag::{FIRST, LATER},
    packet6::{self, Flow6, Skip6},
    prefilter,
    route::{self, Ahead},
    service_cidr::{self, Unserved},
    service_counters, trace,
    verdict::Verdicts,
};

/// The hook's verdict for an IPv6 packet, after the translation or reply
/// it calls for. A packet longer than its route's MTU is answered here,
/// from one place: the answer is written out once in the program.
#[inline(always)]
pub fn handle<H: Verdicts>(ctx: &H) -> H::Verdict {
    match translate(ctx) {
        Ok(verdict) => verdict,
        Err(mtu) => ctx.too_big::<V6>(mtu),
    }
}

/// The verdict for an IPv6 packet, or `Err` with the MTU of the route it
/// is too long for (tc only).
#[inline(always)]
fn translate<H: Verdicts>(ctx: &H) -> Result<H::Verdict, u16> {
    let mut flow = match packet6::parse(ctx) {
        Ok(flow) => flow,
        Err(Skip6::NotOurs) => return Ok(H::PASS),
        Err(Skip6::Icmp6(icmp_off)) => return Ok(ctx.icmp_error::<V6>(icmp_off)),
        // Counted by tc, which sees the same packet next (and may pull in
        // what XDP found cut short).
        Err(Skip6::Malformed | Skip6::Truncated | Skip6::ExtHeaders) if H::XDP => {
            return Ok(H::PASS);
        }
        Err(Skip6::Malformed | Skip6::Truncated) => {
            count(counter::PASS_MALFORMED);
            return Ok(H::PASS);
        }
        Err(Skip6::ExtHeaders) => {
            count(counter::PASS_V6_EXT_HEADERS);
            return Ok(H::PASS);
        }
    };
    // As over IPv4 (`pipeline::handle`).
    if flow.frag != LATER
        && let Some(block) = prefilter::turned_away(&flow)
    {
        return Ok(unserved(ctx, &flow, block));
    }
    let now = now_ns();
    if flow.frag == LATER {
        // Translated as its datagram's first fragment was, or not at all.
        let Some((sport_be, dport_be, proto)) = frag::ports::<V6>(&flow, now) else {
            return Ok(untracked_fragment::<H>(&flow));
        };
        flow.sport_be = sport_be;
        flow.dport_be = dport_be;
        flow.proto = proto;
    }
    let Some(key) = FLOW_KEY6.get_ptr_mut(0) else {
        return Ok(H::PASS);
    };
    // SAFETY: this CPU's entry, used by nothing else while this program
    // runs (tc and XDP run one program at a time on a CPU, neither
    // interrupting the other).
    let key = unsafe {
        *key = conntrack::flow_key(&flow);
        &*key
    };
    let stamp = flow_cache::stamp(key, flow.tcp_flags);
    let known = conntrack::known::<V6>(key, &stamp, &flow, now);
    if !known.entry.is_null() {
        // SAFETY: see `Known::entry`; read before `seen`, which may move
        // the entry.
        let entry = unsafe { &*known.entry };
        let nat = conntrack::translation(entry, &flow);
        let dir = entry.dir;
        let counted = service_counters::Seen::of(entry.service_id, dir);
        if let Err(exit) = route_first(ctx, &flow, &nat) {
            return exit;
        }
        if route::beyond::<V6, H>(ctx, flow.l4_off, flow.proto, entry.path_mtu) {
            // As IPv4's (`pipeline::too_big`).
            if H::XDP {
                count(counter::XDP_TO_TC);
                return Ok(H::PASS);
            }
            event_log::log6(Event::TooBig, &flow);
            return Err(entry.path_mtu);
        }
        conntrack::seen::<V6>(key, &stamp, known.found.as_ref(), &flow, &nat, dir, now);
        counted.count(ctx);
        return Ok(finish(ctx, &flow, &nat, now));
    }
    if flow.frag == LATER {
        // Its first fragment made no flow (rejected, dropped, or its
        // conntrack entry gone since): a later fragment never starts one.
        return Ok(untracked_fragment::<H>(&flow));
    }
    let Some(frontend) =
        frontend::lookup_frontend_of6(flow.dst_be, flow.dport_be, flow.proto, || {
            frontend::in_cluster6(flow.src_be) || frontend::local_iface(ctx.ingress_ifindex())
        })
    else {
        return Ok(unserved(ctx, &flow, prefilter::Block::Unread));
    };
    if flow.proto == PROTO_SCTP {
        // As IPv4's (`pipeline::handle`): not translated, as its CRC32c
        // would need recomputing, and counted, by tc alone, which sees what
        // XDP passes. Found here, past a conntrack lookup that never finds
        // SCTP, so that the frontend lookup is not written out twice.
        if !H::XDP {
            count(counter::UNSUPPORTED_PROTO);
        }
        return Ok(H::PASS);
    }
    new_flow(ctx, &flow, &frontend, now)
}

/// As IPv4's (`pipeline::unserved`).
#[inline(always)]
fn unserved<H: Verdicts>(ctx: &H, flow: &Flow6, block: prefilter::Block) -> H::Verdict {
    match service_cidr::unserved(flow, block, H::XDP) {
        Unserved::Pass => H::PASS,
        Unserved::Drop => {
            // Left before its key was built (`translate`).
            trace::key6(flow);
            trace::dropped6(H::XDP, reason::UNALLOCATED, 0);
            H::DROP
        }
        Unserved::Reject if H::XDP => {
            count(counter::XDP_TO_TC);
            H::PASS
        }
        Unserved::Reject => {
            trace::key6(flow);
            trace::rejected6(0);
            ctx.reject::<V6>(flow)
        }
    }
}

/// The first packet of a flow to `frontend`: IPv4's decisions
/// (`pipeline::new_flow`) for IPv6. Source ranges, then the backend, then
/// the client's source: this node's IPv6 address for a flow from outside
/// to a backend elsewhere (externalTrafficPolicy Cluster), and for a
/// hairpin flow; kept otherwise. Its conntrack entries are built in
/// `SCRATCH6`, not on the stack (docs/architecture.md, "IPv6").
#[inline(always)]
fn new_flow<H: Verdicts>(
    ctx: &H,
    flow: &Flow6,
    frontend: &Frontend,
    now: u64,
) -> Result<H::Verdict, u16> {
    if netfilters(ctx, flow) {
        return Ok(H::PASS);
    }
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0
        && !frontend::source_allowed_for6(frontend, flow.src_be)
    {
        count(counter::DROP_SOURCE_RANGE);
        service_counters::source_range(svc.service_id);
        event_log::log6(Event::SourceRange, flow);
        trace::dropped6(H::XDP, reason::SOURCE_RANGE, svc.service_id);
        return Ok(H::DROP);
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            count(counter::DROP_NO_ENDPOINT);
            service_counters::no_endpoint(svc.service_id);
            event_log::log6(Event::NoEndpoint, flow);
            trace::dropped6(H::XDP, reason::NO_ENDPOINT, svc.service_id);
            return Ok(H::DROP);
        }
        if H::XDP {
            count(counter::XDP_TO_TC);
            return Ok(H::PASS);
        }
        count(counter::REJECT);
        service_counters::rejected(svc.service_id);
        trace::rejected6(svc.service_id);
        return Ok(ctx.reject::<V6>(flow));
    }
    let Some((backend_id, backend)) = frontend::select_for(svc, flow.src_be, now) else {
        // The agent is between writing a slot set and its backends; the
        // next packet (a retransmit) will find them.
        count(counter::LOOKUP_MISS);
        return Ok(H::PASS);
    };
    if is_v4_mapped(&backend.addr_be) {
        // An IPv4 backend behind an IPv6 frontend: the planner never
        // writes one, as each family's frontends get that family's
        // endpoints.
        count(counter::LOOKUP_MISS);
        return Ok(H::PASS);
    }
    let mut nf = NewFlow {
        nat: NatOf {
            dst_be: backend.addr_be,
            dport_be: backend.port_be,
            ..NatOf::identity(flow)
        },
        backend_id,
        service_id: svc.service_id,
        kind: 0,
        reply_redirect: frontend.on_node,
        path_mtu: 0,
    };
    let node = node_addr6();
    let hairpin = backend.addr_be == flow.src_be;
    // `MASQUERADE_ALL` is in IPv4's `NODE_CONFIG`, for both families.
    let snat = !hairpin
        && (node_flags() & node_config_flags::MASQUERADE_ALL != 0
            || if svc.flags & service_flags::EXTERNAL != 0 {
                backend.flags & backend_flags::LOCAL == 0
            } else {
                node_flags6() & node_config_flags::MASQUERADE_OFF_CLUSTER != 0
                    && !frontend::in_cluster6(flow.src_be)
                    && !frontend::local_iface(ctx.ingress_ifindex())
            });
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
        if let Err(exit) = route_first(ctx, flow, &nf.nat) {
            return exit;
        }
        let config = node_config();
        if !conntrack::create_snat::<V6>(
            flow,
            &mut nf,
            config.snat_port_min,
            config.snat_port_max,
            now,
        ) {
            count(counter::SNAT_EXHAUSTED);
            service_counters::snat_exhausted(svc.service_id);
            event_log::log6(Event::SnatExhausted, flow);
            trace::dropped6(H::XDP, reason::SNAT_EXHAUSTED, svc.service_id);
            return Ok(H::DROP);
        }
        count(if hairpin {
            counter::HAIRPIN
        } else {
            counter::SNAT_NEW
        });
    } else {
        nf.path_mtu = route::path_mtu::<V6, H>(ctx, flow.proto, &nf.nat.src_be, &nf.nat.dst_be);
        conntrack::create::<V6>(flow, &nf, now);
    }
    count(counter::DNAT_NEW);
    service_counters::new_flow(ctx, svc.service_id);
    trace::translated6(H::XDP, svc.service_id, &nf.nat.dst_be, nf.nat.dport_be);
    Ok(finish(ctx, flow, &nf.nat, now))
}

/// Whether the packet is left to the stack as a flow netfilter translates
/// (IPv4's `pipeline::netfilters`): at tc when netfilter knows its tuple,
/// at XDP for tc to ask.
#[inline(always)]
fn netfilters<H: Verdicts>(ctx: &H, flow: &Flow6) -> bool {
    if node_flags() & node_config_flags::NETFILTER_FLOWS == 0
        || !netfilter_ct::may_be_netfilters(flow.proto, flow.tcp_flags)
    {
        return false;
    }
    if H::XDP {
        count(counter::XDP_TO_TC);
        return true;
    }
    let theirs = netfilter_ct::has_v6(
        ctx,
        flow.proto,
        &flow.src_be,
        &flow.dst_be,
        flow.sport_be,
        flow.dport_be,
    );
    if theirs {
        count(counter::NETFILTER_PASS);
    }
    theirs
}

/// A later fragment whose datagram has no translation: passed untouched.
/// Counted and logged by tc alone, which sees what XDP passes.
#[inline(always)]
fn untracked_fragment<H: Verdicts>(flow: &Flow6) -> H::Verdict {
    if !H::XDP {
        count(counter::FRAG_UNTRACKED);
        event_log::log6(Event::FragUntracked, flow);
    }
    H::PASS
}

/// Routes a packet the program sends itself (`nat.redirect`) before
/// anything is written or created, as IPv4's `pipeline::route_first`: `Err`
/// is what becomes of one that cannot go (a verdict, or the MTU it is too
/// long for). XDP sends only back out of the
/// interface it came in on to a resolved neighbour and leaves the rest to
/// tc as it came (counted `xdp_to_tc`); tc answers a packet longer than the
/// route's MTU with "packet too big" and drops one without a route.
#[inline(always)]
fn route_first<H: Verdicts>(
    ctx: &H,
    flow: &Flow6,
    nat: &NatOf<[u32; 4]>,
) -> Result<(), Result<H::Verdict, u16>> {
    if !nat.redirect {
        return Ok(());
    }
    match route::first::<V6, H>(ctx, flow.l4_off, flow.proto, &nat.src_be, &nat.dst_be) {
        Ahead::Go => Ok(()),
        Ahead::ToTc => Err(Ok(H::PASS)),
        Ahead::TooBig(mtu) => {
            event_log::log6(Event::TooBig, flow);
            Err(Err(mtu))
        }
        Ahead::Unroutable => {
            event_log::log6(Event::NoRoute, flow);
            Err(Ok(H::DROP))
        }
    }
}

/// Writes the translation; a rewrite that failed half-way leaves a packet
/// with a wrong checksum, which is dropped rather than sent. A first
/// fragment leaves its ports for the later ones first (keyed by its header
/// as it arrived, which they share).
#[inline(always)]
fn finish<H: Verdicts>(ctx: &H, flow: &Flow6, nat: &NatOf<[u32; 4]>, now: u64) -> H::Verdict {
    match flow.frag {
        FIRST => frag::remember::<V6>(flow, now),
        LATER => count(counter::FRAG_TRANSLATED),
        _ => {}
    }
    if nat.apply::<V6, H>(ctx, flow).is_err() {
        count(counter::DROP_REWRITE);
        event_log::log6(Event::Rewrite, flow);
        return H::DROP;
    }
    if !nat.redirect {
        if H::XDP {
            count(counter::XDP_TRANSLATED);
        }
        return H::PASS;
    }
    count(counter::REDIRECT);
    ctx.send::<V6>(flow, nat)
}
