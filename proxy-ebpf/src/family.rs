//! What differs between IPv4 and IPv6 for the parts of the datapath written
//! once over the family (`conntrack`, `flow_cache`, `route`, `reject`): the
//! width of an address, the maps a family's flows live in, the FIB's
//! family, the router's decrement of TTL or hop limit (IPv4's with its
//! header checksum), and the ICMP error that says a packet is too big.
//! Each family is a type without values (`V4`, `V6`); code generic over
//! `F: Family` is monomorphized, so each family's program holds its own
//! copy, with no branch on the family at run time.

use aya_ebpf::bindings::bpf_fib_lookup;
use proxy_common::{
    FlowAddr, FragKey,
    csum::{fold, replace16},
    v4_mapped,
};

use crate::{
    event_log::{self, Event},
    maps::{
        CONNTRACK, CONNTRACK6, CT_NEW, CT_NEW6, CT_SOURCES, CT_SOURCES6, Conntrack, CtSources,
        FLOW_CACHE, FLOW_CACHE6, FlowCache, SCRATCH, SCRATCH6, Scratch,
    },
    packet::{ETH_HLEN, FlowOf, IP_CSUM_OFF, IPPROTO_ICMP, IPV4_MIN_HLEN, read},
    packet6::{IPV6_HLEN, NEXTHDR_ICMPV6},
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
}

/// IPv4.
pub enum V4 {}

/// IPv6.
pub enum V6 {}

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
}
