//! The per-packet pipeline, written once over the family and the hook:
//! conntrack, then the frontend lookup, then what the packet becomes, in
//! the hook's verdict (`verdict::Verdicts`). What differs between IPv4 and
//! IPv6 is asked of the family (`family::PipelineFamily`); each family is a
//! program of its own (`tc_ingress` and `tc_ingress6`, `xdp_ingress` and
//! `xdp_ingress6`), so that neither runs the other's code and each has its
//! own stack and verifier budget (docs/architecture.md, "IPv6").
//!
//! Every frontend of TCP and UDP: ClusterIPs, NodePorts on the node's
//! addresses, LoadBalancer IPs and ExternalIPs, with their traffic
//! policies, source ranges, SNAT and hairpin. A packet whose new source is
//! an address of this node is routed and redirected (`route`). At XDP a
//! packet is finished only where it can be sent back out of the interface
//! it came in on (or passed to the stack translated); everything else is
//! left untouched to tc. ICMP errors quoting a translated flow's packet are
//! translated back (`icmp_error`); every other ICMP message passes
//! untouched. SCTP is translated as TCP and UDP are, its associations
//! tracked by verification tag (`conntrack::sctp`). With direct server
//! return, an external flow to a backend on another node keeps its client
//! and carries its frontend there, and a packet another node sent so is
//! handed to `tc_dsr` (`crate::dsr`). A later fragment takes its first fragment's ports and its
//! flow's translation, or passes, counted (`frag`). Established flows are
//! served from this CPU's flow cache (`flow_cache`), new ones start in
//! `CT_NEW` (`conntrack`), and rare events go to the datapath log.

mod family;

use aya_ebpf::programs::TcContext;
pub use family::PipelineFamily;
use proxy_common::{
    Backend, CtKeyOf, FlowAddr, PROTO_SCTP, backend_flags, counter, ct_flags, node_config_flags,
    service_flags, trace::reason,
};

use crate::{
    conntrack::{self, NewFlow},
    dsr,
    event_log::Event,
    family::V4,
    flow_cache, frag,
    frontend::{self, Frontend},
    hook::{Hook, TCX_NEXT},
    maps::{count, node_config, node_flags},
    nat::NatOf,
    netfilter_ct,
    packet::{
        self, FlowOf, TCP_FIN, TCP_RST,
        frag::{FIRST, LATER},
    },
    prefilter,
    route::{self, Ahead},
    service_cidr::{self, Unserved},
    service_counters, trace,
    verdict::Verdicts,
};
use family::Source;

/// The hook's verdict for a packet of family `F`, after the translation or
/// reply it calls for. A packet longer than its route's MTU is answered
/// here, from one place: the answer is written out once in the program.
#[inline(always)]
pub fn handle<F: PipelineFamily, H: Verdicts>(ctx: &H) -> H::Verdict {
    match translate::<F, H>(ctx) {
        Ok(verdict) => verdict,
        Err(mtu) => ctx.too_big::<F>(mtu),
    }
}

/// The verdict for a packet, or `Err` with the MTU of the route it is too
/// long for (tc only).
#[inline(always)]
fn translate<F: PipelineFamily, H: Verdicts>(ctx: &H) -> Result<H::Verdict, u16> {
    let mut flow = match F::parse(ctx) {
        Ok(flow) => flow,
        Err(verdict) => return Ok(verdict),
    };
    // A later fragment has no ports to ask with: its first fragment's
    // record answers for it below.
    if flow.frag != LATER
        && let Some(block) = prefilter::turned_away(&flow)
    {
        return Ok(unserved::<F, H>(ctx, &flow, block));
    }
    let now = conntrack::now_ns();
    if flow.frag == LATER {
        // Translated as its datagram's first fragment was, or not at all.
        let Some((sport_be, dport_be, proto)) = frag::ports::<F>(&flow, now) else {
            return Ok(untracked_fragment::<F, H>(&flow));
        };
        flow.sport_be = sport_be;
        flow.dport_be = dport_be;
        flow.proto = proto;
    }
    let mut slot = F::KeySlot::default();
    let Some(key) = F::key(&flow, &mut slot) else {
        return Ok(H::PASS);
    };
    tracked::<F, H>(ctx, &flow, key, now)
}

/// The verdict for a packet whose conntrack key is `key`: its flow's
/// translation, else a new flow's, else what becomes of a packet no
/// frontend answers.
#[inline(always)]
fn tracked<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    key: &CtKeyOf<F::Addr>,
    now: u64,
) -> Result<H::Verdict, u16> {
    let stamp = flow_cache::stamp(key, flow.tcp_flags);
    let known = conntrack::known::<F>(key, &stamp, flow, now);
    if !known.entry.is_null() {
        // SAFETY: see `Known::entry`; read before `seen`, which may move
        // the entry.
        let entry = unsafe { &*known.entry };
        let nat = conntrack::translation(entry, flow);
        if flow.proto == PROTO_SCTP
            && !conntrack::sctp::tag_holds::<F>(entry, known.found.as_ref(), flow, &nat)
        {
            count(counter::DROP_SCTP_VTAG);
            trace::dropped::<F>(H::XDP, reason::SCTP_VTAG, entry.service_id, flow);
            return Ok(H::DROP);
        }
        let dir = entry.dir;
        let counted = service_counters::Seen::of(entry.service_id, dir);
        if let Err(exit) = route_first::<F, H>(ctx, flow, &nat) {
            return exit;
        }
        if route::beyond::<F, H>(ctx, flow.l4_off, flow.proto, entry.path_mtu) {
            // A packet of a flow the stack forwards that is longer than its
            // route's MTU: tc answers it as the stack would, but quoting it
            // as its sender sent it; XDP leaves it to tc.
            if H::XDP {
                count(counter::XDP_TO_TC);
                return Ok(H::PASS);
            }
            F::log(Event::TooBig, flow);
            return Err(entry.path_mtu);
        }
        conntrack::seen::<F>(key, &stamp, known.found.as_ref(), flow, &nat, dir, now);
        counted.count(ctx);
        return Ok(finish::<F, H>(ctx, flow, &nat, now));
    }
    if flow.frag == LATER {
        // Its first fragment made no flow (rejected, dropped, or its
        // conntrack entry gone since): a later fragment never starts one.
        return Ok(untracked_fragment::<F, H>(flow));
    }
    // IPv6 at tc serves it in a program of its own, which the verifier
    // walks apart (`PipelineFamily::NEW_FLOW_APART`).
    if F::NEW_FLOW_APART && !H::XDP {
        return Ok(hand_off::<F, H>(ctx, flow, known.reopened_port_be, now));
    }
    first_packet::<F, H>(ctx, flow, known.reopened_port_be, now)
}

/// The verdict for a packet the prefilter passed that conntrack does not
/// know: a new flow's, if a frontend has it, else what becomes of a packet
/// no frontend answers.
#[inline(always)]
fn first_packet<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    reopened_be: u16,
    now: u64,
) -> Result<H::Verdict, u16> {
    // The prefilter passed a packet conntrack does not know either for its
    // destination or, as a pod's reply to a client that reached it by its
    // pod IP, for its source: for the second its bits answer for the
    // frontend lookups, as they do for a packet from no backend.
    let (frontend, block) = match prefilter::for_no_frontend(flow) {
        Some(block) => (None, block),
        None => (
            frontend::lookup_frontend_of(&flow.dst_be, flow.dport_be, flow.proto, || {
                frontend::in_cluster(flow.src_be.mapped())
                    || frontend::local_iface(ctx.ingress_ifindex())
            }),
            prefilter::Block::Unread,
        ),
    };
    let Some(frontend) = frontend else {
        return Ok(unserved::<F, H>(ctx, flow, block));
    };
    if flow.proto == PROTO_SCTP && flow.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        // An ABORT or SHUTDOWN COMPLETE ends an association; it never
        // starts one (its peer has none to end through this frontend).
        return Ok(H::PASS);
    }
    new_flow::<F, H>(ctx, flow, &frontend, reopened_be, now)
}

/// What a program hands its family's program for new flows
/// (`PipelineFamily::NEW_FLOW_APART`): the packet's flow as it parsed it,
/// the source port a closed flow of its tuple left (`conntrack::Known`),
/// and the clock. The flow is handed on, not parsed again: read from a
/// map, its fields are values the verifier knows nothing of, so that it
/// walks the new flow's paths once, where after a parse it would walk
/// them once for each of the parser's outcomes.
#[derive(Clone, Copy)]
pub struct Handoff<A> {
    flow: FlowOf<A>,
    reopened_be: u16,
    now: u64,
}

/// Hands a packet conntrack does not know on to the family's program for
/// new flows (`Verdicts::new_flow_apart`), its `Handoff` in this CPU's
/// room (`PipelineFamily::handoff`).
#[inline(always)]
fn hand_off<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    reopened_be: u16,
    now: u64,
) -> H::Verdict {
    let Some(slot) = F::handoff() else {
        count(counter::LOOKUP_MISS);
        return H::PASS;
    };
    // SAFETY: this CPU's room, which nothing else uses while this program
    // and the one it calls run (`PipelineFamily::handoff`).
    unsafe {
        *slot = Handoff {
            flow: *flow,
            reopened_be,
            now,
        };
    }
    ctx.new_flow_apart()
}

/// `tc_new6`: a packet its family's tc program handed on (`hand_off`),
/// served as `tracked` would have served it (`first_packet`), a packet
/// longer than its route's MTU answered as `handle` answers it. A program
/// of its own so that the verifier walks a new flow's many paths
/// (frontend, backend, source, route, inserts, rewrite) apart from the
/// rest of the family's (bench/README.md, "A new IPv6 flow at tc in a
/// program of its own"). What the handoff holds is taken as unchecked, as
/// the program can run with whatever was left there: the transport
/// header's offset is bounded again as the parser bounds it (for the
/// verifier; every read at it is checked against the packet's end all the
/// same), and a later fragment, which never starts a flow, is refused.
#[inline(always)]
pub fn new_flow_apart<F: PipelineFamily>(ctx: &TcContext) -> i32 {
    let Some(handoff) = F::handoff() else {
        return TCX_NEXT;
    };
    // SAFETY: this CPU's room, written by the program that called this one
    // (`PipelineFamily::handoff`).
    let Handoff {
        flow,
        reopened_be,
        now,
    } = unsafe { *handoff };
    if flow.l4_off > F::MAX_L4_OFF || flow.frag == LATER {
        return TCX_NEXT;
    }
    match first_packet::<F, TcContext>(ctx, &flow, reopened_be, now) {
        Ok(verdict) => verdict,
        Err(mtu) => ctx.too_big::<F>(mtu),
    }
}

/// `tc_dsr` and `tc_dsr6`: a packet another node sent here by direct
/// server return (`Verdicts::dsr`), parsed again, keyed by the frontend its
/// carrier names: its flow's entries touched as any packet's are, or
/// created if it has none (`dsr::arrived`). The packet goes on as it came: the
/// entry node translated it. A later fragment has nothing to add.
#[inline(always)]
pub fn dsr_arrival<F: PipelineFamily>(ctx: &TcContext) -> i32 {
    let Some(flow) = F::reparse(ctx) else {
        return TCX_NEXT;
    };
    if flow.frag == LATER {
        return TCX_NEXT;
    }
    let Some((frontend, port_be)) = dsr::accepted::<F, TcContext>(ctx, &flow) else {
        return TCX_NEXT;
    };
    let mut slot = F::KeySlot::default();
    let Some(key) = F::key(&flow, &mut slot) else {
        return TCX_NEXT;
    };
    key.dst_be = frontend;
    key.dport_be = port_be;
    let now = conntrack::now_ns();
    let stamp = flow_cache::stamp(key, flow.tcp_flags);
    let known = conntrack::known::<F>(key, &stamp, &flow, now);
    if known.entry.is_null() {
        dsr::arrived::<F>(&flow, frontend, port_be, now);
        return TCX_NEXT;
    }
    // SAFETY: see `Known::entry`; read before `seen`, which may move it.
    let entry = unsafe { &*known.entry };
    let nat = conntrack::translation(entry, &flow);
    conntrack::seen::<F>(
        key,
        &stamp,
        known.found.as_ref(),
        &flow,
        &nat,
        entry.dir,
        now,
    );
    TCX_NEXT
}

/// A packet no frontend answers: passed, or if it is for a service CIDR,
/// dropped or rejected (`service_cidr`). One passed that may carry a direct
/// server return option (to a backend of this node, from the node that
/// DNATed it) is keyed by the frontend the option names, in a program of
/// its own (`crate::dsr`), so that the verifier walks none of this one's
/// paths again for it: the test costs other packets one comparison. Asked
/// after the service CIDRs, so that options of the carrier's length do not
/// take a packet to an unallocated address past their drop.
#[inline(always)]
fn unserved<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    block: prefilter::Block,
) -> H::Verdict {
    match service_cidr::unserved(flow, block, H::XDP) {
        Unserved::Pass if dsr::may_carry::<F>(flow) => ctx.dsr(F::DSR_SLOT),
        Unserved::Pass => H::PASS,
        Unserved::Drop => {
            // Left before its key was built (`translate`).
            F::keyed(flow);
            trace::dropped::<F>(H::XDP, reason::UNALLOCATED, 0, flow);
            H::DROP
        }
        Unserved::Reject if H::XDP => {
            count(counter::XDP_TO_TC);
            H::PASS
        }
        Unserved::Reject => {
            F::keyed(flow);
            trace::rejected::<F>(0, flow);
            ctx.reject::<F>(flow)
        }
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

/// A new flow refused for want of a free SNAT port: counted (on the node
/// and its Service), logged and dropped.
#[inline(always)]
fn snat_exhausted<F: PipelineFamily, H: Verdicts>(
    service_id: u32,
    flow: &FlowOf<F::Addr>,
) -> H::Verdict {
    count(counter::SNAT_EXHAUSTED);
    service_counters::snat_exhausted(service_id);
    F::log(Event::SnatExhausted, flow);
    trace::dropped::<F>(H::XDP, reason::SNAT_EXHAUSTED, service_id, flow);
    H::DROP
}

/// The first packet of a flow to `frontend`: source ranges, then the
/// backend, then the client's source (`PipelineFamily::new_source`): kept,
/// or this node's address for a flow from outside to a backend elsewhere
/// (externalTrafficPolicy Cluster) and, over IPv6, for a hairpin flow,
/// which over IPv4 takes a fixed address. A SNATed flow whose tuple a
/// closed flow had takes that flow's port if it can (`reopened_be`, see
/// `conntrack::Known`).
#[inline(always)]
fn new_flow<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    frontend: &Frontend,
    reopened_be: u16,
    now: u64,
) -> Result<H::Verdict, u16> {
    if netfilters::<F, H>(ctx, flow, frontend) {
        return Ok(H::PASS);
    }
    if let Some(verdict) = refused::<F, H>(ctx, flow, frontend) {
        return Ok(verdict);
    }
    let svc = &frontend.svc;
    let ports = frontend::FlowPorts {
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto: flow.proto,
    };
    let Some((backend_id, backend)) = frontend::select(svc, flow.src_be.mapped(), Some(ports), now)
    else {
        // The agent is between writing a slot set and its backends; the
        // next packet (a retransmit) will find them.
        count(counter::LOOKUP_MISS);
        return Ok(H::PASS);
    };
    let Some(backend_be) = F::backend_addr(&backend) else {
        count(counter::LOOKUP_MISS);
        return Ok(H::PASS);
    };
    let mut nf = NewFlow {
        nat: NatOf {
            dst_be: backend_be,
            dport_be: backend.port_be,
            ..NatOf::identity(flow)
        },
        backend_id,
        service_id: svc.service_id,
        kind: 0,
        reply_redirect: frontend.on_node,
        path_mtu: 0,
    };
    // `==`, not `FlowAddr::same`: with the branchless compare, `tc_ingress6`
    // went past the verifier's limit (docs/architecture.md, "One pipeline
    // over both families").
    let hairpin = backend_be == flow.src_be;
    let remote = backend.flags & backend_flags::LOCAL == 0;
    let direct = !hairpin && dsr::sends::<F>(flow, frontend, remote);
    let snat = !hairpin && !direct && masquerades::<F, H>(ctx, flow, svc.flags, &backend);
    let source = F::new_source(hairpin, snat);
    match source {
        Source::Node(node) => {
            nf.kind = if hairpin {
                ct_flags::HAIRPIN
            } else {
                ct_flags::SNAT
            };
            nf.nat.src_be = node;
            nf.nat.redirect = true;
        }
        Source::Keep if direct => {
            nf.nat.redirect = true;
            nf.nat.dsr = 1;
        }
        Source::Fixed(_) | Source::Keep => {}
    }
    // One route for the flows the datapath sends itself, before their
    // entries exist; the verifier walks it once rather than once an arm.
    if let Err(exit) = route_first::<F, H>(ctx, flow, &nf.nat) {
        return exit;
    }
    match source {
        Source::Node(_) => {
            let config = node_config();
            if !conntrack::create_snat::<F>(
                flow,
                &mut nf,
                config.snat_port_min,
                config.snat_port_max,
                reopened_be,
                now,
            ) {
                return Ok(snat_exhausted::<F, H>(svc.service_id, flow));
            }
            count(if hairpin {
                counter::HAIRPIN
            } else {
                counter::SNAT_NEW
            });
        }
        Source::Keep if direct => {
            conntrack::create::<F>(flow, &nf, now);
            count(counter::DSR_NEW);
        }
        Source::Fixed(_) | Source::Keep => {
            if !keep_port::<F, H>(ctx, flow, &mut nf, source, reopened_be, now) {
                return Ok(snat_exhausted::<F, H>(svc.service_id, flow));
            }
        }
    }
    count(counter::DNAT_NEW);
    service_counters::new_flow(ctx, svc.service_id);
    trace::translated::<F>(
        H::XDP,
        svc.service_id,
        flow,
        &nf.nat.dst_be,
        nf.nat.dport_be,
    );
    Ok(finish::<F, H>(ctx, flow, &nf.nat, now))
}

/// Creates the new flow `nf` of `flow` whose client's port is kept unless it
/// clashes at the backend (`conntrack::create_kept`): from the client's own
/// address, or from a hairpin flow's fixed one (IPv4's `Source::Fixed`),
/// which keeps the port as the client's address does and clashes as it
/// does. False when it clashed and no other port was free.
#[inline(always)]
fn keep_port<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    nf: &mut NewFlow<F::Addr>,
    source: Source<F::Addr>,
    reopened_be: u16,
    now: u64,
) -> bool {
    // Never `Fixed` over IPv6, whose hairpin flows take the node's
    // address: the hairpin count is asked of `source`, not of `hairpin`,
    // so that its program has no such branch for the verifier to walk.
    let fixed = if let Source::Fixed(addr) = source {
        nf.kind = ct_flags::HAIRPIN;
        nf.nat.src_be = addr;
        true
    } else {
        false
    };
    nf.path_mtu = route::path_mtu::<F, H>(ctx, flow.proto, &nf.nat.src_be, &nf.nat.dst_be);
    let Some(sport_be) = conntrack::create_kept::<F>(flow, nf, reopened_be, now) else {
        return false;
    };
    nf.nat.sport_be = sport_be;
    if fixed {
        count(counter::HAIRPIN);
    }
    true
}

/// What becomes of a new flow `frontend` refuses: a client outside its
/// source ranges, dropped; none while it has no endpoints, dropped or
/// rejected as its Service says (XDP leaves rejects to tc). None for a
/// flow it takes.
#[inline(always)]
fn refused<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    frontend: &Frontend,
) -> Option<H::Verdict> {
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0
        && !frontend::source_allowed(frontend, flow.src_be.mapped())
    {
        count(counter::DROP_SOURCE_RANGE);
        service_counters::source_range(svc.service_id);
        F::log(Event::SourceRange, flow);
        trace::dropped::<F>(H::XDP, reason::SOURCE_RANGE, svc.service_id, flow);
        return Some(H::DROP);
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            count(counter::DROP_NO_ENDPOINT);
            service_counters::no_endpoint(svc.service_id);
            F::log(Event::NoEndpoint, flow);
            trace::dropped::<F>(H::XDP, reason::NO_ENDPOINT, svc.service_id, flow);
            return Some(H::DROP);
        }
        if H::XDP {
            count(counter::XDP_TO_TC);
            return Some(H::PASS);
        }
        count(counter::REJECT);
        service_counters::rejected(svc.service_id);
        trace::rejected::<F>(svc.service_id, flow);
        return Some(ctx.reject::<F>(flow));
    }
    None
}

/// Whether a new flow to `backend`, not its own client, takes the node's
/// address as its source: always with `MASQUERADE_ALL` (IPv4's
/// `NODE_CONFIG`, for both families); from outside to a backend on another
/// node (externalTrafficPolicy Cluster); and with `MASQUERADE_OFF_CLUSTER`,
/// from a client neither in the cluster nor behind one of this node's pod
/// interfaces.
#[inline(always)]
fn masquerades<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    svc_flags: u32,
    backend: &Backend,
) -> bool {
    node_flags() & node_config_flags::MASQUERADE_ALL != 0
        || if svc_flags & service_flags::EXTERNAL != 0 {
            backend.flags & backend_flags::LOCAL == 0
        } else {
            F::node_flags() & node_config_flags::MASQUERADE_OFF_CLUSTER != 0
                && !frontend::in_cluster(flow.src_be.mapped())
                && !frontend::local_iface(ctx.ingress_ifindex())
        }
}

/// Whether the packet is left to the stack as a flow netfilter translates
/// (kube-proxy's, after a takeover) or as the answer to a flow it
/// masqueraded: when netfilter knows its tuple, asked through the hook's
/// own lookup kfunc (XDP passes it on to tc, which asks again and counts
/// it). Asked for a frontend on this node's own address at all times: the
/// answer to a flow masqueraded to one of its ports (a CNI's
/// `--random-fully` masquerade may pick a NodePort's) reaches that
/// frontend, where kube-proxy's rules never see it (conntrack takes it as
/// the reply first). Asked for other frontends only while kube-proxy's
/// flows may live.
#[inline(always)]
fn netfilters<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    frontend: &Frontend,
) -> bool {
    if !netfilter_ct::may_be_netfilters(flow.proto, flow.tcp_flags)
        || (!frontend.on_node && node_flags() & node_config_flags::NETFILTER_FLOWS == 0)
    {
        return false;
    }
    let theirs = F::netfilter_has(ctx, flow);
    if theirs {
        count(if H::XDP {
            counter::XDP_TO_TC
        } else {
            counter::NETFILTER_PASS
        });
    }
    theirs
}

/// A later fragment whose datagram has no translation: passed untouched.
/// Counted and logged by tc alone, which sees what XDP passes.
#[inline(always)]
fn untracked_fragment<F: PipelineFamily, H: Verdicts>(flow: &FlowOf<F::Addr>) -> H::Verdict {
    if !H::XDP {
        count(counter::FRAG_UNTRACKED);
        F::log(Event::FragUntracked, flow);
    }
    H::PASS
}

/// Routes a packet the datapath sends itself (`nat.redirect`) before
/// anything is written or created (see `crate::route`): `Err` is what
/// becomes of one that cannot go (a verdict, or the MTU it is too long
/// for). XDP sends only back out of the interface it came in on to a
/// resolved neighbour and leaves the rest to tc as it came (counted
/// `xdp_to_tc`); tc answers a packet longer than the route's MTU as a
/// router does and drops one without a route.
#[inline(always)]
fn route_first<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
) -> Result<(), Result<H::Verdict, u16>> {
    if !nat.redirect {
        return Ok(());
    }
    // Arithmetic, not a branch: the verifier keeps one path.
    let room = F::ROOM * u16::from(nat.dsr);
    match route::first::<F, H>(ctx, flow.l4_off, flow.proto, room, &nat.src_be, &nat.dst_be) {
        Ahead::Go => Ok(()),
        Ahead::ToTc => Err(Ok(H::PASS)),
        Ahead::TooBig(mtu) => {
            // The client is told what is left once the carrier is in.
            F::log(Event::TooBig, flow);
            Err(Err(mtu.saturating_sub(room)))
        }
        Ahead::Unroutable => {
            F::log(Event::NoRoute, flow);
            Err(Ok(H::DROP))
        }
    }
}

/// Adds the DSR carrier to a translated packet, by the hook's own means.
#[inline(always)]
fn carry<F: PipelineFamily, H: Verdicts>(ctx: &H, flow: &FlowOf<F::Addr>) -> Result<(), ()> {
    if let Some(tc) = ctx.tc() {
        return F::carry(tc, flow).map_err(|_| ());
    }
    match ctx.xdp() {
        Some(xdp) => F::carry_xdp(xdp, flow),
        None => Err(()),
    }
}

/// Writes the translation; a rewrite that failed half-way leaves a packet
/// with a wrong checksum, which is dropped rather than sent. A first
/// fragment leaves its ports for the later ones first (keyed by its header
/// as it arrived, which they share).
#[inline(always)]
fn finish<F: PipelineFamily, H: Verdicts>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    now: u64,
) -> H::Verdict {
    match flow.frag {
        FIRST => frag::remember::<F>(flow, now),
        LATER => count(counter::FRAG_TRANSLATED),
        _ => {}
    }
    if nat.apply::<F, H>(ctx, flow).is_err() {
        count(counter::DROP_REWRITE);
        F::log(Event::Rewrite, flow);
        return H::DROP;
    }
    if !nat.redirect {
        return ctx.onward::<F>(flow, nat);
    }
    // The carrier goes in last: the rewrite's offsets are the packet's as
    // it came.
    if nat.dsr != 0 && carry::<F, H>(ctx, flow).is_err() {
        count(counter::DROP_REWRITE);
        F::log(Event::Rewrite, flow);
        return H::DROP;
    }
    count(counter::REDIRECT);
    ctx.send::<F>(flow, nat)
}
