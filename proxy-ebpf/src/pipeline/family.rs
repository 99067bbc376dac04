//! What the pipeline (`crate::pipeline`), written once over the family,
//! asks of each family: its parser and what becomes of a packet it does
//! not parse, where its conntrack key is built, the backends it may
//! translate to, the node's settings that are its own, the source a flow
//! takes where the client's cannot stay, and netfilter's question.
//! The rest (records, logs, conntrack, NAT, routes, errors) it reaches
//! through the traits of the layers below, which `PipelineFamily` gathers.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use proxy_common::{Backend, CtKeyOf, counter, is_v4_mapped};

use super::Handoff;

use crate::{
    conntrack,
    dsr::DsrFamily,
    family::{V4, V6},
    hook::Hook,
    icmp_error::ErrorFamily,
    maps::{self, FLOW_KEY6, count, node_addr6, node_config, node_flags6},
    netfilter_ct,
    packet::{self, FlowOf, Skip},
    packet6::{self, Skip6},
    reject::ResetFamily,
    trace::Traced,
    verdict::Verdicts,
};

/// IPv6's room for a new flow's `Handoff`, one per CPU
/// (`PipelineFamily::handoff`).
#[btf_map]
static HANDOFF6: PerCpuArray<Handoff<[u32; 4]>, 1> = PerCpuArray::new();

/// The source a new flow's packets take where the client's cannot stay
/// (`PipelineFamily::new_source`).
pub enum Source<A> {
    /// The client's own: the backend answers it.
    Keep,
    /// A fixed address, the client's port kept unless that clashes at the
    /// backend (`conntrack::create_kept`): routed by the stack, which hands
    /// the backend's reply back (IPv4's hairpin).
    Fixed(A),
    /// The node's address and a port of the SNAT range: sent by the
    /// datapath itself, since the stack would refuse its own address as a
    /// source arriving from outside.
    Node(A),
}

/// A family, as the pipeline writes it once over both.
pub trait PipelineFamily: DsrFamily + ErrorFamily + ResetFamily + Traced {
    /// Whether tc hands a new flow of this family on to a program of its
    /// own (`Verdicts::new_flow_apart`) rather than serving it inline:
    /// IPv6's, whose tc program would otherwise come within a tenth of the
    /// verifier's limit of a million instructions, a new flow's paths most
    /// of them. XDP serves its new flows inline either way.
    const NEW_FLOW_APART: bool;

    /// This CPU's room for the `Handoff` of a new flow
    /// (`NEW_FLOW_APART`): written just before the tail call and read by
    /// the program it calls, on the same CPU, before anything else can run
    /// there (tc runs one program at a time on a CPU). None for a family
    /// that serves its new flows inline.
    fn handoff() -> Option<*mut Handoff<Self::Addr>>;

    /// The packet's flow, or the hook's verdict for a packet the pipeline
    /// does not handle (another family's, ICMP, malformed), counted where
    /// that is tc's to do.
    fn parse<H: Verdicts>(ctx: &H) -> Result<FlowOf<Self::Addr>, H::Verdict>;

    /// Where the pipeline's caller keeps a conntrack key the family builds
    /// on the stack (`key`); nothing for one that has a map's room for it.
    type KeySlot: Default;

    /// `flow`'s conntrack key, built in `slot` or elsewhere; None where it
    /// has nowhere to be built.
    fn key<'a>(
        flow: &FlowOf<Self::Addr>,
        slot: &'a mut Self::KeySlot,
    ) -> Option<&'a mut CtKeyOf<Self::Addr>>;

    /// A backend's address, if it is of this family: the planner gives
    /// each family's frontends that family's endpoints, so another is a
    /// backend the agent is still writing.
    fn backend_addr(backend: &Backend) -> Option<Self::Addr>;

    /// The family's own node settings (`node_config_flags`):
    /// `MASQUERADE_OFF_CLUSTER` among them.
    fn node_flags() -> u32;

    /// The source a new flow takes: `hairpin` when its backend is its own
    /// client, `snat` when the client's address cannot reach the backend
    /// and come back through this node.
    fn new_source(hairpin: bool, snat: bool) -> Source<Self::Addr>;

    /// Whether netfilter's conntrack has an entry with `flow`'s tuple in
    /// either direction: a flow it translates, or the answer to
    /// one it masqueraded (`netfilter_ct`).
    fn netfilter_has<H: Hook>(ctx: &H, flow: &FlowOf<Self::Addr>) -> bool;
}

impl PipelineFamily for V4 {
    const NEW_FLOW_APART: bool = false;

    #[inline(always)]
    fn handoff() -> Option<*mut Handoff<u32>> {
        None
    }

    #[inline(always)]
    fn parse<H: Verdicts>(ctx: &H) -> Result<FlowOf<u32>, H::Verdict> {
        packet::parse(ctx).map_err(|skip| match skip {
            Skip::NotIpv4 => ctx.next(),
            Skip::NotOurs => H::PASS,
            // An error among them may be about a translated flow.
            Skip::Icmp => ctx.icmp_error::<V4>(()),
            // Counted by tc, which sees the same packet next.
            Skip::Malformed | Skip::Truncated(_) if H::XDP => H::PASS,
            Skip::Malformed | Skip::Truncated(_) => {
                count(counter::PASS_MALFORMED);
                H::PASS
            }
        })
    }

    type KeySlot = CtKeyOf<u32>;

    #[inline(always)]
    fn key<'a>(flow: &FlowOf<u32>, slot: &'a mut CtKeyOf<u32>) -> Option<&'a mut CtKeyOf<u32>> {
        *slot = conntrack::flow_key(flow);
        Some(slot)
    }

    #[inline(always)]
    fn backend_addr(backend: &Backend) -> Option<u32> {
        is_v4_mapped(&backend.addr_be).then_some(backend.addr_be[3])
    }

    #[inline(always)]
    /// IPv4's own `NODE_CONFIG` (which also holds `MASQUERADE_ALL` for
    /// both families).
    fn node_flags() -> u32 {
        maps::node_flags()
    }

    /// A hairpin flow takes the fixed `HAIRPIN_ADDR`; SNAT, the node's
    /// address, where the agent has given one.
    #[inline(always)]
    fn new_source(hairpin: bool, snat: bool) -> Source<u32> {
        if hairpin {
            return Source::Fixed(conntrack::hairpin_addr());
        }
        let node = node_config().snat_addr_be[3];
        if snat && node != 0 {
            Source::Node(node)
        } else {
            Source::Keep
        }
    }

    #[inline(always)]
    fn netfilter_has<H: Hook>(ctx: &H, flow: &FlowOf<u32>) -> bool {
        netfilter_ct::has_v4(
            ctx,
            flow.proto,
            flow.src_be,
            flow.dst_be,
            flow.sport_be,
            flow.dport_be,
        )
    }
}

impl PipelineFamily for V6 {
    const NEW_FLOW_APART: bool = true;

    #[inline(always)]
    fn handoff() -> Option<*mut Handoff<[u32; 4]>> {
        HANDOFF6.get_ptr_mut(0)
    }

    #[inline(always)]
    fn parse<H: Verdicts>(ctx: &H) -> Result<FlowOf<[u32; 4]>, H::Verdict> {
        packet6::parse(ctx).map_err(|skip| match skip {
            Skip6::NotOurs => H::PASS,
            Skip6::Icmp6(icmp_off) => ctx.icmp_error::<V6>(icmp_off),
            // Counted by tc, which sees the same packet next (and may pull
            // in what XDP found cut short).
            Skip6::Malformed | Skip6::Truncated | Skip6::ExtHeaders if H::XDP => H::PASS,
            Skip6::Malformed | Skip6::Truncated => {
                count(counter::PASS_MALFORMED);
                H::PASS
            }
            Skip6::ExtHeaders => {
                count(counter::PASS_V6_EXT_HEADERS);
                H::PASS
            }
        })
    }

    /// The key in this CPU's `FLOW_KEY6`, not on the stack, where `tc_ingress6`
    /// has little room; the trace's records read it there too.
    type KeySlot = ();

    #[inline(always)]
    fn key<'a>(flow: &FlowOf<[u32; 4]>, _slot: &'a mut ()) -> Option<&'a mut CtKeyOf<[u32; 4]>> {
        let key = FLOW_KEY6.get_ptr_mut(0)?;
        // SAFETY: this CPU's entry, used by nothing else while this program
        // runs (tc and XDP run one program at a time on a CPU, neither
        // interrupting the other).
        unsafe {
            *key = conntrack::flow_key(flow);
            Some(&mut *key)
        }
    }

    #[inline(always)]
    fn backend_addr(backend: &Backend) -> Option<[u32; 4]> {
        (!is_v4_mapped(&backend.addr_be)).then_some(backend.addr_be)
    }

    #[inline(always)]
    fn node_flags() -> u32 {
        node_flags6()
    }

    /// Hairpin flows take the node's address too, where IPv4 takes the
    /// fixed `HAIRPIN_ADDR` and keeps the port: an IPv6 link-local source
    /// is neither forwarded by the stack nor answered by the pod (its reply
    /// would need neighbour discovery for an address no interface holds),
    /// and the node's address is what kube-proxy's masquerade gives them
    /// (docs/kube-proxy-semantics.md).
    #[inline(always)]
    fn new_source(hairpin: bool, snat: bool) -> Source<[u32; 4]> {
        let node = node_addr6();
        if (hairpin || snat) && node != [0; 4] {
            Source::Node(node)
        } else {
            Source::Keep
        }
    }

    #[inline(always)]
    fn netfilter_has<H: Hook>(ctx: &H, flow: &FlowOf<[u32; 4]>) -> bool {
        netfilter_ct::has_v6(
            ctx,
            flow.proto,
            &flow.src_be,
            &flow.dst_be,
            flow.sport_be,
            flow.dport_be,
        )
    }
}
