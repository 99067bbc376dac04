//! Address and port rewrites of either family: what a packet becomes, and
//! its writing, with every checksum kept right: in place, straight into
//! packet memory (XDP, and tc where the checksum state is known), or
//! through the kernel's helpers (tc otherwise). What differs by family (the
//! IP header's writing, IPv4's with its header checksum; where tc may write
//! the transport header; what a UDP checksum of 0 means) is the `Family`'s.
//! The arithmetic is `proxy_common::csum`, tested on the host. Loads and
//! stores are of the field's width even where packet memory is misaligned
//! for it (see `packet::read`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_SCTP, PROTO_TCP, PROTO_UDP,
    csum::{delta16, fold, full_update, pseudo_partial},
    ip_summed::{CHECKSUM_COMPLETE, CHECKSUM_NONE, CHECKSUM_PARTIAL, CHECKSUM_UNNECESSARY},
    sctp,
};

use crate::{
    family::{BPF_F_RECOMPUTE_CSUM, Family},
    hook::Hook,
    ip_summed, maps,
    packet::{FlowOf, frag},
};

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
/// Keeps a UDP checksum of 0 ("none") at 0, and turns a computed 0 into
/// 0xffff, as RFC 768 wants.
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

/// The addresses and ports a packet leaves with.
#[derive(Clone, Copy)]
pub struct NatOf<A> {
    pub src_be: A,
    pub sport_be: u16,
    pub dst_be: A,
    pub dport_be: u16,
    /// The new source is an address of this node: the packet must be routed
    /// by a FIB lookup and redirected, as the stack would drop it.
    pub redirect: bool,
    /// 1 for direct server return: the packet keeps the client's address
    /// and carries its frontend to the backend's node (`crate::dsr`);
    /// redirected too. A number, not a bool, so that it is worked out and
    /// used without branches where it can be (see `conntrack::translation`).
    pub dsr: u8,
}

impl<A: Copy> NatOf<A> {
    /// The packet as it is.
    #[inline(always)]
    pub fn identity(flow: &FlowOf<A>) -> Self {
        NatOf {
            src_be: flow.src_be,
            sport_be: flow.sport_be,
            dst_be: flow.dst_be,
            dport_be: flow.dport_be,
            redirect: false,
            dsr: 0,
        }
    }

    /// Writes this translation into the packet. A later fragment gets its
    /// addresses alone: it carries neither ports nor transport checksum,
    /// and its first fragment's update covered the whole datagram's
    /// pseudo-header. The IP header is never offloaded and its sum stays
    /// the same, so a `CHECKSUM_COMPLETE` `skb->csum` still holds.
    #[inline(always)]
    pub fn apply<F: Family<Addr = A>, H: Hook>(&self, ctx: &H, flow: &FlowOf<A>) -> Result<(), ()> {
        if flow.proto == PROTO_SCTP && flow.frag != frag::LATER {
            return rewrite_sctp::<F, H>(ctx, flow, self);
        }
        if let Some(tc) = ctx.tc() {
            if flow.frag == frag::LATER {
                return F::rewrite_ip_tc(tc, flow, &self.src_be, &self.dst_be).map_err(|_| ());
            }
            return rewrite_skb::<F>(tc, flow, self).map_err(|_| ());
        }
        let (data, data_end) = ctx.bounds();
        if flow.frag == frag::LATER {
            return F::rewrite_ip(data, data_end, flow, &self.src_be, &self.dst_be).map(|_| ());
        }
        // XDP: checksums are as on the wire.
        rewrite_at::<F>(data, data_end, flow.l4_off, flow, self, L4Csum::Full)
    }
}

/// Writes `nat` over `flow` at tc. How the transport checksum changes
/// depends on the socket buffer's checksum state (`ip_summed`):
/// - none or unnecessary: the field holds the full checksum, updated in
///   place as at XDP;
/// - partial (every packet a local socket sends with offload, so all pod
///   traffic): the field holds the pseudo-header sum the device finishes,
///   updated in place for the addresses only;
/// - complete: `skb->csum` covers the packet. In place where the rewrite
///   leaves its sum as it was (`Family::COMPLETE_HOLDS`), else through the
///   kernel's helpers, which update it;
/// - not read (a kernel without the kfunc): through the helpers, which
///   apply each change as the state needs.
///
/// The helpers also write a packet whose transport header tc may not write
/// in place (`Family::tc_l4_off`).
#[inline(always)]
fn rewrite_skb<F: Family>(
    ctx: &TcContext,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
) -> Result<(), i64> {
    let state = ip_summed::read(ctx);
    maps::count_csum_state(state);
    let l4 = match state {
        CHECKSUM_NONE | CHECKSUM_UNNECESSARY => L4Csum::Full,
        CHECKSUM_COMPLETE if F::COMPLETE_HOLDS => L4Csum::Full,
        CHECKSUM_PARTIAL => L4Csum::Partial,
        _ => return rewrite_by_helper::<F>(ctx, flow, nat),
    };
    let (data, data_end) = (ctx.data(), ctx.data_end());
    match F::tc_l4_off(data, data_end, flow) {
        Some(l4_off) => rewrite_at::<F>(data, data_end, l4_off, flow, nat, l4).map_err(|()| -1),
        None => rewrite_by_helper::<F>(ctx, flow, nat),
    }
}

/// The translation with the transport checksum updated by the kernel's
/// `bpf_l4_csum_replace`, whatever the checksum state: the address change
/// as a pseudo-header change, then the ports'.
#[inline(always)]
fn rewrite_by_helper<F: Family>(
    ctx: &TcContext,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
) -> Result<(), i64> {
    let addrs = F::addr_delta(&flow.src_be, &nat.src_be) + F::addr_delta(&flow.dst_be, &nat.dst_be);
    let ports = delta16(flow.sport_be, nat.sport_be) + delta16(flow.dport_be, nat.dport_be);
    let csum_off = flow.l4_csum_off();
    let udp = flow.proto == PROTO_UDP;
    let mangled = if udp && F::UDP_ZERO_IS_NONE {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    // Size 0: `to` is a difference to add, not a field's new value.
    ctx.l4_csum_replace(
        csum_off,
        0,
        u64::from(fold(addrs)),
        BPF_F_PSEUDO_HDR | mangled,
    )?;
    ctx.l4_csum_replace(csum_off, 0, u64::from(fold(ports)), mangled)?;
    if udp && !F::UDP_ZERO_IS_NONE {
        // A computed 0 is sent as 0xffff: 0 would mean "no checksum", which
        // this family forbids. The same sum in one's complement, so right
        // for a `CHECKSUM_PARTIAL` field too.
        let sum: u16 = ctx.load(csum_off)?;
        if sum == 0 {
            ctx.store(csum_off, &0xffffu16, 0)?;
        }
    }
    let ports: [u16; 2] = [nat.sport_be, nat.dport_be];
    ctx.store(flow.l4_off, &ports, 0)?;
    F::rewrite_ip_tc(ctx, flow, &nat.src_be, &nat.dst_be)
}

/// What the transport checksum field holds, and so how a rewrite in place
/// keeps it right.
#[derive(Clone, Copy, PartialEq, Eq)]
enum L4Csum {
    /// The full checksum (XDP, where checksums are as on the wire; tc with
    /// `CHECKSUM_NONE` or `CHECKSUM_UNNECESSARY`, or a `CHECKSUM_COMPLETE`
    /// that holds): takes every change.
    Full,
    /// The pseudo-header sum a device finishes (tc, `CHECKSUM_PARTIAL`):
    /// takes the addresses' change alone, as the kernel does; the device
    /// sums the ports.
    Partial,
}

/// Writes `nat` over `flow`, whose transport header is at `l4_off`, in the
/// packet between `data` and `data_end` in one pass, with one checksum
/// update for all of it. A UDP checksum of 0 and a computed 0 are as
/// `proxy_common::csum::full_update` has them. Nothing is written unless
/// every field is inside the packet.
#[inline(always)]
fn rewrite_at<F: Family>(
    data: usize,
    data_end: usize,
    l4_off: usize,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    l4: L4Csum,
) -> Result<(), ()> {
    if l4_off > F::MAX_L4_OFF {
        return Err(());
    }
    let l4p = data + l4_off;
    // Per protocol, so that the verifier sees constant offsets.
    let csum = if flow.proto == PROTO_TCP {
        if l4p + 20 > data_end {
            return Err(());
        }
        (l4p + 16) as *mut u16
    } else {
        if l4p + 8 > data_end {
            return Err(());
        }
        (l4p + 6) as *mut u16
    };
    let addrs = F::rewrite_ip(data, data_end, flow, &nat.src_be, &nat.dst_be)?;
    let ports = delta16(flow.sport_be, nat.sport_be) + delta16(flow.dport_be, nat.dport_be);
    let udp = flow.proto == PROTO_UDP;
    // SAFETY: inside the bounds checked above.
    unsafe {
        (l4p as *mut u16).write(nat.sport_be);
        ((l4p + 2) as *mut u16).write(nat.dport_be);
        let old = csum.read();
        csum.write(match l4 {
            L4Csum::Full => full_update(old, addrs + ports, udp),
            L4Csum::Partial => pseudo_partial(old, addrs, udp),
        });
    }
    Ok(())
}

/// The ports of a transport header as a word read from packet memory.
#[inline(always)]
fn ports_word(sport_be: u16, dport_be: u16) -> u32 {
    u32::from(sport_be) | (u32::from(dport_be) << 16)
}

/// Writes `nat` over the SCTP packet `flow`. Its checksum, CRC-32C, covers
/// the SCTP packet alone: the addresses leave it as it is, the ports
/// change it by `sctp_csum_delta`, folded into it in place by XOR. Where it is
/// still to be computed (tc, `CHECKSUM_PARTIAL`: offloaded by a local
/// sender, to be summed over the packet as it leaves), it is left alone. A
/// first fragment whose ports change is not translated: the checksum
/// covers the whole datagram, whose length it does not give.
#[inline(always)]
fn rewrite_sctp<F: Family, H: Hook>(
    ctx: &H,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
) -> Result<(), ()> {
    let diff = ports_word(flow.sport_be, flow.dport_be) ^ ports_word(nat.sport_be, nat.dport_be);
    if diff != 0 && flow.frag != frag::NONE {
        return Err(());
    }
    if let Some(tc) = ctx.tc() {
        return rewrite_sctp_tc::<F>(tc, flow, nat, diff).map_err(|_| ());
    }
    let (data, data_end) = ctx.bounds();
    if flow.l4_off > F::MAX_L4_OFF {
        return Err(());
    }
    let l4p = data + flow.l4_off;
    if l4p + sctp::HEADER_LEN > data_end {
        return Err(());
    }
    F::rewrite_ip(data, data_end, flow, &nat.src_be, &nat.dst_be)?;
    // SAFETY: inside the bounds checked above; see `packet::read` on
    // alignment.
    unsafe {
        (l4p as *mut u32).write(ports_word(nat.sport_be, nat.dport_be));
        if diff != 0 {
            let csum = (l4p + sctp::CSUM_OFF) as *mut u32;
            csum.write(csum.read() ^ csum_delta(diff, flow.l4_len));
        }
    }
    Ok(())
}

/// `rewrite_sctp` at tc, through the helpers, which keep a
/// `CHECKSUM_COMPLETE` sum following every byte written.
#[inline(always)]
fn rewrite_sctp_tc<F: Family>(
    ctx: &TcContext,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    diff: u32,
) -> Result<(), i64> {
    let state = ip_summed::read(ctx);
    maps::count_csum_state(state);
    if diff != 0 && state != CHECKSUM_PARTIAL {
        let off = flow.l4_off + sctp::CSUM_OFF;
        let old: u32 = ctx.load(off)?;
        ctx.store(
            off,
            &(old ^ csum_delta(diff, flow.l4_len)),
            BPF_F_RECOMPUTE_CSUM,
        )?;
    }
    let ports = ports_word(nat.sport_be, nat.dport_be);
    ctx.store(flow.l4_off, &ports, BPF_F_RECOMPUTE_CSUM)?;
    F::rewrite_ip_tc_summed(ctx, flow, &nat.src_be, &nat.dst_be)
}

#[inline(always)]
fn csum_delta(diff: u32, len: u16) -> u32 {
    sctp_csum_delta(u64::from(diff), u64::from(len))
}

/// `proxy_common::sctp::ports_delta`. Global (`no_mangle`, scalar
/// arguments and result): the verifier checks its two 32-step
/// multiplications once, where inlined they would be walked again on every
/// path to a rewrite. In `.text`, where aya resolves calls.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn sctp_csum_delta(diff: u64, len: u64) -> u32 {
    sctp::ports_delta(diff as u32, len as usize)
}
