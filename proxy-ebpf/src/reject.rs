//! Answering a packet in its sender's place, both families, written once
//! over the family (`crate::family`): a frontend without backends rejects
//! it so that the client fails at once (kube-proxy's `REJECT`: a TCP SYN is
//! answered with a RST, anything else with ICMP port unreachable), and a
//! packet longer than the MTU of the route the datapath sends it on is
//! answered as a router answers ("fragmentation needed", "packet too big",
//! with the MTU). The packet is rewritten into its answer in place and sent
//! back out of the interface it came in on.
//!
//! A TCP SYN is turned into its RST by incremental checksum updates rather
//! than rebuilt: a SYN from a local socket is `CHECKSUM_PARTIAL`, which forbids
//! cutting it below its checksum field (what an ICMP quote would need) and
//! leaves the final checksum to the device, and the incremental helpers do
//! the right thing in both cases.

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, TC_ACT_SHOT},
    helpers,
    programs::TcContext,
};
use proxy_common::{REJECT_MSGS_BURST, REJECT_MSGS_PER_SEC, counter};

use crate::{
    conntrack,
    event_log::Event,
    family::{Family, IcmpError, V4, V6},
    maps::{REJECT_LIMIT, count},
    packet::{ETH_HLEN, Flow, FlowOf, TCP_ACK, TCP_RST, TCP_SYN},
    packet6::{Flow6, IP6_SRC_OFF, IPV6_HLEN},
};

const ICMP_HLEN: usize = 8;
const BPF_ADJ_ROOM_MAC: u32 = 1;
/// What an error quotes past the IP header: a port unreachable's UDP
/// header; for "too big", a TCP header without options (a UDP datagram
/// that long has as many bytes to quote).
const UNREACHABLE_QUOTED_L4: usize = 8;
const TOO_BIG_QUOTED_L4: usize = 20;

/// tc's verdict for an answer (`event`): sent, or, when it could not be
/// built, dropped, which still ends the packet as it should (counted,
/// logged).
#[inline(always)]
pub fn answer<F: Family>(built: Result<i32, i64>, flow: &FlowOf<F::Addr>, event: Event) -> i32 {
    if let Ok(verdict) = built {
        F::log(event, flow);
        verdict
    } else {
        count(counter::DROP_REJECT_FAILED);
        F::log(Event::RejectFailed, flow);
        TC_ACT_SHOT
    }
}

/// Whether a reject may be sent now, from the node's budget of ICMP errors
/// (`RejectLimit`), which it then spends: the kernel's `icmp_global_allow`,
/// by the millisecond. A flood of packets to a frontend without endpoints,
/// their sources spoofed, would otherwise make every node send as many RSTs
/// and errors to whomever the sources name. One bucket for every CPU and
/// both families, as the kernel's; CPUs racing on it may spend a credit
/// twice, as the limit is a bound on a flood, not an exact count. Not
/// "too big", whose errors path MTU discovery lives on (the kernel does not
/// limit those either). Counted when it may not.
#[inline(always)]
pub fn allowed() -> bool {
    let Some(limit) = REJECT_LIMIT.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: the array's one entry, valid for this program's run; racing
    // writers are tolerated (see above).
    let limit = unsafe { &mut *limit };
    let (per_sec, burst) = if limit.configured != 0 {
        (limit.msgs_per_sec, limit.burst)
    } else {
        (REJECT_MSGS_PER_SEC, REJECT_MSGS_BURST)
    };
    let now = conntrack::now_ns();
    // A second's worth at most, as the kernel: the bucket never holds more
    // than `burst` anyway.
    let elapsed_ms = (now.saturating_sub(limit.stamp_ns) / 1_000_000).min(1000);
    let refill = elapsed_ms * u64::from(per_sec) / 1000;
    if refill > 0 {
        limit.credit = (u64::from(limit.credit) + refill).min(u64::from(burst)) as u32;
        limit.stamp_ns = now;
    }
    if limit.credit == 0 {
        count(counter::REJECT_RATE_LIMITED);
        return false;
    }
    limit.credit -= 1;
    true
}

/// Answers a packet longer than its route's `mtu` as a router does, with
/// the quote of it as its sender sent it: "fragmentation needed" over
/// IPv4, "packet too big" over IPv6 (RFC 4443 3.2); tc's verdict. An IPv4
/// packet that may be fragmented (no DF) is dropped: fragmenting is the
/// stack's, which would refuse the packet's new source. Counted `too_big`
/// either way; the caller logs it, with the flow's addresses.
#[inline(always)]
pub fn too_big<F: Family>(ctx: &TcContext, mtu: u16) -> i32 {
    count(counter::TOO_BIG);
    let (data, data_end) = (ctx.data(), ctx.data_end());
    if F::may_fragment(data, data_end) {
        return TC_ACT_SHOT;
    }
    // Quoting IP options would make the error variable-length.
    let built = if F::options(data, data_end) {
        Err(0)
    } else {
        icmp_error::<F, TOO_BIG_QUOTED_L4>(ctx, IcmpError::TooBig(mtu))
    };
    built.unwrap_or_else(|_| {
        count(counter::DROP_REJECT_FAILED);
        TC_ACT_SHOT
    })
}

/// Turns `flow`'s packet into an ICMP port unreachable addressed to its
/// sender (RFC 792; RFC 4443 3.1). Returns the tc verdict; on any failure
/// the packet is dropped, which is still the right outcome for a frontend
/// without backends. So is a packet with IP options or IPv6 extension
/// headers: quoting them too would make the error variable-length, and a
/// quote of the fixed header and the 8 bytes after it would hold no ports
/// for the sender's stack to find its socket by.
#[inline(always)]
pub fn icmp_port_unreachable<F: Family>(
    ctx: &TcContext,
    flow: &FlowOf<F::Addr>,
) -> Result<i32, i64> {
    if flow.ip_len() != F::HLEN {
        return Err(0);
    }
    icmp_error::<F, UNREACHABLE_QUOTED_L4>(ctx, IcmpError::PortUnreachable)
}

/// Turns the packet into the ICMP `error` about it, from the address its
/// sender addressed (whom it expects errors from) to the sender, and sends
/// it back. The error quotes the packet's IP header (without options or
/// extension headers) and `QUOTED_L4` bytes after it: at least the 8 that
/// let a receiver find its socket (RFC 792; RFC 4443 asks for as much as
/// fits in the minimum MTU, and one fixed size keeps the reply simple), and
/// as far as the transport checksum of a `CHECKSUM_PARTIAL` packet (one a
/// local socket sent), below which the kernel refuses to cut it.
/// Written in place rather than built on the stack, which `tc_ingress` has
/// little of to spare.
#[inline(always)]
fn icmp_error<F: Family, const QUOTED_L4: usize>(
    ctx: &TcContext,
    error: IcmpError,
) -> Result<i32, i64> {
    let quote_len = F::HLEN + QUOTED_L4;
    let icmp_len = ICMP_HLEN + quote_len;
    let reply_len = ETH_HLEN + F::HLEN + icmp_len;
    let macs: [u8; 12] = ctx.load(0)?;
    // Cut to the quote, then open room for the new IP and ICMP headers
    // before it. Cutting also ends a GSO packet's segmentation.
    // SAFETY: this program's own skb; no packet pointer is held across the
    // call (everything after it is loaded afresh).
    let ret =
        unsafe { helpers::bpf_skb_change_tail(ctx.skb.skb, (ETH_HLEN + quote_len) as u32, 0) };
    if ret != 0 {
        return Err(ret);
    }
    ctx.adjust_room((F::HLEN + ICMP_HLEN) as i32, BPF_ADJ_ROOM_MAC, 0)?;
    let (data, data_end) = (ctx.data(), ctx.data_end());
    if data + reply_len > data_end {
        return Err(0);
    }
    let words = F::icmp_words(error);
    // SAFETY: every access below is inside the `reply_len` bytes checked
    // above; plain loads and stores of the field's width, as
    // `packet::read` does.
    unsafe {
        let quote = (data + ETH_HLEN + F::HLEN + ICMP_HLEN) as *const u32;
        let mut quote_sum = 0u64;
        for i in 0..quote_len / 4 {
            quote_sum += u64::from(quote.add(i).read());
        }
        (data as *mut [u8; 6]).write([macs[6], macs[7], macs[8], macs[9], macs[10], macs[11]]);
        ((data + 6) as *mut [u8; 6]).write([macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]]);
        ((data + 12) as *mut u16).write(F::ETH_P_BE);
        F::write_error(data + ETH_HLEN, words, icmp_len as u16, quote_sum);
    }
    Ok(redirect_back(ctx))
}

/// What differs between the families' RSTs: when a SYN is bare, and where
/// the addresses are swapped.
pub trait ResetFamily: Family {
    /// Whether the packet of `flow`, whose TCP header is `tcp_len` bytes
    /// long, carries nothing past that header (by its IP header's length).
    fn bare(ctx: &TcContext, flow: &FlowOf<Self::Addr>, tcp_len: usize) -> Result<bool, i64>;

    /// Writes `flow`'s addresses swapped into its IP header. Read here
    /// only, as late as it can be: read sooner, `tc_ingress` keeps them on
    /// its stack meanwhile.
    fn swap_addrs(ctx: &TcContext, flow: &FlowOf<Self::Addr>) -> Result<(), i64>;
}

impl ResetFamily for V4 {
    /// IP options are kept, and sent back with the RST.
    #[inline(always)]
    fn bare(ctx: &TcContext, flow: &Flow, tcp_len: usize) -> Result<bool, i64> {
        let tot_len_be: u16 = ctx.load(ETH_HLEN + 2)?;
        Ok(u16::from_be(tot_len_be) as usize == flow.ip_len() + tcp_len)
    }

    #[inline(always)]
    fn swap_addrs(ctx: &TcContext, flow: &Flow) -> Result<(), i64> {
        let addrs: [u32; 2] = [flow.dst_be, flow.src_be];
        ctx.store(ETH_HLEN + 12, &addrs, 0)
    }
}

impl ResetFamily for V6 {
    /// No extension headers either: the RST would carry them back as they
    /// came, a routing header's route among them.
    #[inline(always)]
    fn bare(ctx: &TcContext, flow: &Flow6, tcp_len: usize) -> Result<bool, i64> {
        let payload_len_be: u16 = ctx.load(ETH_HLEN + 4)?;
        Ok(flow.l4_off == ETH_HLEN + IPV6_HLEN && u16::from_be(payload_len_be) as usize == tcp_len)
    }

    #[inline(always)]
    fn swap_addrs(ctx: &TcContext, flow: &Flow6) -> Result<(), i64> {
        let addrs: [[u32; 4]; 2] = [flow.dst_be, flow.src_be];
        ctx.store(ETH_HLEN + IP6_SRC_OFF, &addrs, 0)
    }
}

/// Answers a bare SYN (nothing past its TCP header; over IPv6 no extension
/// headers either) with RST|ACK (seq 0, ack = SYN's seq + 1, as RFC 9293
/// has it for a segment without ACK). Any other TCP segment to a frontend
/// without backends is dropped: without a flow there is nothing to reset.
#[inline(always)]
pub fn tcp_reset<F: ResetFamily>(ctx: &TcContext, flow: &FlowOf<F::Addr>) -> Result<i32, i64> {
    let l4 = flow.l4_off;
    let doff: u8 = ctx.load(l4 + 12)?;
    let tcp_len = ((doff >> 4) as usize) * 4;
    let bare = F::bare(ctx, flow, tcp_len)?;
    // Read where it is used: hoisted into code `tc_ingress` shares with
    // other actions, it would read a register those never set, which the
    // verifier refuses.
    // SAFETY: points at an initialised field of a live reference.
    let tcp_flags = unsafe { core::ptr::read_volatile(&raw const flow.tcp_flags) };
    if tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) != TCP_SYN || !bare {
        return Err(0);
    }
    reset_syn(
        ctx,
        &Syn {
            l4,
            doff,
            csum: flow.l4_csum_off(),
            sport_be: flow.sport_be,
            dport_be: flow.dport_be,
        },
        || F::swap_addrs(ctx, flow),
    )
}

/// A bare SYN, checked as such by `tcp_reset`: where its TCP
/// header is, its data offset byte, where its checksum is, its ports.
struct Syn {
    l4: usize,
    doff: u8,
    csum: usize,
    sport_be: u16,
    dport_be: u16,
}

/// Turns `syn` into its RST|ACK in place and sends it back: seq 0, ack =
/// SYN's seq + 1, no window, ports swapped, the IP addresses swapped by
/// `swap_addrs`, MACs swapped.
#[inline(always)]
fn reset_syn(
    ctx: &TcContext,
    syn: &Syn,
    swap_addrs: impl FnOnce() -> Result<(), i64>,
) -> Result<i32, i64> {
    let (l4, csum) = (syn.l4, syn.csum);
    let macs: [u8; 12] = ctx.load(0)?;
    let seq_be: u32 = ctx.load(l4 + 4)?;
    let ack_be: u32 = ctx.load(l4 + 8)?;
    let flags_word_be: u16 = ctx.load(l4 + 12)?;
    let window_be: u16 = ctx.load(l4 + 14)?;
    let new_ack_be = u32::from_be(seq_be).wrapping_add(1).to_be();
    // The data-offset byte and the flags byte, as they sit in the packet.
    let new_flags_word_be = u16::from_ne_bytes([syn.doff, TCP_RST | TCP_ACK]);
    // Swapping addresses or ports leaves every checksum as it is (one's
    // complement sums commute, and IPv6's pseudo-header sums the same two
    // addresses); only the changed fields are accounted for.
    ctx.l4_csum_replace(csum, u64::from(seq_be), 0, 4)?;
    ctx.l4_csum_replace(csum, u64::from(ack_be), u64::from(new_ack_be), 4)?;
    ctx.l4_csum_replace(
        csum,
        u64::from(flags_word_be),
        u64::from(new_flags_word_be),
        2,
    )?;
    ctx.l4_csum_replace(csum, u64::from(window_be), 0, 2)?;
    let seq_ack: [u32; 2] = [0, new_ack_be];
    ctx.store(l4 + 4, &seq_ack, 0)?;
    ctx.store(l4 + 12, &new_flags_word_be, 0)?;
    ctx.store(l4 + 14, &0u16, 0)?;
    let ports: [u16; 2] = [syn.dport_be, syn.sport_be];
    ctx.store(l4, &ports, 0)?;
    swap_addrs()?;
    let swapped: [u8; 12] = [
        macs[6], macs[7], macs[8], macs[9], macs[10], macs[11], macs[0], macs[1], macs[2], macs[3],
        macs[4], macs[5],
    ];
    ctx.store(0, &swapped, 0)?;
    Ok(redirect_back(ctx))
}

#[inline(always)]
pub fn redirect_back(ctx: &TcContext) -> i32 {
    // SAFETY: `skb` is the context the kernel passed this program, valid for its run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: takes an interface index and flags, no pointers.
    unsafe { helpers::bpf_redirect(ifindex, 0) };
    TC_ACT_REDIRECT
}
