//! Every map of the datapath. Declared with `#[btf_map]` so the object
//! carries key and value types and `bpftool map dump` prints field names.

use aya_ebpf::{
    bindings::bpf_fib_lookup,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, ProgramArray, SkStorage},
    macros::btf_map,
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, Clock, ClusterCidrKey,
    Ct6Key, CtKeyOf, CtTimeouts, CtValueOf, DEFAULT_SERVICE_COUNTERS, FLOW_CACHE_SLOTS,
    FlowCacheEntryOf, FragKey, FragValue, MAP_F_MMAPABLE, MAP_F_NO_PREALLOC, MAX_AFFINITY,
    MAX_BACKEND_SLOTS, MAX_BACKENDS, MAX_CLUSTER_CIDRS, MAX_CONNTRACK, MAX_CT_SOURCES,
    MAX_FRAGMENTS, MAX_LOCAL_IFACES, MAX_NODE_ADDRS, MAX_POD_IFACES, MAX_REFUSALS,
    MAX_SERVICE_CIDRS, MAX_SERVICES, MAX_SOURCE_RANGES, NodeAddr, NodeAddrKey, NodeConfig,
    RefusalKey, RefusalRecord, RejectLimit, ServiceCounters, ServiceKey, ServiceName, ServiceValue,
    SockNotes, SockNotes6, SourceRangeKey, WireView, clock_slot, counter, ip_summed, prefilter,
    sock_counter,
};

#[btf_map]
pub static SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { MAX_SERVICES as usize },
    MAP_F_NO_PREALLOC,
> = HashMap::new();

/// Service id to the Service port it stands for, for `ebpf-proxy status`;
/// written by the agent, read by no program. A service id is held by at
/// least one `SERVICES` entry, so there are never more ids than frontends.
#[btf_map]
pub static SERVICE_NAMES: HashMap<u32, ServiceName, { MAX_SERVICES as usize }, MAP_F_NO_PREALLOC> =
    HashMap::new();

/// What the agent refused of each Service, for `ebpf-proxy status`;
/// written by the agent, read by no program.
#[btf_map]
pub static SERVICE_REFUSALS: HashMap<
    RefusalKey,
    RefusalRecord,
    { MAX_REFUSALS as usize },
    MAP_F_NO_PREALLOC,
> = HashMap::new();

/// Carries `WireView`'s types into the object's BTF, for the agent's
/// retyping of fields for bpftool (`proxy_common::WireView`). Never pinned;
/// no program reads it.
#[btf_map]
pub static WIRE_VIEW: Array<WireView, 1> = Array::new();

/// Each Service port's counters, at its service id (see
/// `crate::service_counters`). Sized by the agent at load
/// (`--service-counters`), which then pins it in place of the last
/// agent's.
#[btf_map]
pub static SERVICE_COUNTERS: PerCpuArray<ServiceCounters, { DEFAULT_SERVICE_COUNTERS as usize }> =
    PerCpuArray::new();

#[btf_map]
pub static BACKEND_SLOTS: HashMap<
    BackendSlotKey,
    BackendSlot,
    { MAX_BACKEND_SLOTS as usize },
    MAP_F_NO_PREALLOC,
> = HashMap::new();

#[btf_map]
pub static BACKENDS: HashMap<u32, Backend, { MAX_BACKENDS as usize }, MAP_F_NO_PREALLOC> =
    HashMap::new();

/// The prefilter's bits (`crate::prefilter`), written by the agent through
/// its own mapping of the array.
#[btf_map]
pub static PREFILTER: Array<u64, { prefilter::WORDS as usize }, MAP_F_MMAPABLE> = Array::new();

/// The prefilter's marks of flows' reply keys (`crate::prefilter`): set by
/// the datapath as it inserts flows, cleared by the agent through its own
/// mapping of the array.
#[btf_map]
pub static PREFILTER_FLOWS: Array<u64, { prefilter::flows::WORDS as usize }, MAP_F_MMAPABLE> =
    Array::new();

/// A conntrack map of either family (see `crate::conntrack`).
pub type Conntrack<A> = LruHashMap<CtKeyOf<A>, CtValueOf<A>, { MAX_CONNTRACK as usize }>;

/// Assured flows. The agent sets its size (`--conntrack-max`).
#[btf_map]
pub static CONNTRACK: Conntrack<u32> = LruHashMap::new();

/// Flows not assured yet; the agent sizes it at `MAX_CT_NEW`.
#[btf_map]
pub static CT_NEW: Conntrack<u32> = LruHashMap::new();

/// Assured IPv6 flows. The agent sets its size (`--conntrack-max`).
#[btf_map]
pub static CONNTRACK6: Conntrack<[u32; 4]> = LruHashMap::new();

/// IPv6 flows not assured yet; the agent sizes it at `MAX_CT_NEW`.
#[btf_map]
pub static CT_NEW6: Conntrack<[u32; 4]> = LruHashMap::new();

/// Assured flows per client address of a family (`NodeConfig::
/// ct_source_share`): the datapath adds one at each flow it assures, the
/// agent's reaper recounts from the conntrack map it reaps.
pub type CtSources<A> = LruHashMap<A, u32, { MAX_CT_SOURCES as usize }>;

#[btf_map]
pub static CT_SOURCES: CtSources<u32> = LruHashMap::new();

#[btf_map]
pub static CT_SOURCES6: CtSources<[u32; 4]> = LruHashMap::new();

/// The node's budget of rejects, and its bucket (see
/// `proxy_common::RejectLimit`). Never pinned: the agent writes it at load.
#[btf_map]
pub static REJECT_LIMIT: Array<RejectLimit, 1> = Array::new();

/// The programs `xdp_ingress` hands frames on to by a tail call: at
/// `proxy_common::XDP_NEXT_IPV6`, `xdp_ingress6`. Filled by the agent at
/// load, never pinned: the kernel empties a program array when its last
/// holder other than programs (the agent's descriptor) goes, and IPv6 is
/// then left to tc until the next agent's programs take over.
#[btf_map]
pub static XDP_NEXT: ProgramArray<1> = ProgramArray::new();

/// The programs tc hands frames on to by a tail call: at
/// `proxy_common::TC_NEXT_IPV6`, `tc_ingress6`, for `tc_ingress`; at
/// `TC_NEXT_NEW6`, `tc_new6`, for `tc_ingress6`. Filled by the agent at
/// load and pinned (docs/architecture.md, "IPv6"): with a slot empty, the
/// frame goes on untranslated.
#[btf_map]
pub static TC_NEXT: ProgramArray<2> = ProgramArray::new();

/// Direct server return's packets from other nodes, at tc: slot
/// `proxy_common::TC_DSR_IPV4`, `tc_dsr`; `TC_DSR_IPV6`, `tc_dsr6`. Filled by
/// the agent at load, never pinned, as `XDP_NEXT`: with a slot empty, such
/// packets pass untranslated, as if no node sent by direct server return.
#[btf_map]
pub static TC_DSR: ProgramArray<2> = ProgramArray::new();

/// Room for the largest temporaries of conntrack's writes (see `Scratch`),
/// one map per family. Never pinned: they hold nothing from one packet to
/// the next.
#[btf_map]
pub static SCRATCH: PerCpuArray<Scratch<u32>, 1> = PerCpuArray::new();

/// `SCRATCH` of IPv6 flows.
#[btf_map]
pub static SCRATCH6: PerCpuArray<Scratch<[u32; 4]>, 1> = PerCpuArray::new();

/// What `SCRATCH` and `SCRATCH6` hold: the conntrack entry and keys a
/// flow's entries are created with, a SNATed flow's port claimed with and a
/// flow assured with (`crate::conntrack`). On the program's stack they would
/// take IPv6's past the 512 bytes it may use (and most of what IPv4's has
/// left); on this CPU's entry of a per-CPU map they are the packet's alone,
/// as tc and XDP run one program at a time on a CPU.
#[repr(C)]
pub struct Scratch<A> {
    pub key: CtKeyOf<A>,
    pub other_key: CtKeyOf<A>,
    pub value: CtValueOf<A>,
    /// A new flow's forward entry, at `other_key`, beside its reply entry
    /// in `value` (`conntrack::create`).
    pub other_value: CtValueOf<A>,
    /// The key of the closed flow of `CONNTRACK` that the last SYN to open
    /// a tuple again ended there (both its entries voided): the room its
    /// new flow starts in (`conntrack::create`), taken once (its protocol
    /// then 0). Also where `conntrack::reopen` hands that key to its
    /// out-of-line part.
    pub room_key: CtKeyOf<A>,
    /// The key of that closed flow's reply entry, voided beside its forward
    /// entry: the new flow's reply entry is written over it in place when
    /// it has the same key (the same backend picked again), else it is
    /// removed as the new one goes in (`conntrack::insert_pair`).
    pub room_reply_key: CtKeyOf<A>,
}

/// The route of the packet being handled, both families (see `crate::route`):
/// from its lookup, made before the packet is written, to its send. Never
/// pinned: it holds nothing from one packet to the next.
#[btf_map]
pub static ROUTE: PerCpuArray<Route, 1> = PerCpuArray::new();

/// What `ROUTE` holds: the FIB query and its answer (egress interface,
/// MACs), and whether the next hop's MACs were known (1) or are left to
/// the kernel to resolve (0). Aligned to 8 and a whole number of words, so
/// that `route::lookup` clears it a word at a time.
#[repr(C, align(8))]
pub struct Route {
    pub fib: bpf_fib_lookup,
    pub resolved: u32,
    pub _pad: u32,
}

const _: () = assert!(size_of::<Route>().is_multiple_of(8));

/// The conntrack key of the packet `tc_ingress6` is handling, built here
/// rather than on its stack (40 bytes the call chain has no room for), for
/// the whole run of the program: a map of its own, as `SCRATCH6`'s entry is
/// borrowed whole by the functions that build entries. Never pinned.
#[btf_map]
pub static FLOW_KEY6: PerCpuArray<Ct6Key, 1> = PerCpuArray::new();

/// The flow cache of either family (see `proxy_common::FlowCacheEntryOf`).
pub type FlowCache<A> = PerCpuArray<FlowCacheEntryOf<A>, { FLOW_CACHE_SLOTS as usize }>;

/// See `proxy_common::FlowCacheEntry`.
#[btf_map]
pub static FLOW_CACHE: FlowCache<u32> = PerCpuArray::new();

/// See `proxy_common::FlowCache6Entry`.
#[btf_map]
pub static FLOW_CACHE6: FlowCache<[u32; 4]> = PerCpuArray::new();

/// Invalidation counters of `FLOW_CACHE` and `FLOW_CACHE6`: one per cache
/// slot, then the agent's epoch.
#[btf_map]
pub static FLOW_GEN: Array<u64, { FLOW_CACHE_SLOTS as usize + 1 }> = Array::new();

#[btf_map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue, { MAX_AFFINITY as usize }> =
    LruHashMap::new();

#[btf_map]
pub static CT_TIMEOUTS: Array<CtTimeouts, 1> = Array::new();

/// Whether `entry`, a flow of `proto`, has been idle past its timeout at
/// `now`, under the conntrack timeouts in force (the defaults until the
/// agent sets them). They are read in place, not copied: a copy is 48
/// bytes of a stack that `tc_ingress6` and the SNAT port's try, which
/// shares its frame's budget, have little of.
#[inline(always)]
pub fn expired<A>(entry: &CtValueOf<A>, proto: u8, now: u64) -> bool {
    let timeouts = match CT_TIMEOUTS.get_ptr(0) {
        // SAFETY: a pointer the map lookup returned, valid for this
        // program's run.
        Some(p) if unsafe { (*p).udp_ns } != 0 => unsafe { &*p },
        _ => &CtTimeouts::DEFAULT,
    };
    entry.expired(proto, now, timeouts)
}

#[btf_map]
pub static CLOCK: Array<Clock, { clock_slot::COUNT as usize }> = Array::new();

#[btf_map]
pub static NODE_ADDRS: HashMap<NodeAddrKey, NodeAddr, { MAX_NODE_ADDRS as usize }> = HashMap::new();

#[btf_map]
pub static NODE_CONFIG: Array<NodeConfig, 1> = Array::new();

/// The node settings in force (zeros until the agent writes them).
#[inline(always)]
pub fn node_config() -> NodeConfig {
    NODE_CONFIG
        .get_ptr(0)
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        .map_or(NodeConfig::default(), |p| unsafe { *p })
}

/// `NodeConfig::ct_source_share` alone (both families read `NODE_CONFIG`'s).
#[inline(always)]
pub fn ct_source_share() -> u32 {
    NODE_CONFIG
        .get_ptr(0)
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        .map_or(0, |p| unsafe { (*p).ct_source_share })
}

/// `NodeConfig::flags` alone, where a path needs nothing else of it.
#[inline(always)]
pub fn node_flags() -> u32 {
    NODE_CONFIG
        .get_ptr(0)
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        .map_or(0, |p| unsafe { (*p).flags })
}

/// The node's IPv6 settings: `snat_addr_be` is its IPv6 address, the
/// client the socket hooks' IPv6 connections are made as and the source
/// `tc_ingress6` SNATs to (zeros until the node has one). The rest of the
/// entry is unused: SNAT ports come from `NODE_CONFIG`'s range, one range
/// for both families.
#[btf_map]
pub static NODE_CONFIG6: Array<NodeConfig, 1> = Array::new();

/// The node's IPv6 address (all zeros while it has none).
#[inline(always)]
pub fn node_addr6() -> [u32; 4] {
    NODE_CONFIG6
        .get_ptr(0)
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        .map_or([0; 4], |p| unsafe { (*p).snat_addr_be })
}

/// `NodeConfig::flags` of `NODE_CONFIG6`: IPv6's own settings.
#[inline(always)]
pub fn node_flags6() -> u32 {
    NODE_CONFIG6
        .get_ptr(0)
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        .map_or(0, |p| unsafe { (*p).flags })
}

/// Interfaces whose packets come from this node's pods (kube-proxy's
/// interface local traffic detectors): ifindex to 1.
#[btf_map]
pub static LOCAL_IFACES: HashMap<u32, u32, { MAX_LOCAL_IFACES as usize }> = HashMap::new();

/// The host-side interfaces of this node's pods, whose peer is the pod's
/// own interface: where a translated packet may be sent straight into the
/// pod (`route::to_pod`). Ifindex to 1.
#[btf_map]
pub static POD_IFACES: HashMap<u32, u32, { MAX_POD_IFACES as usize }> = HashMap::new();

/// `map_names::SHAPED_IFACES`: pods' host-side veths whose qdiscs and
/// legacy tc filters the stack's path must keep.
#[btf_map]
pub static SHAPED_IFACES: HashMap<u32, u32, { MAX_POD_IFACES as usize }> = HashMap::new();

#[btf_map]
pub static SOURCE_RANGES: LpmTrie<SourceRangeKey, u32, { MAX_SOURCE_RANGES as usize }> =
    LpmTrie::new();

#[btf_map]
pub static CLUSTER_CIDRS: LpmTrie<ClusterCidrKey, u32, { MAX_CLUSTER_CIDRS as usize }> =
    LpmTrie::new();

/// The service CIDRs and the ClusterIPs in them (`crate::service_cidr`).
#[btf_map]
pub static SERVICE_CIDRS: LpmTrie<ClusterCidrKey, u32, { MAX_SERVICE_CIDRS as usize }> =
    LpmTrie::new();

/// The datapath log's level (see `crate::event_log`); off until the agent
/// writes it.
#[btf_map]
pub static DATAPATH_LOG: Array<u32, 1> = Array::new();

#[btf_map]
pub static COUNTERS: PerCpuArray<u64, { counter::SLOTS as usize }> = PerCpuArray::new();

/// Packets tc translated, by the checksum state it read
/// (`proxy_common::ip_summed::STATE_NAMES`). A map of its own rather than
/// more `COUNTERS` slots, whose size is part of the pinned layout.
#[btf_map]
pub static CSUM_STATES: PerCpuArray<u64, { ip_summed::STATES as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count_csum_state(state: u64) {
    bump(&CSUM_STATES, state as u32);
}

/// The network namespace cookie of the agent's namespace, the node's: the
/// socket hook translates only sockets there (0 until the agent writes it).
#[btf_map]
pub static HOST_NETNS: Array<u64, 1> = Array::new();

/// See `proxy_common::sock_counter`.
#[btf_map]
pub static SOCK_COUNTERS: PerCpuArray<u64, { sock_counter::COUNT as usize }> = PerCpuArray::new();

/// See `proxy_common::SockNotes`: socket-local storage, freed by the
/// kernel with its socket.
#[btf_map]
pub static SOCK_NOTES: SkStorage<SockNotes> = SkStorage::new();

/// See `proxy_common::SockNotes6`: the notes of IPv6 sockets sent to IPv6
/// backends.
#[btf_map]
pub static SOCK_NOTES6: SkStorage<SockNotes6> = SkStorage::new();

/// See `crate::frag`.
#[btf_map]
pub static FRAGMENTS: LruHashMap<FragKey, FragValue, { MAX_FRAGMENTS as usize }> =
    LruHashMap::new();

#[inline(always)]
pub fn count_sock(index: u32) {
    bump(&SOCK_COUNTERS, index);
}

#[inline(always)]
pub fn count(index: u32) {
    bump(&COUNTERS, index);
}

/// Adds one to slot `index` of a per-CPU counter array.
#[inline(always)]
fn bump<const N: usize>(counters: &PerCpuArray<u64, N>, index: u32) {
    if let Some(c) = counters.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no other writer while this program runs here.
        unsafe { *c += 1 };
    }
}
