//! Whether netfilter translates a flow: kube-proxy's flows, which tc leaves
//! to netfilter once this datapath has taken over, and answers to flows
//! netfilter masqueraded to a port of the node's own frontends (the
//! sequence, and why: `proxy_common::netfilter_ct`).

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map};
use proxy_common::{
    PROTO_TCP, PROTO_UDP,
    netfilter_ct::{
        CURRENT_NETNS, LOOKUP_MAGIC, OPTS_SIZE, RELEASE_MAGIC, TUPLE_V4_SIZE, TUPLE_V6_SIZE,
        XDP_LOOKUP_MAGIC,
    },
};

use crate::{
    hook::Hook,
    packet::{TCP_ACK, TCP_SYN},
};

/// The lookup's arguments: `struct bpf_sock_tuple` (IPv4's or IPv6's) and
/// `struct bpf_ct_opts`, in a map of their own rather than on the stack,
/// which `tc_ingress` has no room on.
#[repr(C)]
pub struct Lookup {
    /// Addresses, then the ports, as the kernel's tuple lays them out.
    tuple: [u32; 9],
    opts: Opts,
}

/// `struct bpf_ct_opts`, the 12 bytes every kernel with the kfunc takes.
#[repr(C)]
struct Opts {
    netns_id: i32,
    error: i32,
    l4proto: u8,
    dir: u8,
    reserved: [u8; 2],
}

/// Never pinned: it holds nothing from one packet to the next.
#[btf_map]
static NF_LOOKUP: PerCpuArray<Lookup, 1> = PerCpuArray::new();

/// Whether a packet of this protocol and TCP flags to a frontend, with no
/// flow here, may belong to a flow netfilter translates or masqueraded: one
/// that does not start a flow. A TCP SYN without ACK starts one, whatever
/// netfilter remembers of an earlier use of its tuple; a SYN-ACK is the
/// first answer of a connection netfilter masqueraded.
#[inline(always)]
pub fn may_be_netfilters(proto: u8, tcp_flags: u8) -> bool {
    proto == PROTO_UDP || (proto == PROTO_TCP && tcp_flags & (TCP_SYN | TCP_ACK) != TCP_SYN)
}

/// Whether netfilter's conntrack has an entry with this IPv4 tuple
/// (addresses and ports as on the wire) in either direction (see `ask`).
#[inline(always)]
pub fn has_v4<H: Hook>(
    ctx: &H,
    proto: u8,
    src_be: u32,
    dst_be: u32,
    sport_be: u16,
    dport_be: u16,
) -> bool {
    let Some(lookup) = NF_LOOKUP.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's entry, used by nothing else while this program
    // runs (the packet programs run one at a time on a CPU, never nested).
    unsafe {
        let tuple = &mut (*lookup).tuple;
        tuple[0] = src_be;
        tuple[1] = dst_be;
        tuple[2] = ports(sport_be, dport_be);
    }
    ask(ctx, lookup, proto, TUPLE_V4_SIZE)
}

/// `has_v4` for an IPv6 tuple.
#[inline(always)]
pub fn has_v6<H: Hook>(
    ctx: &H,
    proto: u8,
    src_be: &[u32; 4],
    dst_be: &[u32; 4],
    sport_be: u16,
    dport_be: u16,
) -> bool {
    let Some(lookup) = NF_LOOKUP.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: as in `has_v4`.
    unsafe {
        let tuple = &mut (*lookup).tuple;
        tuple[..4].copy_from_slice(src_be);
        tuple[4..8].copy_from_slice(dst_be);
        tuple[8] = ports(sport_be, dport_be);
    }
    ask(ctx, lookup, proto, TUPLE_V6_SIZE)
}

/// Two network-order ports as the tuple's one 32-bit word holds them
/// (source first in memory; this target is little-endian).
#[inline(always)]
fn ports(sport_be: u16, dport_be: u16) -> u32 {
    u32::from(sport_be) | (u32::from(dport_be) << 16)
}

/// The sequence of `proxy_common::netfilter_ct` with the lookup's
/// placeholder `$magic`: 1 when netfilter has an entry, 0 when not.
macro_rules! lookup_sequence {
    ($magic:expr, $ctx:expr, $tuple:expr, $tuple_size:expr, $opts:expr) => {{
        let found: u64;
        core::arch::asm!(
            "call {lookup}",
            "if r0 == 0 goto +3",
            "r1 = r0",
            "call {release}",
            "r0 = 1",
            lookup = const $magic,
            release = const RELEASE_MAGIC,
            inout("r1") $ctx.as_ptr() => _,
            inout("r2") $tuple => _,
            inout("r3") u64::from($tuple_size) => _,
            inout("r4") $opts => _,
            inout("r5") u64::from(OPTS_SIZE) => _,
            lateout("r0") found,
        );
        found
    }};
}

/// The kernel's answer through the hook's own lookup kfunc
/// (`bpf_skb_ct_lookup` at tc, `bpf_xdp_ct_lookup` at XDP).
#[inline(always)]
fn ask<H: Hook>(ctx: &H, lookup: *mut Lookup, proto: u8, tuple_size: u32) -> bool {
    // SAFETY: this CPU's entry (see `has_v4`); the options are written
    // whole before each call, as the kernel refuses nonzero reserved bytes.
    let (tuple, opts) = unsafe {
        (*lookup).opts = Opts {
            netns_id: CURRENT_NETNS,
            error: 0,
            l4proto: proto,
            dir: 0,
            reserved: [0; 2],
        };
        (
            core::ptr::addr_of_mut!((*lookup).tuple),
            core::ptr::addr_of_mut!((*lookup).opts),
        )
    };
    // SAFETY: two kfunc calls the verifier checks against the kernel's BTF
    // (the lookup's reference is released on the one path that has it);
    // their arguments point into this CPU's map entry, of the sizes given;
    // registers a call clobbers are declared so. One sequence per hook, as
    // an operand cannot name the hook's magic: the other is compiled out.
    let found = unsafe {
        if H::XDP {
            lookup_sequence!(XDP_LOOKUP_MAGIC, ctx, tuple, tuple_size, opts)
        } else {
            lookup_sequence!(LOOKUP_MAGIC, ctx, tuple, tuple_size, opts)
        }
    };
    // Either direction: the original is a flow netfilter translates, the
    // reply an answer to one it masqueraded, whose port, picked at random
    // (kube-proxy's nftables mode masquerades fully-random), may be a
    // NodePort's: taken for a new flow to it, that answer was DNATed away.
    found != 0
}
