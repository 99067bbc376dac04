//! ebpf-proxy kernel programs. Entry points are thin; the logic lives in the
//! modules, shared by every hook.
#![no_std]
#![no_main]

mod conntrack;
mod lb;
mod maps;
mod nat;
mod packet;
mod reject;
mod service;

use aya_ebpf::{macros::classifier, programs::TcContext};

/// tc ingress on pod-facing interfaces and uplinks: DNAT of packets to
/// frontends, reverse NAT of their replies.
#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    service::handle(&ctx)
}

/// Does nothing: the per-packet cost floor that benchmarks compare against.
/// Never attached.
#[classifier]
pub fn tc_pass(_ctx: TcContext) -> i32 {
    aya_ebpf::bindings::TC_ACT_OK
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
