//! Packets to the service CIDRs that no frontend answers, as kube-proxy's
//! nftables mode treats them (its `cluster-ips-check` chain): to a
//! ClusterIP on a port its Service does not define, rejected; to an address
//! no Service holds, dropped. Everything else passes as before.
//!
//! Asked where a packet leaves the pipeline as for no Service: after the
//! prefilter's no, and after a frontend lookup that missed. The prefilter's
//! block bits (`proxy_common::prefilter::block_bit`) keep the trie lookup
//! off every other packet: only one to a block of 256 addresses that a
//! service CIDR or a ClusterIP is in, or any IPv6 packet while a service
//! CIDR is too wide for its blocks' bits (`WIDE_BIT`), asks
//! `SERVICE_CIDRS`.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, maps::lpm_trie::Key};
use proxy_common::{
    ClusterCidrKey, FlowAddr, counter,
    prefilter::{WIDE_BIT, block_bit},
    service_cidr,
};

use crate::{
    maps::{SERVICE_CIDRS, count},
    packet::FlowOf,
    prefilter::{self, Block},
};

/// Room for the trie's key (`SERVICE_CIDRS`), one per CPU.
#[btf_map]
static CIDR_KEY: PerCpuArray<Key<ClusterCidrKey>, 1> = PerCpuArray::new();

/// What becomes of a packet no frontend answers.
pub enum Unserved {
    /// Not for a service CIDR: on to the node's routes.
    Pass,
    /// For an address of a service CIDR that no Service holds; counted.
    Drop,
    /// For a ClusterIP on a port its Service does not define; counted by
    /// tc, which sends the reject (XDP leaves it to tc).
    Reject,
}

/// What becomes of `flow`'s packet, which no frontend answers; `block`,
/// what the prefilter read of its destination's block; `xdp` when XDP
/// asks, which leaves rejects to tc, to be counted there.
#[inline(always)]
pub fn unserved<A: FlowAddr>(flow: &FlowOf<A>, block: Block, xdp: bool) -> Unserved {
    let dst = flow.dst_be.mapped();
    let in_block = match block {
        Block::Cidr => true,
        Block::NoCidr => false,
        Block::Unread => prefilter::holds(block_bit(&dst)),
    };
    // The agent sets every IPv4 block's bit, however wide the range
    // (`WIDE_BIT` is for IPv6's alone): an IPv4 packet reads no more.
    if !in_block && (size_of::<A>() == size_of::<u32>() || !prefilter::holds(WIDE_BIT)) {
        return Unserved::Pass;
    }
    // The trie's key is built in this CPU's slot of `CIDR_KEY`, not on the
    // stack, where `tc_ingress6` has little room left.
    let Some(key) = CIDR_KEY.get_ptr_mut(0) else {
        return Unserved::Pass;
    };
    // SAFETY: this CPU's slot, used by nothing else while this program
    // runs (tc and XDP run one program at a time on a CPU).
    let key = unsafe {
        *key = Key::new(128, ClusterCidrKey { addr_be: dst });
        &*key
    };
    match SERVICE_CIDRS.get(key) {
        Some(&service_cidr::HELD) => {
            if !xdp {
                count(counter::REJECT_UNDEFINED_PORT);
            }
            Unserved::Reject
        }
        Some(&service_cidr::RANGE) => {
            count(counter::DROP_UNALLOCATED);
            Unserved::Drop
        }
        _ => Unserved::Pass,
    }
}
