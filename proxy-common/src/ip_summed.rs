//! Reading a socket buffer's checksum state (`skb->ip_summed`) from a tc
//! program: the contract between the instruction sequence the kernel programs
//! carry and the agent, which completes it at load time.
//!
//! `__sk_buff` does not expose the field. The kernel's `bpf_cast_to_kern_ctx`
//! kfunc gives the `struct sk_buff` behind it (the verifier turns the call into
//! a register move), but a kfunc call names the function by its BTF id in the
//! running kernel, and the field is a bitfield whose place depends on the
//! kernel's build. So the programs carry this sequence with placeholders:
//!
//! ```text
//! 0  call CALL_MAGIC              ; r0 = bpf_cast_to_kern_ctx(r1)
//! 1  if r0 == 0 goto +4
//! 2  r0 = *(u8 *)(r0 + 0)         ; the byte holding ip_summed
//! 3  r0 >>= 0                     ; its bit within that byte
//! 4  r0 &= 3
//! 5  goto +1
//! 6  r0 = UNKNOWN
//! ```
//!
//! and the agent, reading the kernel's BTF, writes the kfunc's id into 0 and
//! the field's place into 2 and 3, or, when the kernel lacks either, turns 0
//! into `r0 = 0`, so that the sequence yields `UNKNOWN` and the programs keep
//! the checksum helper. The magic is a helper number no kernel has: an
//! unpatched object fails to load rather than misread anything.

/// Placeholder helper number of instruction 0.
pub const CALL_MAGIC: i32 = 0x0e5b_c5a1;
/// Instructions in the sequence.
pub const LEN: usize = 7;
/// Index of the byte load whose offset the agent sets.
pub const LOAD_AT: usize = 2;
/// Index of the shift whose amount the agent sets.
pub const SHIFT_AT: usize = 3;

/// The values of `skb->ip_summed` (include/linux/skbuff.h), and what the
/// sequence yields when it cannot read it.
pub const CHECKSUM_NONE: u64 = 0;
pub const CHECKSUM_UNNECESSARY: u64 = 1;
pub const CHECKSUM_COMPLETE: u64 = 2;
pub const CHECKSUM_PARTIAL: u64 = 3;
pub const UNKNOWN: u64 = 4;

/// Slots of the `CSUM_STATES` per-CPU array, which counts packets tc
/// translated by the state it read (the values above), and their names
/// among the datapath's counters.
pub const STATES: u32 = 5;
pub const STATE_NAMES: [&str; STATES as usize] = [
    "tc_csum_none",
    "tc_csum_unnecessary",
    "tc_csum_complete",
    "tc_csum_partial",
    "tc_csum_unknown",
];
