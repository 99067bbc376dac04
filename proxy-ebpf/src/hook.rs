//! What differs between the hooks the pipeline runs at: how packet bytes
//! are reached and written, and how a packet is sent on. Everything else
//! (parsing, lookups, conntrack, NAT decisions) is shared.

use aya_ebpf::{
    EbpfContext,
    programs::{TcContext, XdpContext},
};

use crate::{
    checksum, icmp_error,
    nat::{self, Nat},
    packet::Flow,
    pipeline::Action,
};

/// A hook the per-packet pipeline runs at.
pub trait Hook: EbpfContext {
    /// True at XDP: no socket buffer, so every packet write is direct, and
    /// whatever the fast path does not finish is left to tc.
    const XDP: bool;

    /// Start and end of the packet bytes reachable by pointer.
    fn bounds(&self) -> (usize, usize);

    /// Length of the whole packet, linear or not.
    fn wire_len(&self) -> usize;

    /// Makes the first `len` bytes reachable by pointer (tc packets may
    /// keep headers in fragments). False when that is impossible.
    fn pull(&self, len: u32) -> bool;

    /// Writes the translation `nat` over `flow`'s addresses and ports, with
    /// checksums kept valid.
    fn rewrite(&self, flow: &Flow, nat: &Nat) -> Result<(), ()>;

    fn ingress_ifindex(&self) -> u32;

    /// An ICMP packet: translated if it is an error about a translated flow
    /// (`crate::icmp_error`).
    fn icmp_error(&self) -> Action;
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
    fn pull(&self, len: u32) -> bool {
        let len = if len > self.len() { self.len() } else { len };
        self.pull_data(len).is_ok()
    }

    #[inline(always)]
    fn rewrite(&self, flow: &Flow, nat: &Nat) -> Result<(), ()> {
        nat::rewrite_skb(self, flow, nat).map_err(|_| ())
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        // SAFETY: `skb` is the context the kernel passed this program, valid for its run.
        unsafe { (*self.skb.skb).ingress_ifindex }
    }

    #[inline(always)]
    fn icmp_error(&self) -> Action {
        icmp_error::handle(self)
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
    fn pull(&self, _len: u32) -> bool {
        false
    }

    #[inline(always)]
    fn rewrite(&self, flow: &Flow, nat: &Nat) -> Result<(), ()> {
        checksum::rewrite_direct(
            self.data(),
            self.data_end(),
            flow,
            nat,
            checksum::L4Csum::Full,
        )
        .map(|_| ())
    }

    #[inline(always)]
    fn ingress_ifindex(&self) -> u32 {
        XdpContext::ingress_ifindex(self) as u32
    }

    /// Left to tc, which runs on the same interface and can route what it
    /// rewrites.
    #[inline(always)]
    fn icmp_error(&self) -> Action {
        Action::Pass
    }
}
