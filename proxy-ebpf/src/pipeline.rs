//! The per-packet pipeline shared by every hook: conntrack, then frontend
//! lookup, then a decision on what the packet becomes. The hooks carry the
//! decision out (`verdict`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_SCTP, backend_flags, counter, ct_flags, is_v4_mapped, node_config_flags, service_flags,
    trace::reason,
};

use crate::{
    conntrack::{self, NewFlow},
    event_log::{self, Event},
    family::V4,
    flow_cache, frag,
    frontend::{self, Frontend},
    hook::Hook,
    icmp_error::{self, Verdict},
    maps::{count, node_config, node_flags},
    nat::NatOf,
    netfilter_ct,
    packet::{self, Flow, Skip, frag::FIRST, frag::LATER},
    prefilter,
    route::{self, Ahead},
    service_cidr::{self, Unserved},
    service_counters, trace,
    verdict::Action,
};

#[inline(always)]
pub fn handle<H: Hook>(ctx: &H) -> Action {
    let mut flow = match packet::parse(ctx) {
        Ok(flow) => flow,
        Err(Skip::NotIpv4) => return Action::Next,
        Err(Skip::NotOurs) => return Action::Pass,
        // An error among them may be about a translated flow; XDP leaves
        // them to tc, which can route what it rewrites.
        Err(Skip::Icmp) => return ctx.tc().map_or(Action::Pass, icmp),
        // Counted by tc, which sees the same packet next.
        Err(Skip::Malformed | Skip::Truncated(_)) if H::XDP => return Action::Pass,
        Err(Skip::Malformed | Skip::Truncated(_)) => {
            count(counter::PASS_MALFORMED);
            return Action::Pass;
        }
    };
    // A later fragment has no ports to ask with: its first fragment's
    // record answers for it below.
    if flow.frag != LATER
        && let Some(block) = prefilter::turned_away(&flow)
    {
        return unserved::<H>(&flow, block);
    }
    let now = conntrack::now_ns();
    if flow.frag == LATER {
        // Translated as its datagram's first fragment was, or not at all.
        let Some((sport_be, dport_be, _)) = frag::ports::<V4>(&flow, now) else {
            return untracked_fragment::<H>(&flow);
        };
        flow.sport_be = sport_be;
        flow.dport_be = dport_be;
    }
    if flow.proto == PROTO_SCTP {
        // SCTP needs its CRC32c recomputed on every rewrite, which the
        // datapath does not do yet: such packets are counted and passed, and
        // the agent says so when it programs an SCTP frontend. Counted by tc
        // alone, which sees what XDP passes: once a packet.
        if !H::XDP && frontend::lookup_frontend(&flow, ctx.ingress_ifindex()).is_some() {
            count(counter::UNSUPPORTED_PROTO);
        }
        return Action::Pass;
    }
    let key = conntrack::flow_key(&flow);
    let stamp = flow_cache::stamp(&key, flow.tcp_flags);
    let known = conntrack::known::<V4>(&key, &stamp, &flow, now);
    if !known.entry.is_null() {
        // SAFETY: see `Known::entry`; read before `seen`, which may move
        // the entry.
        let entry = unsafe { &*known.entry };
        let nat = conntrack::translation(entry, &flow);
        let (dir, path_mtu) = (entry.dir, entry.path_mtu);
        let counted = service_counters::Seen::of(entry.service_id, dir);
        if let Err(action) = route_first(ctx, &flow, &nat) {
            return action;
        }
        if route::beyond::<V4, H>(ctx, flow.l4_off, flow.proto, path_mtu) {
            return too_big::<H>(&flow, path_mtu);
        }
        conntrack::seen::<V4>(&key, &stamp, known.found.as_ref(), &flow, &nat, dir, now);
        counted.count(ctx);
        return finish(ctx, &flow, &nat, now);
    }
    if flow.frag == LATER {
        // Its first fragment made no flow (rejected, dropped, or its
        // conntrack entry gone since): a later fragment never starts one.
        return untracked_fragment::<H>(&flow);
    }
    let Some(frontend) = frontend::lookup_frontend(&flow, ctx.ingress_ifindex()) else {
        return unserved::<H>(&flow, prefilter::Block::Unread);
    };
    new_flow(ctx, &flow, &frontend, now)
}

/// A packet no frontend answers: passed, or if it is for a service CIDR,
/// dropped or rejected (`service_cidr`).
#[inline(always)]
fn unserved<H: Hook>(flow: &Flow, block: prefilter::Block) -> Action {
    match service_cidr::unserved(flow, block, H::XDP) {
        Unserved::Pass => Action::Pass,
        Unserved::Drop => {
            trace::dropped(H::XDP, reason::UNALLOCATED, 0, flow);
            Action::Drop
        }
        Unserved::Reject if H::XDP => {
            count(counter::XDP_TO_TC);
            Action::Pass
        }
        Unserved::Reject => {
            trace::rejected(0, flow);
            Action::Reject(*flow)
        }
    }
}

/// An ICMP error about a translated flow, translated back (tc only), in
/// the pipeline's terms.
#[inline(always)]
fn icmp(ctx: &TcContext) -> Action {
    match icmp_error::handle::<V4, _>(ctx, (), |flow, nat| Action::Redirect(*flow, *nat)) {
        Verdict::Pass => Action::Pass,
        Verdict::Drop => Action::Drop,
        Verdict::Sent(action) => action,
    }
}

/// Parses the packet and creates both conntrack entries of a flow of it, as
/// `new_flow` does, and nothing more: the benchmarks' measure of what the
/// conntrack inserts alone cost. The flow's "backend" is its own
/// destination, so the reply entry is the forward key reversed, a distinct
/// key.
#[inline(always)]
pub fn conntrack_pair<H: Hook>(ctx: &H) {
    if let Ok(flow) = packet::parse(ctx) {
        let nf = NewFlow {
            nat: NatOf::identity(&flow),
            backend_id: 0,
            service_id: 0,
            kind: 0,
            reply_redirect: false,
            path_mtu: 0,
        };
        conntrack::create::<V4>(&flow, &nf, conntrack::now_ns());
    }
}

#[inline(always)]
fn new_flow<H: Hook>(ctx: &H, flow: &Flow, frontend: &Frontend, now: u64) -> Action {
    if let Some(action) = netfilters(ctx, flow) {
        return action;
    }
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !frontend::source_allowed(frontend, flow) {
        count(counter::DROP_SOURCE_RANGE);
        service_counters::source_range(svc.service_id);
        event_log::log(Event::SourceRange, flow);
        trace::dropped(H::XDP, reason::SOURCE_RANGE, svc.service_id, flow);
        return Action::Drop;
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            count(counter::DROP_NO_ENDPOINT);
            service_counters::no_endpoint(svc.service_id);
            event_log::log(Event::NoEndpoint, flow);
            trace::dropped(H::XDP, reason::NO_ENDPOINT, svc.service_id, flow);
            return Action::Drop;
        }
        if H::XDP {
            count(counter::XDP_TO_TC);
            return Action::Pass;
        }
        count(counter::REJECT);
        service_counters::rejected(svc.service_id);
        trace::rejected(svc.service_id, flow);
        return Action::Reject(*flow);
    }
    let Some((backend_id, backend)) = frontend::select(svc, flow.src_be, now) else {
        // The agent is between writing a slot set and its backends; the
        // next packet (a retransmit) will find them.
        count(counter::LOOKUP_MISS);
        return Action::Pass;
    };
    if !is_v4_mapped(&backend.addr_be) {
        count(counter::LOOKUP_MISS);
        return Action::Pass;
    }
    let mut nf = NewFlow {
        nat: NatOf {
            dst_be: backend.addr_be[3],
            dport_be: backend.port_be,
            ..NatOf::identity(flow)
        },
        backend_id,
        service_id: svc.service_id,
        kind: 0,
        reply_redirect: frontend.on_node,
        path_mtu: 0,
    };
    let hairpin = backend.addr_be[3] == flow.src_be;
    let config = node_config();
    let snat = !hairpin
        && (config.flags & node_config_flags::MASQUERADE_ALL != 0
            || if svc.flags & service_flags::EXTERNAL != 0 {
                backend.flags & backend_flags::LOCAL == 0
            } else {
                config.flags & node_config_flags::MASQUERADE_OFF_CLUSTER != 0
                    && !frontend::in_cluster(flow)
                    && !frontend::local_iface(ctx.ingress_ifindex())
            })
        && config.snat_addr_be[3] != 0;
    if hairpin {
        nf.kind = ct_flags::HAIRPIN;
        nf.nat.src_be = conntrack::hairpin_addr();
    } else if snat {
        nf.kind = ct_flags::SNAT;
        nf.nat.src_be = config.snat_addr_be[3];
        nf.nat.redirect = true;
    }
    if let Err(action) = route_first(ctx, flow, &nf.nat) {
        return action;
    }
    if !nf.nat.redirect {
        nf.path_mtu = route::path_mtu::<V4, H>(ctx, flow.proto, &nf.nat.src_be, &nf.nat.dst_be);
    }
    if snat {
        if !conntrack::create_snat::<V4>(
            flow,
            &mut nf,
            config.snat_port_min,
            config.snat_port_max,
            now,
        ) {
            count(counter::SNAT_EXHAUSTED);
            service_counters::snat_exhausted(svc.service_id);
            event_log::log(Event::SnatExhausted, flow);
            trace::dropped(H::XDP, reason::SNAT_EXHAUSTED, svc.service_id, flow);
            return Action::Drop;
        }
        count(counter::SNAT_NEW);
    } else {
        conntrack::create::<V4>(flow, &nf, now);
    }
    count(counter::DNAT_NEW);
    service_counters::new_flow(ctx, svc.service_id);
    trace::translated(H::XDP, svc.service_id, flow, nf.nat.dst_be, nf.nat.dport_be);
    if hairpin {
        count(counter::HAIRPIN);
    }
    finish(ctx, flow, &nf.nat, now)
}

/// A packet of a flow netfilter translates (kube-proxy's, after a takeover):
/// left to it untouched, or at XDP to tc, which can ask. None while no such
/// flow may live, or when netfilter does not know the packet's tuple.
#[inline(always)]
fn netfilters<H: Hook>(ctx: &H, flow: &Flow) -> Option<Action> {
    if node_flags() & node_config_flags::NETFILTER_FLOWS == 0
        || !netfilter_ct::may_be_netfilters(flow.proto, flow.tcp_flags)
    {
        return None;
    }
    // Only tc can ask netfilter's conntrack (the lookup kfunc takes a
    // socket buffer); XDP leaves such packets to it as they came.
    if H::XDP {
        count(counter::XDP_TO_TC);
        return Some(Action::Pass);
    }
    if netfilter_ct::has_v4(
        ctx,
        flow.proto,
        flow.src_be,
        flow.dst_be,
        flow.sport_be,
        flow.dport_be,
    ) {
        count(counter::NETFILTER_PASS);
        return Some(Action::Pass);
    }
    None
}

/// A later fragment whose datagram has no translation: passed untouched.
/// Counted and logged by tc alone, which sees what XDP passes.
#[inline(always)]
fn untracked_fragment<H: Hook>(flow: &Flow) -> Action {
    if !H::XDP {
        count(counter::FRAG_UNTRACKED);
        event_log::log(Event::FragUntracked, flow);
    }
    Action::Pass
}

/// Routes a packet the datapath sends itself (`nat.redirect`) before
/// anything is written or created (see `crate::route`), its answer kept for
/// `finish`. `Err` is what becomes of a packet that cannot go: XDP sends
/// only back out of the interface it came in on to a resolved neighbour and
/// leaves the rest to tc as it came; tc answers a packet longer than the
/// route's MTU and drops one without a route.
#[inline(always)]
fn route_first<H: Hook>(ctx: &H, flow: &Flow, nat: &NatOf<u32>) -> Result<(), Action> {
    if !nat.redirect {
        return Ok(());
    }
    match route::first::<V4, H>(ctx, flow.l4_off, flow.proto, &nat.src_be, &nat.dst_be) {
        Ahead::Go => Ok(()),
        Ahead::ToTc => Err(Action::Pass),
        Ahead::TooBig(mtu) => Err(Action::TooBig(*flow, mtu)),
        Ahead::Unroutable => {
            event_log::log(Event::NoRoute, flow);
            Err(Action::Drop)
        }
    }
}

/// A packet of a flow the stack forwards that is longer than the MTU of
/// the flow's route: tc answers it as the stack would, but quoting it as
/// its sender sent it (`Action::TooBig`); XDP leaves it to tc.
#[inline(always)]
fn too_big<H: Hook>(flow: &Flow, mtu: u16) -> Action {
    if H::XDP {
        count(counter::XDP_TO_TC);
        return Action::Pass;
    }
    Action::TooBig(*flow, mtu)
}

/// Writes the translation and says how the packet leaves. A first
/// fragment leaves its ports for the later ones first (keyed by its header
/// as it arrived, which they share).
#[inline(always)]
fn finish<H: Hook>(ctx: &H, flow: &Flow, nat: &NatOf<u32>, now: u64) -> Action {
    match flow.frag {
        FIRST => frag::remember::<V4>(flow, now),
        LATER => count(counter::FRAG_TRANSLATED),
        _ => {}
    }
    if nat.apply::<V4, H>(ctx, flow).is_err() {
        // A rewrite that failed half-way leaves a packet with a wrong
        // checksum: drop it rather than send garbage.
        count(counter::DROP_REWRITE);
        event_log::log(Event::Rewrite, flow);
        return Action::Drop;
    }
    if !nat.redirect {
        if H::XDP {
            count(counter::XDP_TRANSLATED);
        }
        return Action::Pass;
    }
    count(counter::REDIRECT);
    Action::Redirect(*flow, *nat)
}
