//! Asking the kernel's conntrack whether netfilter translates a flow: the
//! contract between the instruction sequence the packet programs carry and
//! the agent, which completes it at load time.
//!
//! Where kube-proxy ran before this datapath, netfilter's conntrack holds
//! the flows it translated, and netfilter goes on translating them from
//! those entries without any rule. A packet to a frontend that this
//! datapath has no flow for, and that does not start one (a TCP segment
//! other than a SYN without ACK, or any UDP datagram), is such a flow's
//! when netfilter has an entry for its tuple: the datapath then leaves it
//! to the stack untouched (counter `netfilter_pass` at tc; XDP, which asks
//! too, leaves it to tc), where picking a backend afresh would break the
//! connection (docs/operations.md, "Taking over from kube-proxy"). The
//! programs ask for this while kube-proxy's flows may live
//! (`node_config_flags::NETFILTER_FLOWS`), and always for a frontend on the
//! node's own address, which the answer to a flow netfilter masqueraded to
//! one of its ports reaches.
//!
//! The kernel's `bpf_skb_ct_lookup` and `bpf_ct_release` kfuncs answer,
//! named by their BTF ids in the running kernel, so the programs carry this
//! sequence with placeholders:
//!
//! ```text
//! 0  call LOOKUP_MAGIC        ; r0 = bpf_skb_ct_lookup(r1 skb, r2 tuple, r3 its size, r4 opts, r5 its size)
//! 1  if r0 == 0 goto +3
//! 2  r1 = r0
//! 3  call RELEASE_MAGIC       ; bpf_ct_release(r1)
//! 4  r0 = 1
//! ```
//!
//! XDP's programs carry the same sequence with `XDP_LOOKUP_MAGIC` at 0,
//! for `bpf_xdp_ct_lookup`, which takes an `xdp_md` and otherwise the same
//! arguments. The agent writes the kfuncs' ids into 0 and 3, or, where the
//! kernel lacks them, turns both into `r0 = 0`: the sequence then always
//! answers "not netfilter's", as a datapath without this check did. The
//! magics are helper numbers no kernel has: an unpatched object fails to
//! load.

/// Placeholder helper number of instruction 0.
pub const LOOKUP_MAGIC: i32 = 0x0e5b_c5a2;
/// Placeholder helper number of instruction 3.
pub const RELEASE_MAGIC: i32 = 0x0e5b_c5a3;
/// Placeholder helper number of instruction 0 in XDP's programs, whose
/// lookup kfunc takes an `xdp_md` (`XDP_LOOKUP_KFUNC`).
pub const XDP_LOOKUP_MAGIC: i32 = 0x0e5b_c5a4;
/// Instructions in the sequence.
pub const LEN: usize = 5;
/// Index of the release call.
pub const RELEASE_AT: usize = 3;

/// The kfuncs, as the kernel's BTF names them.
pub const LOOKUP_KFUNC: &str = "bpf_skb_ct_lookup";
pub const XDP_LOOKUP_KFUNC: &str = "bpf_xdp_ct_lookup";
pub const RELEASE_KFUNC: &str = "bpf_ct_release";

/// `sizeof(bpf_sock_tuple.ipv4)` and `.ipv6`: the tuple sizes the lookup
/// takes.
pub const TUPLE_V4_SIZE: u32 = 12;
pub const TUPLE_V6_SIZE: u32 = 36;
/// The size of `struct bpf_ct_opts` every kernel with the kfunc takes (a
/// later one grew it to 16 with zone fields, and still takes 12).
pub const OPTS_SIZE: u32 = 12;
/// `bpf_ct_opts.netns_id` for the packet's own network namespace
/// (`BPF_F_CURRENT_NETNS`).
pub const CURRENT_NETNS: i32 = -1;
