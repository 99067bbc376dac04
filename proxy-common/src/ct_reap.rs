//! The frame the agent's reaper hands `ct_reap` (a program never attached,
//! run through `BPF_PROG_TEST_RUN`): a [`Header`], then up to [`MAX_KEYS`]
//! keys of one conntrack map that user space read as expired. The program
//! looks each up again and removes it only if it is still expired, so that
//! a new flow that took an expired entry's tuple since the read keeps its
//! entry (docs/architecture.md, "Conntrack's reaper").

/// `Header::map`: which map the keys are of (and so their size: 16 bytes
/// for IPv4's, 40 for IPv6's).
pub mod map {
    pub const CONNTRACK: u32 = 0;
    pub const CT_NEW: u32 = 1;
    pub const CONNTRACK6: u32 = 2;
    pub const CT_NEW6: u32 = 3;
}

/// Keys one frame carries at most: 64 IPv6 keys and the header are 2,584
/// bytes, within the 3,520 of packet data an XDP test run takes on a
/// kernel of 4 KiB pages (a page less XDP's headroom and the shared info's
/// tailroom).
pub const MAX_KEYS: u32 = 64;

/// The frame's first bytes; the keys follow at once.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Header {
    /// The reaper's clock (`CLOCK_MONOTONIC`, as the datapath's): an
    /// entry is expired if it was when the reaper read it. An entry a new
    /// flow took since holds that flow's first packet's time, later.
    pub now_ns: u64,
    /// One of [`map`].
    pub map: u32,
    /// Keys that follow (at most [`MAX_KEYS`]).
    pub keys: u32,
    /// Written by the program: of those keys, the entries it removed.
    pub removed: u32,
    pub _pad: u32,
}

/// Bytes before the first key.
pub const HEADER_LEN: usize = size_of::<Header>();
const _: () = assert!(HEADER_LEN == 24);
