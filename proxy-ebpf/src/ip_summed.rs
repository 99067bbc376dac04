//! `skb->ip_summed`, read through the sequence `proxy_common::ip_summed`
//! describes (the agent completes it at load time).

use aya_ebpf::{EbpfContext, programs::TcContext};
use proxy_common::ip_summed::{CALL_MAGIC, UNKNOWN};

/// The checksum state of `ctx`'s socket buffer (`proxy_common::ip_summed`'s
/// `CHECKSUM_*`), or `UNKNOWN`.
#[inline(always)]
pub fn read(ctx: &TcContext) -> u64 {
    let state: u64;
    // SAFETY: a kfunc call taking the context and a read-only byte load the
    // verifier checks against the kernel's BTF; registers a call clobbers are
    // declared so.
    unsafe {
        core::arch::asm!(
            "call {magic}",
            "if r0 == 0 goto +4",
            "r0 = *(u8 *)(r0 + 0)",
            "r0 >>= 0",
            "r0 &= 3",
            "goto +1",
            "r0 = {unknown}",
            magic = const CALL_MAGIC,
            unknown = const UNKNOWN,
            inout("r1") ctx.as_ptr() => _,
            lateout("r0") state,
            lateout("r2") _,
            lateout("r3") _,
            lateout("r4") _,
            lateout("r5") _,
            options(nostack, readonly),
        );
    }
    state
}
