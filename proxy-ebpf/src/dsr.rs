//! Direct server return, both ends (docs/architecture.md, "Direct server
//! return"). The entry node DNATs a flow from outside to a backend on
//! another node, keeps the client's address, and adds the frontend the
//! client addressed to each packet (`carry`: an IP option, an IPv6
//! destination options header, `proxy_common::dsr`). The backend's node
//! keys the packet by that frontend (`carried`, in `tc_dsr`:
//! `pipeline::dsr_arrival`), as if the client had sent it there, so that its conntrack holds the same flow the entry node's
//! does: the first such packet creates it (`arrived`), its backend's
//! replies leave from the frontend straight to the client, and if the
//! network later brings the client's packets to this node directly, they
//! find the flow.

use aya_ebpf::{
    helpers::bpf_xdp_adjust_head,
    programs::{TcContext, XdpContext},
};
use proxy_common::{
    PROTO_TCP, PROTO_UDP, counter,
    csum::{self, fold},
    dsr, node_config_flags, service_flags,
};

use crate::{
    conntrack::{self, NewFlow},
    family::{V4, V6},
    frontend::{self, Frontend},
    hook::Hook,
    maps::{count, node_flags},
    nat::NatOf,
    packet::{ETH_HLEN, FlowOf, read},
    packet6::{IPV6_HLEN, NEXTHDR_DEST},
};

/// `BPF_ADJ_ROOM_NET`: room made between the network header (its first 20
/// or 40 bytes) and what follows.
const BPF_ADJ_ROOM_NET: u32 = 0;
const IPV4_HLEN: usize = 20;
const IPV4_TOT_LEN_OFF: usize = 2;
const IPV4_CSUM_OFF: usize = 10;
const IPV6_PAYLOAD_LEN_OFF: usize = 4;
const IPV6_NEXT_HDR_OFF: usize = 6;

/// Direct server return as each family carries it.
pub trait DsrFamily: conntrack::CreateFamily {
    /// The bytes the carrier adds to each packet.
    const ROOM: u16;

    /// The family's `tc_dsr` program's slot in `TC_DSR`.
    const DSR_SLOT: u32;

    /// The packet's flow, parsed again in `tc_dsr`, where what the parser
    /// skips needs nothing more than to pass (not `PipelineFamily::parse`,
    /// which would then be called twice and no longer inlined).
    fn reparse(ctx: &TcContext) -> Option<FlowOf<Self::Addr>>;

    /// Whether the packet has no options or extension headers, the only
    /// packets the entry node adds the carrier to.
    fn plain(flow: &FlowOf<Self::Addr>) -> bool;

    /// Whether the packet's headers before the transport's are as long as
    /// with the carrier.
    fn carrier_sized(flow: &FlowOf<Self::Addr>) -> bool;

    /// Adds the carrier naming `flow`'s frontend (its destination as the
    /// client sent it) to the translated packet (tc only).
    fn carry(ctx: &TcContext, flow: &FlowOf<Self::Addr>) -> Result<(), i64>;

    /// `carry` at XDP: the same bytes, written in place after the packet's
    /// head has moved to make room (`grow_at_xdp`).
    fn carry_xdp(ctx: &XdpContext, flow: &FlowOf<Self::Addr>) -> Result<(), ()>;

    /// The frontend the packet's carrier names, if it carries one.
    fn carried<H: Hook>(ctx: &H, flow: &FlowOf<Self::Addr>) -> Option<(Self::Addr, u16)>;
}

impl DsrFamily for V4 {
    const ROOM: u16 = dsr::IPV4_OPT_LEN as u16;
    const DSR_SLOT: u32 = proxy_common::TC_DSR_IPV4;

    #[inline(always)]
    fn reparse(ctx: &TcContext) -> Option<FlowOf<u32>> {
        crate::packet::parse(ctx).ok()
    }

    #[inline(always)]
    fn plain(flow: &FlowOf<u32>) -> bool {
        flow.l4_off == ETH_HLEN + IPV4_HLEN
    }

    #[inline(always)]
    fn carrier_sized(flow: &FlowOf<u32>) -> bool {
        flow.l4_off == ETH_HLEN + IPV4_HLEN + dsr::IPV4_OPT_LEN
    }

    /// The option goes after the 20-byte header; the header checksum takes
    /// the option, the new IHL and total length at once. The region's sum
    /// stays what it was (a valid header sums to zero, and the kernel zeroes
    /// the room it makes), so a `CHECKSUM_COMPLETE` sum still holds; the
    /// transport checksum covers none of it.
    #[inline(always)]
    fn carry(ctx: &TcContext, flow: &FlowOf<u32>) -> Result<(), i64> {
        let word0: u16 = ctx.load(ETH_HLEN)?;
        let tot_len_be: u16 = ctx.load(ETH_HLEN + IPV4_TOT_LEN_OFF)?;
        let opt = dsr::ipv4_option(flow.dst_be, flow.dport_be);
        ctx.adjust_room(i32::from(Self::ROOM), BPF_ADJ_ROOM_NET, 0)?;
        ctx.store(ETH_HLEN + IPV4_HLEN, &opt, 0)?;
        let (grown_word0, grown_tot_len_be) = dsr::ipv4_grown_fields(word0, tot_len_be);
        ctx.store(ETH_HLEN, &grown_word0, 0)?;
        ctx.store(ETH_HLEN + IPV4_TOT_LEN_OFF, &grown_tot_len_be, 0)?;
        let delta = dsr::ipv4_grown_csum_delta(word0, tot_len_be, &opt);
        // Size 0: `to` is a difference to add.
        ctx.l3_csum_replace(ETH_HLEN + IPV4_CSUM_OFF, 0, u64::from(fold(delta)), 0)
    }

    #[inline(always)]
    fn carry_xdp(ctx: &XdpContext, flow: &FlowOf<u32>) -> Result<(), ()> {
        const HEAD: usize = ETH_HLEN + IPV4_HLEN;
        let data = grow_at_xdp::<HEAD>(ctx, dsr::IPV4_OPT_LEN)?;
        if data + HEAD + dsr::IPV4_OPT_LEN > ctx.data_end() {
            return Err(());
        }
        let ip = data + ETH_HLEN;
        let opt = dsr::ipv4_option(flow.dst_be, flow.dport_be);
        // SAFETY: inside the packet, as checked above; unaligned access is
        // allowed as in `packet::read`.
        unsafe {
            let word0 = (ip as *const u16).read();
            let tot_len_be = ((ip + IPV4_TOT_LEN_OFF) as *const u16).read();
            let csum_at = (ip + IPV4_CSUM_OFF) as *mut u16;
            let delta = dsr::ipv4_grown_csum_delta(word0, tot_len_be, &opt);
            csum_at.write(csum::apply(csum_at.read(), delta));
            let (grown_word0, grown_tot_len_be) = dsr::ipv4_grown_fields(word0, tot_len_be);
            (ip as *mut u16).write(grown_word0);
            ((ip + IPV4_TOT_LEN_OFF) as *mut u16).write(grown_tot_len_be);
            ((ip + IPV4_HLEN) as *mut [u8; dsr::IPV4_OPT_LEN]).write(opt);
        }
        Ok(())
    }

    #[inline(always)]
    fn carried<H: Hook>(ctx: &H, flow: &FlowOf<u32>) -> Option<(u32, u16)> {
        if flow.l4_off != ETH_HLEN + IPV4_HLEN + dsr::IPV4_OPT_LEN {
            return None;
        }
        let (data, data_end) = ctx.bounds();
        let opt: [u8; dsr::IPV4_OPT_LEN] = read(data, data_end, ETH_HLEN + IPV4_HLEN)?;
        dsr::ipv4_frontend(&opt)
    }
}

impl DsrFamily for V6 {
    const ROOM: u16 = dsr::IPV6_EXT_LEN as u16;
    const DSR_SLOT: u32 = proxy_common::TC_DSR_IPV6;

    #[inline(always)]
    fn reparse(ctx: &TcContext) -> Option<FlowOf<[u32; 4]>> {
        crate::packet6::parse(ctx).ok()
    }

    #[inline(always)]
    fn plain(flow: &FlowOf<[u32; 4]>) -> bool {
        flow.l4_off == ETH_HLEN + IPV6_HLEN
    }

    #[inline(always)]
    fn carrier_sized(flow: &FlowOf<[u32; 4]>) -> bool {
        flow.l4_off == ETH_HLEN + IPV6_HLEN + dsr::IPV6_EXT_LEN
    }

    /// The destination options header goes right after the IPv6 header,
    /// where RFC 8200 puts one meant for the final destination. The
    /// transport checksum's pseudo-header counts the upper layer's length,
    /// which stays the same; `skb->csum` is kept by the stores.
    #[inline(always)]
    fn carry(ctx: &TcContext, flow: &FlowOf<[u32; 4]>) -> Result<(), i64> {
        use crate::family::BPF_F_RECOMPUTE_CSUM;
        let next: u8 = ctx.load(ETH_HLEN + IPV6_NEXT_HDR_OFF)?;
        let payload_len_be: u16 = ctx.load(ETH_HLEN + IPV6_PAYLOAD_LEN_OFF)?;
        ctx.adjust_room(i32::from(Self::ROOM), BPF_ADJ_ROOM_NET, 0)?;
        let ext = dsr::ipv6_dest_opts(next, &flow.dst_be, flow.dport_be);
        ctx.store(ETH_HLEN + IPV6_HLEN, &ext, BPF_F_RECOMPUTE_CSUM)?;
        ctx.store(
            ETH_HLEN + IPV6_NEXT_HDR_OFF,
            &NEXTHDR_DEST,
            BPF_F_RECOMPUTE_CSUM,
        )?;
        let payload_len = u16::from_be(payload_len_be)
            .wrapping_add(Self::ROOM)
            .to_be();
        ctx.store(
            ETH_HLEN + IPV6_PAYLOAD_LEN_OFF,
            &payload_len,
            BPF_F_RECOMPUTE_CSUM,
        )
    }

    #[inline(always)]
    fn carry_xdp(ctx: &XdpContext, flow: &FlowOf<[u32; 4]>) -> Result<(), ()> {
        const HEAD: usize = ETH_HLEN + IPV6_HLEN;
        let data = grow_at_xdp::<HEAD>(ctx, dsr::IPV6_EXT_LEN)?;
        if data + HEAD + dsr::IPV6_EXT_LEN > ctx.data_end() {
            return Err(());
        }
        let ip = data + ETH_HLEN;
        // SAFETY: inside the packet, as checked above; unaligned access is
        // allowed as in `packet::read`.
        unsafe {
            let next = ((ip + IPV6_NEXT_HDR_OFF) as *const u8).read();
            let payload_len_be = ((ip + IPV6_PAYLOAD_LEN_OFF) as *const u16).read();
            let ext = dsr::ipv6_dest_opts(next, &flow.dst_be, flow.dport_be);
            ((ip + IPV6_HLEN) as *mut [u8; dsr::IPV6_EXT_LEN]).write(ext);
            ((ip + IPV6_NEXT_HDR_OFF) as *mut u8).write(NEXTHDR_DEST);
            let payload_len = u16::from_be(payload_len_be)
                .wrapping_add(Self::ROOM)
                .to_be();
            ((ip + IPV6_PAYLOAD_LEN_OFF) as *mut u16).write(payload_len);
        }
        Ok(())
    }

    #[inline(always)]
    fn carried<H: Hook>(ctx: &H, flow: &FlowOf<[u32; 4]>) -> Option<([u32; 4], u16)> {
        if flow.l4_off != ETH_HLEN + IPV6_HLEN + dsr::IPV6_EXT_LEN {
            return None;
        }
        let (data, data_end) = ctx.bounds();
        let next: u8 = read(data, data_end, ETH_HLEN + IPV6_NEXT_HDR_OFF)?;
        if next != NEXTHDR_DEST {
            return None;
        }
        let ext: [u8; dsr::IPV6_EXT_LEN] = read(data, data_end, ETH_HLEN + IPV6_HLEN)?;
        dsr::ipv6_frontend(&ext).map(|(addr, port, _)| (addr, port))
    }
}

/// Makes `room` bytes between the packet's first `HEAD` bytes (its
/// Ethernet and network headers) and the rest at XDP, which cannot insert:
/// the head moves `room` bytes earlier (`bpf_xdp_adjust_head`, into the
/// headroom every XDP driver keeps) and the headers are copied down to it,
/// leaving the room where they ended. The packet's new start, every
/// pointer taken before being void.
#[inline(always)]
fn grow_at_xdp<const HEAD: usize>(ctx: &XdpContext, room: usize) -> Result<usize, ()> {
    // SAFETY: the helper takes the program's own context.
    if unsafe { bpf_xdp_adjust_head(ctx.ctx, -(room as i32)) } != 0 {
        return Err(());
    }
    let (data, data_end) = (ctx.data(), ctx.data_end());
    if data + room + HEAD > data_end {
        return Err(());
    }
    // Front to back, 4 bytes at a time then the rest: each word lands
    // `room` (8 or 24) bytes before where it is read, below every word
    // still to be read.
    let mut i = 0;
    while i + 4 <= HEAD {
        // SAFETY: both inside the packet, as checked above.
        unsafe { ((data + i) as *mut u32).write(((data + room + i) as *const u32).read()) };
        i += 4;
    }
    while i < HEAD {
        // SAFETY: as above.
        unsafe { ((data + i) as *mut u8).write(((data + room + i) as *const u8).read()) };
        i += 1;
    }
    Ok(data)
}

/// Whether a new flow of `flow` to `frontend`, an external one, whose
/// backend is on another node (`remote`), goes by direct server return: `--lb-mode dsr` for TCP and UDP, or `hybrid` for TCP,
/// on a packet with no options or extension headers before which to put
/// the carrier, unless every flow is masqueraded. Not for a client in the
/// cluster (`Frontend::inside`: its pod CIDRs, or this node's pods, whose
/// answers from the backend's node would come from this node's own
/// NodePort address, which input routing here drops as martian): those
/// are SNATed as before. SCTP is SNATed: its associations are tracked by
/// tags that only both directions show.
#[inline(always)]
pub fn sends<F: DsrFamily>(flow: &FlowOf<F::Addr>, frontend: &Frontend, remote: bool) -> bool {
    if !remote || frontend.inside || frontend.svc.flags & service_flags::EXTERNAL == 0 {
        return false;
    }
    let flags = node_flags();
    flags & node_config_flags::DSR != 0
        && flags & node_config_flags::MASQUERADE_ALL == 0
        && (flow.proto == PROTO_TCP
            || flow.proto == PROTO_UDP && flags & node_config_flags::DSR_TCP_ONLY == 0)
        && F::plain(flow)
}

/// Whether a packet no frontend answers may carry a frontend from
/// another node: its headers before the transport's are the carrier's
/// length, and DSR is on here. What `tc_dsr` then asks (`accepted`).
#[inline(always)]
pub fn may_carry<F: DsrFamily>(flow: &FlowOf<F::Addr>) -> bool {
    F::carrier_sized(flow) && node_flags() & node_config_flags::DSR != 0
}

/// The frontend a packet from another node names, when this node takes
/// the carrier: DSR on here, and the packet not from one of this node's
/// pods (only entry nodes write it).
#[inline(always)]
pub fn accepted<F: DsrFamily, H: Hook>(ctx: &H, flow: &FlowOf<F::Addr>) -> Option<(F::Addr, u16)> {
    if node_flags() & node_config_flags::DSR == 0 || frontend::local_iface(ctx.ingress_ifindex()) {
        return None;
    }
    F::carried(ctx, flow)
}

/// The first packet here of a flow another node sent by direct server
/// return, to `frontend`:`port` as its carrier says, DNATed there to the
/// packet's destination (this node's backend): both conntrack entries are
/// created as if the client had sent it here, the reply entry routed by
/// the datapath, since its source (the frontend) is no address this
/// node's pod interfaces route. A frontend that is not an external one
/// here is refused, counted: the carrier would otherwise let anyone give a
/// pod's replies any source. The packet itself goes on as it is.
#[inline(always)]
pub fn arrived<F: DsrFamily>(flow: &FlowOf<F::Addr>, frontend: F::Addr, port_be: u16, now: u64) {
    let Some(found) = frontend::lookup_frontend_of(&frontend, port_be, flow.proto, || false)
        .or_else(|| frontend::lookup_nodeport(port_be, flow.proto, || false))
    else {
        count(counter::DSR_REFUSED);
        return;
    };
    if found.svc.flags & service_flags::EXTERNAL == 0 {
        count(counter::DSR_REFUSED);
        return;
    }
    let sent = FlowOf {
        dst_be: frontend,
        dport_be: port_be,
        ..*flow
    };
    let nf = NewFlow {
        nat: NatOf {
            dst_be: flow.dst_be,
            dport_be: flow.dport_be,
            ..NatOf::identity(&sent)
        },
        backend_id: 0,
        service_id: found.svc.service_id,
        kind: 0,
        reply_redirect: true,
        path_mtu: 0,
    };
    conntrack::create::<F>(&sent, &nf, now);
    count(counter::DSR_LEARNT);
}
