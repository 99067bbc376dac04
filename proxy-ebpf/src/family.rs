//! What differs between IPv4 and IPv6 for the parts of the datapath written
//! once over the family (`conntrack`, `flow_cache`, `nat`, `route`,
//! `reject`): the width of an address, the maps a family's flows live in,
//! the writing of the IP header's addresses and the router's decrement of
//! TTL or hop limit (IPv4's with its header checksum), the FIB's family,
//! and the ICMP error that says a packet is too big.
//! Each family is a type without values (`V4`, `V6`); code generic over
//! `F: Family` is monomorphized, so each family's program holds its own
//! copy, with no branch on the family at run time.

use aya_ebpf::{bindings::bpf_fib_lookup, programs::TcContext};
use proxy_common::{
    FlowAddr, FragKey, PROTO_TCP, PROTO_UDP,
    csum::{apply, delta32, fold, replace16},
    v4_mapped,
};

use crate::{
    event_log::{self, Event},
    maps::{
        CONNTRACK, CONNTRACK6, CT_NEW, CT_NEW6, CT_SOURCES, CT_SOURCES6, Conntrack, CtSources,
        FLOW_CACHE, FLOW_CACHE6, FlowCache, SCRATCH, SCRATCH6, Scratch,
    },
    packet::{
        ETH_HLEN, FlowOf, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IPPROTO_ICMP, IPV4_MIN_HLEN, read,
    },
    packet6::{IP6_DST_OFF, IP6_SRC_OFF, IPV6_HLEN, MAX_L4_OFF as MAX_L4_OFF6, NEXTHDR_ICMPV6},
};

/// An ICMP error the datapath answers with (`crate::reject`).
#[derive(Clone, Copy)]
pub enum IcmpError {
    /// Nothing listens: a frontend without endpoints.
    PortUnreachable,
    /// Longer than the route's MTU, this one.
    TooBig(u16),
}

/// An address family the datapath translates.
pub trait Family {
    /// An address as on the wire (network order words).
    type Addr: FlowAddr;

    /// Assured flows (see `crate::conntrack`).
    fn conntrack() -> &'static Conntrack<Self::Addr>;

    /// Flows not assured yet.
    fn ct_new() -> &'static Conntrack<Self::Addr>;

    /// This CPU's room for conntrack's temporaries (see `maps::Scratch`).
    fn scratch() -> Option<*mut Scratch<Self::Addr>>;

    /// Assured flows per client address (see `maps::CtSources`).
    fn ct_sources() -> &'static CtSources<Self::Addr>;

    /// The per-CPU flow cache (see `crate::flow_cache`).
    fn flow_cache() -> &'static FlowCache<Self::Addr>;

    /// Logs `event` about a packet of `flow`.
    fn log(event: Event, flow: &FlowOf<Self::Addr>);

    /// Whether `frag_key` holds the transport protocol (else `FragValue`
    /// does, for the later fragments).
    const FRAG_KEY_HAS_PROTO: bool;

    /// What ties `flow`'s fragments together on the wire, as `FRAGMENTS`
    /// keys it (see `crate::frag`).
    fn frag_key(flow: &FlowOf<Self::Addr>) -> FragKey;

    /// `AF_INET` or `AF_INET6`, as the FIB takes it.
    const AF: u8;

    /// Writes the source and destination of a FIB query.
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &Self::Addr, dst: &Self::Addr);

    /// Takes one off the TTL or hop limit of the packet between `data` and
    /// `data_end`, as a router does (IPv4's header checksum with it). False
    /// when it is spent (1 or 0: the packet is not to be sent on) or the
    /// packet has no room for the header.
    fn decrement_hops(data: usize, data_end: usize) -> bool;

    /// Logs `event` about a packet known by its addresses.
    fn log_addrs(event: Event, proto: u8, src: &Self::Addr, dst: &Self::Addr);

    /// Whether a router may fragment the packet between `data` and
    /// `data_end` rather than answer that it is too big: IPv4 without DF.
    fn may_fragment(data: usize, data_end: usize) -> bool;

    /// The IP header's length, without options or extension headers.
    const HLEN: usize;

    /// Whether the IP header of the packet between `data` and `data_end`
    /// carries options (or cannot be read): IPv4's; IPv6 has none in its
    /// header.
    fn options(data: usize, data_end: usize) -> bool;

    /// The Ethernet frame's type, in network order.
    const ETH_P_BE: u16;

    /// The ICMP error's first word (type, code, checksum 0) and second
    /// (what follows: the MTU of "too big"), as they sit in memory.
    fn icmp_words(error: IcmpError) -> [u32; 2];

    /// Writes the IP header of an ICMP error at `ip`, and the ICMP header
    /// that follows it (`words`, with its checksum over what is summed,
    /// `quote_sum` being the quote's words' sum), for an ICMP message
    /// `icmp_len` bytes long. The error goes back to the quoted packet's
    /// sender from the address it was sent to (whom the sender expects
    /// errors from): both read from the quote, which follows the ICMP
    /// header, rather than passed, which would hold them on the stack.
    ///
    /// # Safety
    /// `ip` must point at `2 * HLEN + 8` bytes of packet memory: the new
    /// headers (written) and the quoted IP header (read).
    unsafe fn write_error(ip: usize, words: [u32; 2], icmp_len: u16, quote_sum: u64);

    /// Deepest transport header start the parser accepts; bounds the
    /// offsets the verifier sees.
    const MAX_L4_OFF: usize;

    /// The change to the one's complement sum (unfolded) when `old` becomes
    /// `new`.
    fn addr_delta(old: &Self::Addr, new: &Self::Addr) -> u64;

    /// Writes `src_be` and `dst_be` over `flow`'s addresses in the IP header
    /// of the packet between `data` and `data_end` (IPv4's header checksum
    /// with them);
    /// returns the change to their sum, which the transport checksum's
    /// pseudo-header follows. Nothing is written unless the header is
    /// inside the packet.
    fn rewrite_ip(
        data: usize,
        data_end: usize,
        flow: &FlowOf<Self::Addr>,
        src_be: &Self::Addr,
        dst_be: &Self::Addr,
    ) -> Result<u64, ()>;

    /// `rewrite_ip` at tc, whose packet data the helpers may have moved:
    /// IPv4's in place, with its header checksum; IPv6's through
    /// `bpf_skb_store_bytes`, which costs the verifier less to follow than
    /// another bounds check in a program near its limit.
    fn rewrite_ip_tc(
        ctx: &TcContext,
        flow: &FlowOf<Self::Addr>,
        src_be: &Self::Addr,
        dst_be: &Self::Addr,
    ) -> Result<(), i64>;

    /// `rewrite_ip_tc` for a packet whose transport checksum covers no
    /// address (SCTP's): a `CHECKSUM_COMPLETE` `skb->csum` must follow the
    /// addresses themselves. IPv4's header checksum balances them within
    /// the header; IPv6's are written through the helper that keeps the
    /// sum.
    fn rewrite_ip_tc_summed(
        ctx: &TcContext,
        flow: &FlowOf<Self::Addr>,
        src_be: &Self::Addr,
        dst_be: &Self::Addr,
    ) -> Result<(), i64>;

    /// Whether a `CHECKSUM_COMPLETE` `skb->csum` still holds after a
    /// rewrite in place (`crate::nat`): true where the address change is
    /// balanced by the transport checksum's alone.
    const COMPLETE_HOLDS: bool;

    /// Where tc may write `flow`'s transport header in place, in the packet
    /// between `data` and `data_end`; None leaves the rewrite to the
    /// kernel's checksum helper.
    fn tc_l4_off(data: usize, data_end: usize, flow: &FlowOf<Self::Addr>) -> Option<usize>;

    /// Whether a UDP checksum of 0 means "none" (else a computed 0 is sent
    /// as 0xffff, and a 0 received is no checksum the datapath keeps).
    const UDP_ZERO_IS_NONE: bool;
}

/// IPv4.
pub enum V4 {}

/// IPv6.
pub enum V6 {}

/// `bpf_skb_store_bytes`: a `CHECKSUM_COMPLETE` `skb->csum` follows what
/// is written.
pub const BPF_F_RECOMPUTE_CSUM: u64 = 1;
const AF_INET: u8 = 2;
/// IPv4's don't-fragment flag, as the flags and offset field sits in memory.
const IP_DF_BE: u16 = 0x4000u16.to_be();
/// What an error's IP header says of its hops: the kernel's default.
const ERROR_TTL: u8 = 64;
const AF_INET6: u8 = 10;
/// Offset of the TTL in the IPv4 header.
const IP_TTL_OFF: usize = 8;
/// Offset of the hop limit in the IPv6 header.
const IP6_HOP_LIMIT_OFF: usize = 7;
/// Offset of the next-header field in the IPv6 header.
const IP6_NEXT_HDR_OFF: usize = 6;

impl Family for V4 {
    type Addr = u32;
    const AF: u8 = AF_INET;

    #[inline(always)]
    fn conntrack() -> &'static Conntrack<u32> {
        &CONNTRACK
    }

    #[inline(always)]
    fn ct_new() -> &'static Conntrack<u32> {
        &CT_NEW
    }

    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<u32>> {
        SCRATCH.get_ptr_mut(0)
    }

    #[inline(always)]
    fn ct_sources() -> &'static CtSources<u32> {
        &CT_SOURCES
    }

    #[inline(always)]
    fn flow_cache() -> &'static FlowCache<u32> {
        &FLOW_CACHE
    }

    #[inline(always)]
    fn log(event: Event, flow: &FlowOf<u32>) {
        event_log::log(event, flow);
    }

    const FRAG_KEY_HAS_PROTO: bool = true;

    /// IPv4-mapped addresses, the protocol and the 16-bit identification
    /// (RFC 791), widened.
    #[inline(always)]
    fn frag_key(flow: &FlowOf<u32>) -> FragKey {
        FragKey {
            src_be: v4_mapped(flow.src_be),
            dst_be: v4_mapped(flow.dst_be),
            id_be: flow.frag_id_be,
            proto: flow.proto,
            _pad0: 0,
            _pad1: 0,
        }
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &u32, dst: &u32) {
        params.__bindgen_anon_3.ipv4_src = *src;
        params.__bindgen_anon_4.ipv4_dst = *dst;
    }

    #[inline(always)]
    fn decrement_hops(data: usize, data_end: usize) -> bool {
        let ip = data + ETH_HLEN;
        if ip + 20 > data_end {
            return false;
        }
        // SAFETY: inside the bounds checked above.
        unsafe {
            let ttl_word = (ip + IP_TTL_OFF) as *mut u16;
            let old = ttl_word.read();
            let ttl = *((ip + IP_TTL_OFF) as *const u8);
            if ttl <= 1 {
                return false;
            }
            *((ip + IP_TTL_OFF) as *mut u8) = ttl - 1;
            let new = ttl_word.read();
            let ip_csum = (ip + IP_CSUM_OFF) as *mut u16;
            ip_csum.write(replace16(ip_csum.read(), old, new));
        }
        true
    }

    #[inline(always)]
    fn log_addrs(event: Event, proto: u8, src: &u32, dst: &u32) {
        event_log::log_addrs(event, proto, *src, *dst);
    }

    #[inline(always)]
    fn may_fragment(data: usize, data_end: usize) -> bool {
        read::<u16>(data, data_end, ETH_HLEN + 6).is_some_and(|frag| frag & IP_DF_BE == 0)
    }

    const HLEN: usize = IPV4_MIN_HLEN;

    #[inline(always)]
    fn options(data: usize, data_end: usize) -> bool {
        read::<u8>(data, data_end, ETH_HLEN).is_none_or(|ver_ihl| ver_ihl & 0x0f != 5)
    }
    const ETH_P_BE: u16 = 0x0800u16.to_be();

    /// RFC 792 (port unreachable: type 3 code 3) and RFC 1191
    /// (fragmentation needed: type 3 code 4, the next hop's MTU in the
    /// second word's low half).
    #[inline(always)]
    fn icmp_words(error: IcmpError) -> [u32; 2] {
        match error {
            IcmpError::PortUnreachable => [u32::from_ne_bytes([3, 3, 0, 0]), 0],
            IcmpError::TooBig(mtu) => [u32::from_ne_bytes([3, 4, 0, 0]), u32::from(mtu).to_be()],
        }
    }

    /// No pseudo-header in ICMP's checksum; the IP header has its own.
    #[inline(always)]
    unsafe fn write_error(ip: usize, words: [u32; 2], icmp_len: u16, quote_sum: u64) {
        let quote = ip + 20 + 8;
        // SAFETY: the caller's bounds, as documented.
        unsafe {
            let to = ((quote + 12) as *const u32).read();
            let from = ((quote + 16) as *const u32).read();
            let head = [
                u32::from_ne_bytes({
                    let [hi, lo] = (20 + icmp_len).to_be_bytes();
                    [0x45, 0, hi, lo]
                }),
                0,
                u32::from_ne_bytes([ERROR_TTL, IPPROTO_ICMP, 0, 0]),
                from,
                to,
            ];
            let ip_sum: u64 = head.iter().map(|w| u64::from(*w)).sum();
            let icmp_sum = u64::from(words[0]) + u64::from(words[1]) + quote_sum;
            (ip as *mut [u32; 5]).write(head);
            ((ip + 10) as *mut u16).write(!fold(ip_sum));
            ((ip + 20) as *mut [u32; 2]).write(words);
            ((ip + 22) as *mut u16).write(!fold(icmp_sum));
        }
    }

    /// Ethernet plus a full 60-byte header.
    const MAX_L4_OFF: usize = ETH_HLEN + 60;

    #[inline(always)]
    fn addr_delta(old: &u32, new: &u32) -> u64 {
        delta32(*old, *new)
    }

    #[inline(always)]
    fn rewrite_ip(
        data: usize,
        data_end: usize,
        flow: &FlowOf<u32>,
        src_be: &u32,
        dst_be: &u32,
    ) -> Result<u64, ()> {
        let ip = data + ETH_HLEN;
        if ip + IPV4_MIN_HLEN > data_end {
            return Err(());
        }
        let addrs = delta32(flow.src_be, *src_be) + delta32(flow.dst_be, *dst_be);
        // SAFETY: inside the bounds checked above.
        unsafe {
            ((ip + IP_SRC_OFF) as *mut u32).write(*src_be);
            ((ip + IP_DST_OFF) as *mut u32).write(*dst_be);
            let ip_csum = (ip + IP_CSUM_OFF) as *mut u16;
            ip_csum.write(apply(ip_csum.read(), addrs));
        }
        Ok(addrs)
    }

    #[inline(always)]
    fn rewrite_ip_tc(
        ctx: &TcContext,
        flow: &FlowOf<u32>,
        src_be: &u32,
        dst_be: &u32,
    ) -> Result<(), i64> {
        Self::rewrite_ip(ctx.data(), ctx.data_end(), flow, src_be, dst_be)
            .map(|_| ())
            .map_err(|()| -1)
    }

    #[inline(always)]
    fn rewrite_ip_tc_summed(
        ctx: &TcContext,
        flow: &FlowOf<u32>,
        src_be: &u32,
        dst_be: &u32,
    ) -> Result<(), i64> {
        Self::rewrite_ip_tc(ctx, flow, src_be, dst_be)
    }

    /// The header checksum balances the address change within the header;
    /// the transport checksum takes it once more, for its pseudo-header, so
    /// the packet's sum moves.
    const COMPLETE_HOLDS: bool = false;

    /// Past the options, wherever the header's length puts it: the verifier
    /// bounds it by `MAX_L4_OFF`.
    #[inline(always)]
    fn tc_l4_off(_data: usize, _data_end: usize, flow: &FlowOf<u32>) -> Option<usize> {
        Some(flow.l4_off)
    }

    /// RFC 768.
    const UDP_ZERO_IS_NONE: bool = true;
}

impl Family for V6 {
    type Addr = [u32; 4];
    const AF: u8 = AF_INET6;

    #[inline(always)]
    fn conntrack() -> &'static Conntrack<[u32; 4]> {
        &CONNTRACK6
    }

    #[inline(always)]
    fn ct_new() -> &'static Conntrack<[u32; 4]> {
        &CT_NEW6
    }

    #[inline(always)]
    fn scratch() -> Option<*mut Scratch<[u32; 4]>> {
        SCRATCH6.get_ptr_mut(0)
    }

    #[inline(always)]
    fn ct_sources() -> &'static CtSources<[u32; 4]> {
        &CT_SOURCES6
    }

    #[inline(always)]
    fn flow_cache() -> &'static FlowCache<[u32; 4]> {
        &FLOW_CACHE6
    }

    #[inline(always)]
    fn log(event: Event, flow: &FlowOf<[u32; 4]>) {
        event_log::log6(event, flow);
    }

    const FRAG_KEY_HAS_PROTO: bool = false;

    /// The addresses and the fragment header's identification, what RFC
    /// 8200 4.5 reassembles by. Not the protocol: the header after the
    /// fragment header may be a destination options header, which a later
    /// fragment does not carry past; the first fragment's value holds the
    /// transport protocol its chain led to.
    #[inline(always)]
    fn frag_key(flow: &FlowOf<[u32; 4]>) -> FragKey {
        FragKey {
            src_be: flow.src_be,
            dst_be: flow.dst_be,
            id_be: flow.frag_id_be,
            proto: 0,
            _pad0: 0,
            _pad1: 0,
        }
    }

    #[inline(always)]
    fn fib_addrs(params: &mut bpf_fib_lookup, src: &[u32; 4], dst: &[u32; 4]) {
        params.__bindgen_anon_3.ipv6_src = *src;
        params.__bindgen_anon_4.ipv6_dst = *dst;
    }

    /// A plain store: IPv6 has no header checksum, and the transport
    /// checksum does not cover the hop limit.
    #[inline(always)]
    fn decrement_hops(data: usize, data_end: usize) -> bool {
        if data + ETH_HLEN + IPV6_HLEN > data_end {
            return false;
        }
        // SAFETY: inside the bounds checked above.
        unsafe {
            let hop_limit = (data + ETH_HLEN + IP6_HOP_LIMIT_OFF) as *mut u8;
            if *hop_limit <= 1 {
                return false;
            }
            *hop_limit -= 1;
        }
        true
    }

    #[inline(always)]
    fn log_addrs(event: Event, proto: u8, src: &[u32; 4], dst: &[u32; 4]) {
        event_log::log6_addrs(event, proto, src, dst);
    }

    /// IPv6 routers never fragment (RFC 8200 5).
    #[inline(always)]
    fn may_fragment(_data: usize, _data_end: usize) -> bool {
        false
    }

    const HLEN: usize = IPV6_HLEN;

    #[inline(always)]
    fn options(_data: usize, _data_end: usize) -> bool {
        false
    }
    const ETH_P_BE: u16 = 0x86ddu16.to_be();

    /// RFC 4443: destination unreachable, port unreachable (type 1 code 4);
    /// packet too big (type 2 code 0, the MTU in the second word).
    #[inline(always)]
    fn icmp_words(error: IcmpError) -> [u32; 2] {
        match error {
            IcmpError::PortUnreachable => [u32::from_ne_bytes([1, 4, 0, 0]), 0],
            IcmpError::TooBig(mtu) => [u32::from_ne_bytes([2, 0, 0, 0]), u32::from(mtu).to_be()],
        }
    }

    /// ICMPv6's checksum covers the pseudo-header (addresses, upper-layer
    /// length, next header as 32-bit big-endian words, RFC 8200 8.1).
    #[inline(always)]
    unsafe fn write_error(ip: usize, words: [u32; 2], icmp_len: u16, quote_sum: u64) {
        let quote = ip + IPV6_HLEN + 8;
        let mut sum = u64::from(u32::from(icmp_len).to_be())
            + u64::from(u32::from(NEXTHDR_ICMPV6).to_be())
            + u64::from(words[0])
            + u64::from(words[1])
            + quote_sum;
        let [hi, lo] = icmp_len.to_be_bytes();
        // SAFETY: the caller's bounds, as documented.
        unsafe {
            (ip as *mut u32).write(0x6000_0000u32.to_be());
            ((ip + 4) as *mut [u8; 4]).write([hi, lo, NEXTHDR_ICMPV6, ERROR_TTL]);
            // From the quote's destination to its source, a word at a time.
            for i in 0..4 {
                let to = ((quote + 8 + 4 * i) as *const u32).read();
                let from = ((quote + 24 + 4 * i) as *const u32).read();
                sum += u64::from(from) + u64::from(to);
                ((ip + 8 + 4 * i) as *mut u32).write(from);
                ((ip + 24 + 4 * i) as *mut u32).write(to);
            }
            ((ip + IPV6_HLEN) as *mut [u32; 2]).write(words);
            ((ip + IPV6_HLEN + 2) as *mut u16).write(!fold(sum));
        }
    }

    const MAX_L4_OFF: usize = MAX_L4_OFF6;

    #[inline(always)]
    fn addr_delta(old: &[u32; 4], new: &[u32; 4]) -> u64 {
        let mut sum = 0;
        for i in 0..4 {
            sum += delta32(old[i], new[i]);
        }
        sum
    }

    #[inline(always)]
    fn rewrite_ip(
        data: usize,
        data_end: usize,
        flow: &FlowOf<[u32; 4]>,
        src_be: &[u32; 4],
        dst_be: &[u32; 4],
    ) -> Result<u64, ()> {
        let ip = data + ETH_HLEN;
        if ip + IPV6_HLEN > data_end {
            return Err(());
        }
        let addrs = Self::addr_delta(&flow.src_be, src_be) + Self::addr_delta(&flow.dst_be, dst_be);
        // SAFETY: inside the bounds checked above.
        unsafe {
            ((ip + IP6_SRC_OFF) as *mut [u32; 4]).write(*src_be);
            ((ip + IP6_DST_OFF) as *mut [u32; 4]).write(*dst_be);
        }
        Ok(addrs)
    }

    /// Stored from where they are: a copy of both would take 32 bytes of a
    /// stack that is nearly used up.
    #[inline(always)]
    fn rewrite_ip_tc(
        ctx: &TcContext,
        _flow: &FlowOf<[u32; 4]>,
        src_be: &[u32; 4],
        dst_be: &[u32; 4],
    ) -> Result<(), i64> {
        ctx.store(ETH_HLEN + IP6_SRC_OFF, src_be, 0)?;
        ctx.store(ETH_HLEN + IP6_DST_OFF, dst_be, 0)
    }

    #[inline(always)]
    fn rewrite_ip_tc_summed(
        ctx: &TcContext,
        _flow: &FlowOf<[u32; 4]>,
        src_be: &[u32; 4],
        dst_be: &[u32; 4],
    ) -> Result<(), i64> {
        ctx.store(ETH_HLEN + IP6_SRC_OFF, src_be, BPF_F_RECOMPUTE_CSUM)?;
        ctx.store(ETH_HLEN + IP6_DST_OFF, dst_be, BPF_F_RECOMPUTE_CSUM)
    }

    /// No header checksum: the transport checksum's change balances the
    /// addresses' and the ports'.
    const COMPLETE_HOLDS: bool = true;

    /// Right after the IPv6 header, where no extension header comes
    /// between: a constant offset. Read from the packet rather than told by
    /// the parser's offset: a branch on that offset would have the verifier
    /// tell apart, all through the program, every path the header walk took
    /// to it.
    #[inline(always)]
    fn tc_l4_off(data: usize, data_end: usize, _flow: &FlowOf<[u32; 4]>) -> Option<usize> {
        let next = data + ETH_HLEN + IP6_NEXT_HDR_OFF;
        if next + 1 > data_end {
            return None;
        }
        // SAFETY: inside the bounds checked above.
        let next = unsafe { (next as *const u8).read() };
        (next == PROTO_TCP || next == PROTO_UDP).then_some(ETH_HLEN + IPV6_HLEN)
    }

    /// RFC 8200 8.1: a UDP checksum is not optional over IPv6.
    const UDP_ZERO_IS_NONE: bool = false;
}
