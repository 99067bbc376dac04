//! What differs between the hooks the pipelines run at, at the bottom of
//! the datapath's layers: how packet bytes are reached, and which hook it
//! is. Everything above (parsing, lookups, conntrack, NAT) is written once
//! over the hook; what only tc can do (helpers that take a socket buffer)
//! is reached through `Hook::tc`, which the compiler resolves per hook.

use aya_ebpf::{
    EbpfContext,
    programs::{TcContext, XdpContext},
};

/// tcx: run the next program in the chain, then the interface's legacy tc
/// filters; from the last of them, a pass. Every packet tc passes goes on
/// so, translated or not, where `TC_ACT_OK` would end the interface's tc
/// processing: other programs on the same interfaces, a CNI's or an
/// operator's (the `bandwidth` plugin's egress limit, a policer, a
/// mirror), see what they would see without the agent, as kube-proxy
/// never stood between them (docs/architecture.md, "Where programs
/// attach").
pub const TCX_NEXT: i32 = -1;

/// A hook the per-packet pipeline runs at.
pub trait Hook: EbpfContext {
    /// True at XDP: no socket buffer, so every packet write is direct, and
    /// whatever the fast path does not finish is left to tc.
    const XDP: bool;

    /// Start and end of the packet bytes reachable by pointer.
    fn bounds(&self) -> (usize, usize);

    /// Length of the whole packet, linear or not.
    fn wire_len(&self) -> usize;

    /// The payload bytes of each segment of a GSO or GRO packet (tc); 0
    /// for a packet that is one segment, and at XDP.
    fn gso_size(&self) -> u32;

    /// Makes the first `len` bytes reachable by pointer (tc packets may
    /// keep headers in fragments). False when that is impossible.
    fn pull(&self, len: u32) -> bool;

    fn ingress_ifindex(&self) -> u32;

    /// The socket buffer's context at tc, for what only tc can do; None at
    /// XDP. Known per hook at compile time: code that asks holds no branch.
    fn tc(&self) -> Option<&TcContext>;

    /// The packet's context at XDP, for what only XDP does (moving the
    /// packet's head); None at tc. Known per hook at compile time, as `tc`.
    fn xdp(&self) -> Option<&XdpContext>;
}

impl Hook for TcContext {
    const XDP: bool = false;

    #[inline(always)]
    fn bounds(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    #[inline(always)]
    fn wire_len(&self) -> usize {
        self.len() as usize
    }

    #[inline(always)]
    fn gso_size(&self) -> u32 {
        // SAFETY: `skb` is the context the kernel passed this program, valid for its run.
        unsafe { (*self.skb.skb).gso_size }
    }

    #[inline(always)]
    fn pull(&self, len: u32) -> bool {
        let len = if len > self.len() { self.len() } else { len };
        self.pull_data(len).is_ok()
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: `skb` is the context the kernel passed this program, valid for its run.
        unsafe { (*self.skb.skb).ingress_ifindex }
    }

    #[inline(always)]
    fn tc(&self) -> Option<&TcContext> {
        Some(self)
    }

    #[inline(always)]
    fn xdp(&self) -> Option<&XdpContext> {
        None
    }
}

impl Hook for XdpContext {
    const XDP: bool = true;

    #[inline(always)]
    fn bounds(&self) -> (usize, usize) {
        (self.data(), self.data_end())
    }

    #[inline(always)]
    fn wire_len(&self) -> usize {
        self.data_end() - self.data()
    }

    #[inline(always)]
    fn gso_size(&self) -> u32 {
        0
    }

    #[inline(always)]
    fn pull(&self, _len: u32) -> bool {
        false
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        XdpContext::ingress_ifindex(self) as u32
    }

    #[inline(always)]
    fn tc(&self) -> Option<&TcContext> {
        None
    }

    #[inline(always)]
    fn xdp(&self) -> Option<&XdpContext> {
        Some(self)
    }
}
