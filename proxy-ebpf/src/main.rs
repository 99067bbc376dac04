//! ebpf-proxy kernel programs. Entry points are thin: they run the
//! pipeline (`pipeline`), written once over the family and the hook, whose
//! decisions are carried out in the hook's terms (`verdict`).
//!
//! The packet programs are `#[inline(always)]` under their program macro,
//! which otherwise leaves the body a function of its own that the entry
//! calls: a BPF-to-BPF call and its return on every packet, 6-8 ns on a
//! kernel that returns through a thunk (docs/architecture.md, "No calls on
//! a packet's path").
#![no_std]
#![no_main]
#![expect(
    internal_features,
    reason = "`core_intrinsics`, for one atomic add (see `flow_cache::invalidate`)"
)]
#![feature(core_intrinsics)]
// For the kfunc call that reads `skb->ip_summed` (see `ip_summed`).
#![feature(asm_experimental_arch)]
#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys and values passed by value to aya's `impl Borrow<K>` are copied into the \
              caller's frame first: 27 more instructions in tc_ingress and 28 in xdp_ingress, \
              where the stack has 32 bytes to spare"
)]
#![expect(
    clippy::needless_pass_by_value,
    reason = "aya-ebpf's program macros hand each entry point its context by value"
)]

mod conntrack;
mod ct_reap;
mod dsr;
mod event_log;
mod family;
mod flow_cache;
mod frag;
mod frontend;
mod hook;
mod icmp_error;
mod ip_summed;
mod maps;
mod nat;
mod netfilter_ct;
mod packet;
mod packet6;
mod pipeline;
mod prefilter;
mod reject;
mod route;
mod service_cidr;
mod service_counters;
mod sock;
mod trace;
mod verdict;

use aya_ebpf::{
    bindings::xdp_action,
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use family::{V4, V6};

/// tc ingress on pod-facing interfaces and uplinks: every translation,
/// east-west and north-south; on uplinks also what XDP left to it.
///
/// Linux 6.6: attached through a tcx link. It calls `bpf_redirect_neigh`
/// (5.10) and `bpf_ktime_get_coarse_ns` (5.11), writes the ring buffer of
/// the datapath log (5.8), and reads the checksum state through the
/// `bpf_cast_to_kern_ctx` kfunc where the kernel has it (6.2; the agent
/// loads it without that read otherwise). The agent checks these at start
/// (proxy-userspace's `datapath::kernel_version`).
#[classifier]
#[inline(always)]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    pipeline::handle::<V4, _>(&ctx)
}

/// tc ingress for IPv6, reached from `tc_ingress` by a tail call through
/// `TC_NEXT` for whatever is not IPv4 (`verdict::Verdicts::next`), and
/// attached after it in the same interfaces' tcx chains, where it runs
/// when that slot is empty. The same pipeline as `tc_ingress`'s, in a
/// program of its own, so that each family has its own stack and verifier
/// budget (see `pipeline`).
///
/// Linux 6.6 for tcx, as `tc_ingress`.
#[classifier]
#[inline(always)]
pub fn tc_ingress6(ctx: TcContext) -> i32 {
    pipeline::handle::<V6, _>(&ctx)
}

/// tc for an IPv4 packet another node sent here by direct server return,
/// reached from `tc_ingress` only, by a tail call through `TC_DSR` (see
/// `dsr` and `pipeline::dsr_arrival`): its flow learnt or touched, the packet passed on as it came.
#[classifier]
pub fn tc_dsr(ctx: TcContext) -> i32 {
    pipeline::dsr_arrival::<V4>(&ctx)
}

/// The first packet of a new IPv6 flow at tc, reached from `tc_ingress6`
/// only, by a tail call through `TC_NEXT` (see
/// `pipeline::new_flow_apart`).
#[classifier]
#[inline(always)]
pub fn tc_new6(ctx: TcContext) -> i32 {
    pipeline::new_flow_apart::<V6>(&ctx)
}

/// `tc_dsr` for IPv6, from `tc_ingress6`.
#[classifier]
pub fn tc_dsr6(ctx: TcContext) -> i32 {
    pipeline::dsr_arrival::<V6>(&ctx)
}

/// XDP on uplinks: the north-south fast path, before any socket buffer
/// exists. What is not IPv4 goes on to `xdp_ingress6` by a tail call
/// through `XDP_NEXT` (see `verdict::Verdicts::next`).
///
/// Linux 5.9 for its bpf link; generic XDP works on any interface, native
/// XDP where the driver has it. Helpers as `tc_ingress`.
#[xdp]
#[inline(always)]
pub fn xdp_ingress(ctx: XdpContext) -> u32 {
    pipeline::handle::<V4, _>(&ctx)
}

/// XDP for IPv6, reached from `xdp_ingress` only (never attached): the
/// north-south fast path of IPv6, with a stack of its own. What it cannot
/// finish it passes untouched to `tc_ingress6` (see `verdict`).
///
/// Linux 5.9, as `xdp_ingress`.
#[xdp]
#[inline(always)]
pub fn xdp_ingress6(ctx: XdpContext) -> u32 {
    pipeline::handle::<V6, _>(&ctx)
}

/// cgroup `connect4`: the node's own connections to frontends go to a
/// backend from the start (see `sock`).
///
/// Linux 4.17 for the hook, 5.7 for the cgroup bpf link it is attached
/// through.
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::connect::<V4>(&ctx)
}

/// cgroup `sendmsg4`: the same for datagrams of unconnected UDP sockets.
///
/// Linux 4.18 for the hook, 5.7 for its link.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::sendmsg::<V4>(&ctx)
}

/// cgroup `recvmsg4`: their answers show the frontend they were sent to.
///
/// Linux 5.2 for the hook, 5.7 for its link.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::recvmsg::<V4>(&ctx)
}

/// cgroup `getpeername4`: a socket connected to a backend in a frontend's
/// place shows the frontend as its peer.
///
/// Linux 5.8 for the hook.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::getpeername::<V4>(&ctx)
}

/// cgroup `connect6`: `sock_connect4` for the node's IPv6 sockets, an
/// IPv4-mapped destination as the IPv4 frontend it names (see `sock6`).
///
/// Linux 4.17 for the hook, 5.7 for its link.
#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    sock::connect::<V6>(&ctx)
}

/// cgroup `sendmsg6`: `sock_sendmsg4` for IPv6 sockets.
///
/// Linux 4.18 for the hook, 5.7 for its link.
#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::sendmsg::<V6>(&ctx)
}

/// cgroup `recvmsg6`: `sock_recvmsg4` for IPv6 sockets.
///
/// Linux 5.2 for the hook, 5.7 for its link.
#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::recvmsg::<V6>(&ctx)
}

/// cgroup `getpeername6`: `sock_getpeername4` for IPv6 sockets.
///
/// Linux 5.8 for the hook.
#[cgroup_sock_addr(getpeername6)]
pub fn sock_getpeername6(ctx: SockAddrContext) -> i32 {
    sock::getpeername::<V6>(&ctx)
}

/// Run by the agent, never attached to a hook: see
/// `proxy_common::program_names::SOCK_NOTES_DUMP`. Written out by hand, as
/// aya-ebpf has no macro for iterators.
///
/// Linux 5.9 for iterators over the UDP table; without it the agent runs
/// on, and does not close the node's UDP sockets connected to departed
/// backends.
#[unsafe(no_mangle)]
#[unsafe(link_section = "iter/udp")]
pub extern "C" fn sock_notes_dump(ctx: *mut core::ffi::c_void) -> i32 {
    sock::dump_notes::<V4>(ctx)
}

/// `sock_notes_dump` over `SOCK_NOTES6`, the notes of IPv6 backends: see
/// `proxy_common::program_names::SOCK_NOTES6_DUMP`.
///
/// Linux 5.9, as `sock_notes_dump`.
#[unsafe(no_mangle)]
#[unsafe(link_section = "iter/udp")]
pub extern "C" fn sock_notes6_dump(ctx: *mut core::ffi::c_void) -> i32 {
    sock::dump_notes::<V6>(ctx)
}

/// Does nothing: the per-packet cost floor that benchmarks compare against.
/// Never attached.
#[classifier]
pub fn tc_pass(_ctx: TcContext) -> i32 {
    hook::TCX_NEXT
}

/// The XDP floor, as `tc_pass` is for tc.
#[xdp]
pub fn xdp_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// The conntrack work of a new flow alone (see
/// `proxy_common::program_names::TC_CT_PAIR`). Never attached.
#[classifier]
pub fn tc_ct_pair(ctx: TcContext) -> i32 {
    pipeline::conntrack_pair(&ctx);
    hook::TCX_NEXT
}

/// The XDP twin of `tc_ct_pair`.
#[xdp]
pub fn xdp_ct_pair(ctx: XdpContext) -> u32 {
    pipeline::conntrack_pair(&ctx);
    xdp_action::XDP_PASS
}

/// Samples the kernel clocks for the agent (see `proxy_common::Clock`).
/// Never attached: run through `BPF_PROG_TEST_RUN`.
#[xdp]
pub fn clock_probe(_ctx: XdpContext) -> u32 {
    conntrack::sample_clocks();
    xdp_action::XDP_PASS
}

/// Removes the conntrack entries the agent's reaper read as expired, each
/// only if it still is (see `ct_reap`). Never attached: run through
/// `BPF_PROG_TEST_RUN`.
#[xdp]
pub fn ct_reap(ctx: XdpContext) -> u32 {
    ct_reap::reap(&ctx);
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

/// Several helpers used here are GPL-only.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
