//! Every type the kernel programs and the agent share.
//!
//! Rules for anything in here: `#[repr(C)]`, explicit padding so that the
//! compiler never inserts any (bytemuck's `Pod` derive refuses implicit
//! padding), byte order stated in the field name (`_be` = network order,
//! stored exactly as it appears on the wire), and no `bool`, `Option` or enum
//! inside a map key or value.
#![cfg_attr(not(test), no_std)]

pub mod csum;
pub mod ct_reap;
pub mod dsr;
pub mod ip_summed;
pub mod maglev;
pub mod netfilter_ct;
pub mod prefilter;
pub mod sctp;
pub mod trace;

pub use trace::TraceRecord;

/// Layout version of every pinned map. It is part of the pin path
/// (`<bpf-root>/v<N>/…`) because aya reuses an existing pin without checking
/// its layout: bump it whenever a key or value below changes.
pub const LAYOUT_VERSION: u32 = 5;

/// Map names, as they appear in the object file and under the pin directory.
pub mod map_names {
    pub const SERVICES: &str = "SERVICES";
    pub const BACKEND_SLOTS: &str = "BACKEND_SLOTS";
    pub const BACKENDS: &str = "BACKENDS";
    pub const CONNTRACK: &str = "CONNTRACK";
    pub const AFFINITY: &str = "AFFINITY";
    pub const COUNTERS: &str = "COUNTERS";
    pub const CT_TIMEOUTS: &str = "CT_TIMEOUTS";
    pub const NODE_ADDRS: &str = "NODE_ADDRS";
    pub const NODE_CONFIG: &str = "NODE_CONFIG";
    /// `NODE_CONFIG` for IPv6: the node's IPv6 address (`NodeConfig`).
    pub const NODE_CONFIG6: &str = "NODE_CONFIG6";
    pub const SOURCE_RANGES: &str = "SOURCE_RANGES";
    pub const CLUSTER_CIDRS: &str = "CLUSTER_CIDRS";
    /// The service CIDRs (`ServiceCIDR` objects, `--service-cluster-ip-range`)
    /// and every ClusterIP held in them (`service_cidr`): what a packet to
    /// an address of a service CIDR that no frontend answers becomes.
    pub const SERVICE_CIDRS: &str = "SERVICE_CIDRS";
    /// The interfaces whose packets come from this node's pods
    /// (`--detect-local-mode BridgeInterface` or `InterfaceNamePrefix`):
    /// ifindex to 1.
    pub const LOCAL_IFACES: &str = "LOCAL_IFACES";
    /// The interfaces a translated packet may be sent through straight into
    /// a pod's namespace (`node_config_flags::HOST_ROUTING_BPF`): the
    /// host-side veths of pods, ifindex to 1.
    pub const POD_IFACES: &str = "POD_IFACES";
    /// The pods' host-side veths that carry a qdisc (the CNI `bandwidth`
    /// plugin's limits, an operator's shaping or filters), ifindex to 1:
    /// left out of `POD_IFACES`, and a packet arriving on one is never
    /// redirected, so that the stack's path through its qdiscs and legacy
    /// tc filters is kept (`node_config_flags::HOST_ROUTING_BPF`).
    pub const SHAPED_IFACES: &str = "SHAPED_IFACES";
    pub const CLOCK: &str = "CLOCK";
    pub const FLOW_CACHE: &str = "FLOW_CACHE";
    pub const FLOW_GEN: &str = "FLOW_GEN";
    pub const CSUM_STATES: &str = "CSUM_STATES";
    pub const HOST_NETNS: &str = "HOST_NETNS";
    pub const SOCK_COUNTERS: &str = "SOCK_COUNTERS";
    pub const SOCK_NOTES: &str = "SOCK_NOTES";
    /// The notes of IPv6 sockets sent to IPv6 backends (`SockNotes6`).
    pub const SOCK_NOTES6: &str = "SOCK_NOTES6";
    pub const FRAGMENTS: &str = "FRAGMENTS";
    pub const CT_NEW: &str = "CT_NEW";
    /// The datapath log's level (see `datapath_log`).
    pub const DATAPATH_LOG: &str = "DATAPATH_LOG";
    /// aya-log's ring buffer of the datapath's log records: pinned, so that
    /// records written while no agent runs reach the next one.
    pub const AYA_LOGS: &str = "AYA_LOGS";
    /// Assured IPv6 flows (see `Ct6Key`).
    pub const CONNTRACK6: &str = "CONNTRACK6";
    /// IPv6 flows not assured yet: `CT_NEW` for IPv6.
    pub const CT_NEW6: &str = "CT_NEW6";
    /// The flow cache of IPv6 flows (`FlowCache6Entry`).
    pub const FLOW_CACHE6: &str = "FLOW_CACHE6";
    /// Assured flows per client address (`CtSourceKey`), what a client's
    /// share of `CONNTRACK` is counted in (`NodeConfig::ct_source_share`).
    pub const CT_SOURCES: &str = "CT_SOURCES";
    /// `CT_SOURCES` of IPv6 clients, in `CONNTRACK6`.
    pub const CT_SOURCES6: &str = "CT_SOURCES6";
    /// The prefilter's bit array (`prefilter`), mapped into the agent's
    /// memory: 64-bit words.
    pub const PREFILTER: &str = "PREFILTER";
    /// The prefilter's marks of flows' reply keys (`prefilter::flows`),
    /// mapped into the agent's memory: 64-bit words of byte slots.
    pub const PREFILTER_FLOWS: &str = "PREFILTER_FLOWS";
    /// The Service port each service id stands for (`ServiceName`): read
    /// by `ebpf-proxy status` only, no program looks at it.
    pub const SERVICE_NAMES: &str = "SERVICE_NAMES";
    /// What the agent refused of each Service (`RefusalRecord`): read by
    /// `ebpf-proxy status` only, no program looks at it.
    pub const SERVICE_REFUSALS: &str = "SERVICE_REFUSALS";
    /// The types `bpftool` prints fields as (`WireView`). Never pinned, so
    /// not in `ALL`; read by nothing.
    pub const WIRE_VIEW: &str = "WIRE_VIEW";
    /// Whether the datapath writes `TRACE_EVENTS`: a deadline, see `trace`.
    pub const TRACE_ON: &str = "TRACE_ON";
    /// The ring buffer of `trace::TraceRecord`s `ebpf-proxy trace` reads.
    pub const TRACE_EVENTS: &str = "TRACE_EVENTS";
    /// The program array `xdp_ingress` tail-calls into (`XDP_NEXT_IPV6`).
    /// Never pinned, so not in `ALL`: each agent fills its own at load.
    pub const XDP_NEXT: &str = "XDP_NEXT";
    /// The program array `tc_ingress` tail-calls into for every frame that
    /// is not IPv4 (`TC_NEXT_IPV6`), and `tc_ingress6` for a new flow
    /// (`TC_NEXT_NEW6`). Not in `ALL`: each agent fills its own at load
    /// and pins it under a name of its own (by the program id of the
    /// `tc_ingress` that reads it).
    pub const TC_NEXT: &str = "TC_NEXT";
    /// The program array `tc_ingress` and `tc_ingress6` tail-call into
    /// for a packet another node sent by direct server return
    /// (`TC_DSR_IPV4`, `TC_DSR_IPV6`). Not in `ALL`, as `TC_NEXT`.
    pub const TC_DSR: &str = "TC_DSR";
    /// The rate limit of rejects (`RejectLimit`). Never pinned, so not in
    /// `ALL`: each agent writes its own at load.
    pub const REJECT_LIMIT: &str = "REJECT_LIMIT";
    /// Each Service port's counters (`ServiceCounters`). Not in `ALL`: each
    /// agent sizes its own at load, and a Service's counters start from
    /// zero with the agent, as its other metrics do; the agent then pins
    /// it in place of the last agent's, for `ebpf-proxy status`.
    pub const SERVICE_COUNTERS: &str = "SERVICE_COUNTERS";
    /// Maps added to this layout after its first agents: pins of such an
    /// agent lack them, and readers of its pins do without.
    pub const LATER: [&str; 22] = [
        CSUM_STATES,
        HOST_NETNS,
        SOCK_COUNTERS,
        SOCK_NOTES,
        SOCK_NOTES6,
        NODE_CONFIG6,
        DATAPATH_LOG,
        AYA_LOGS,
        CONNTRACK6,
        CT_NEW6,
        FLOW_CACHE6,
        LOCAL_IFACES,
        PREFILTER,
        PREFILTER_FLOWS,
        SERVICE_NAMES,
        SERVICE_CIDRS,
        SERVICE_REFUSALS,
        SERVICE_COUNTERS,
        TRACE_ON,
        TRACE_EVENTS,
        POD_IFACES,
        SHAPED_IFACES,
    ];
    /// Maps earlier agents of this layout pinned and this one has no more:
    /// the agent unpins them at load. `SOCK_REVNAT` (an LRU hash keyed by
    /// socket cookie) gave way to `SOCK_NOTES`, which TCP churn cannot evict.
    pub const RETIRED: [&str; 1] = ["SOCK_REVNAT"];
    pub const ALL: [&str; 39] = [
        SERVICES,
        BACKEND_SLOTS,
        BACKENDS,
        CONNTRACK,
        AFFINITY,
        COUNTERS,
        CT_TIMEOUTS,
        NODE_ADDRS,
        NODE_CONFIG,
        SOURCE_RANGES,
        CLUSTER_CIDRS,
        CLOCK,
        FLOW_CACHE,
        FLOW_GEN,
        CSUM_STATES,
        HOST_NETNS,
        SOCK_COUNTERS,
        SOCK_NOTES,
        SOCK_NOTES6,
        NODE_CONFIG6,
        FRAGMENTS,
        CT_NEW,
        DATAPATH_LOG,
        AYA_LOGS,
        CONNTRACK6,
        CT_NEW6,
        FLOW_CACHE6,
        LOCAL_IFACES,
        CT_SOURCES,
        CT_SOURCES6,
        PREFILTER,
        PREFILTER_FLOWS,
        SERVICE_NAMES,
        SERVICE_CIDRS,
        SERVICE_REFUSALS,
        TRACE_ON,
        TRACE_EVENTS,
        POD_IFACES,
        SHAPED_IFACES,
    ];
}

/// The datapath's log of rare events (a reject sent, a drop, a full map),
/// through aya-log: the level the agent writes into `DATAPATH_LOG`, and
/// the rate limit the datapath keeps on each CPU.
pub mod datapath_log {
    /// Nothing is logged: the default, and the value of a map never written.
    pub const OFF: u32 = 0;
    /// aya-log's level numbers, so that a record's level and the map's
    /// compare directly.
    pub const ERROR: u32 = 1;
    pub const WARN: u32 = 2;
    pub const INFO: u32 = 3;
    pub const DEBUG: u32 = 4;
    /// Records each CPU may write in one second (a window of
    /// `WINDOW_NS`); the rest are counted under
    /// `counter::LOG_RATE_LIMITED`.
    pub const PER_CPU_PER_WINDOW: u32 = 20;
    pub const WINDOW_NS: u64 = 1_000_000_000;
}

/// The slot of `program_names::XDP_INGRESS6` in `map_names::XDP_NEXT`.
pub const XDP_NEXT_IPV6: u32 = 0;
/// The slot of `program_names::TC_INGRESS6` in `map_names::TC_NEXT`.
pub const TC_NEXT_IPV6: u32 = 0;
/// The slot of `program_names::TC_NEW6` in `map_names::TC_NEXT`.
pub const TC_NEXT_NEW6: u32 = 1;
/// The slot of `program_names::TC_DSR` in `map_names::TC_DSR`.
pub const TC_DSR_IPV4: u32 = 0;
/// The slot of `program_names::TC_DSR6` in `map_names::TC_DSR`.
pub const TC_DSR_IPV6: u32 = 1;

/// Program names in the object file.
pub mod program_names {
    pub const TC_INGRESS: &str = "tc_ingress";
    /// tc ingress for IPv6: reached by a tail call from `TC_INGRESS` (slot
    /// `TC_NEXT_IPV6` of `map_names::TC_NEXT`) for every frame that is not
    /// IPv4, and attached after `TC_INGRESS` on the same interfaces, which
    /// runs it when that slot is empty (between one agent's exit and the
    /// next one's load).
    pub const TC_INGRESS6: &str = "tc_ingress6";
    /// A tc program that only passes: the floor of per-packet cost
    /// benchmarks on the machine they run on.
    pub const TC_PASS: &str = "tc_pass";
    /// XDP on uplinks: the fast path of north-south traffic. Anything it
    /// does not finish (rejects, unresolved neighbours, fragments) it passes
    /// on untouched to `tc_ingress`, which runs the same logic.
    pub const XDP_INGRESS: &str = "xdp_ingress";
    /// XDP for IPv6: never attached, reached by a tail call from
    /// `XDP_INGRESS` (slot `XDP_NEXT_IPV6` of `map_names::XDP_NEXT`) for
    /// every frame that is not IPv4. What it does not finish it passes on
    /// untouched to `TC_INGRESS6`; with its slot empty, `XDP_INGRESS`
    /// passes IPv6 to tc itself.
    pub const XDP_INGRESS6: &str = "xdp_ingress6";
    /// tc for an IPv4 packet another node sent here by direct server
    /// return (its frontend in an IP option): never attached, reached by a
    /// tail call from `TC_INGRESS` (slot `TC_DSR_IPV4` of
    /// `map_names::TC_DSR`), with a stack and a verifier budget of its own.
    pub const TC_DSR: &str = "tc_dsr";
    /// `TC_DSR` for IPv6 (its frontend in a destination options header),
    /// from `TC_INGRESS6` (slot `TC_DSR_IPV6`).
    pub const TC_DSR6: &str = "tc_dsr6";
    /// The first packet of a new IPv6 flow at tc: never attached, reached
    /// by a tail call from `TC_INGRESS6` (slot `TC_NEXT_NEW6` of
    /// `map_names::TC_NEXT`) once conntrack knows no flow of the packet
    /// and a frontend has it, with a verifier budget of its own:
    /// `TC_INGRESS6` with a new flow's paths inline came within a tenth of
    /// the verifier's limit.
    pub const TC_NEW6: &str = "tc_new6";
    /// The programs every packet (or every packet of a kind) runs: what
    /// the agent's profile samples by default, and what must stay one
    /// function each, within the verifier's limit.
    pub const PACKET: [&str; 7] = [
        TC_INGRESS,
        TC_INGRESS6,
        TC_NEW6,
        XDP_INGRESS,
        XDP_INGRESS6,
        TC_DSR,
        TC_DSR6,
    ];
    /// The XDP floor, as `TC_PASS` is for tc.
    pub const XDP_PASS: &str = "xdp_pass";
    /// Only the conntrack work of a new flow: the packet parsed and the two
    /// entries every new flow makes, nothing else. What benchmarks set the
    /// new-flow case against: no pipeline that keeps an entry per direction
    /// in a kernel hash map can start a flow for less. Never attached.
    pub const TC_CT_PAIR: &str = "tc_ct_pair";
    /// The XDP twin of `TC_CT_PAIR`.
    pub const XDP_CT_PAIR: &str = "xdp_ct_pair";
    /// Samples both kernel clocks into `CLOCK[SAMPLE]`, run by the agent
    /// through `BPF_PROG_TEST_RUN` to calibrate the datapath clock.
    pub const CLOCK_PROBE: &str = "clock_probe";
    /// Removes the conntrack entries the agent's reaper read as expired,
    /// each only if it still is (`ct_reap`). Never attached: run through
    /// `BPF_PROG_TEST_RUN`.
    pub const CT_REAP: &str = "ct_reap";
    /// cgroup `connect4` hook: connections that start on the node itself
    /// (host-network pods, node agents), which never cross tc ingress, get
    /// their frontend replaced by a backend at `connect()`.
    pub const SOCK_CONNECT4: &str = "sock_connect4";
    /// cgroup `sendmsg4` hook: datagrams the node sends to a frontend from
    /// an unconnected UDP socket go to a backend instead.
    pub const SOCK_SENDMSG4: &str = "sock_sendmsg4";
    /// cgroup `recvmsg4` hook: their answers show the frontend as source.
    pub const SOCK_RECVMSG4: &str = "sock_recvmsg4";
    /// cgroup `getpeername4` hook: a socket the `connect()` hook sent to a
    /// backend shows the frontend as its peer, as a DNATed one does.
    pub const SOCK_GETPEERNAME4: &str = "sock_getpeername4";
    /// The IPv6 twins of the four hooks above, for the node's IPv6 sockets.
    /// An IPv4-mapped destination (`::ffff:a.b.c.d`) is the IPv4 frontend
    /// it names, and goes to that frontend's backend, IPv4-mapped.
    pub const SOCK_CONNECT6: &str = "sock_connect6";
    pub const SOCK_SENDMSG6: &str = "sock_sendmsg6";
    pub const SOCK_RECVMSG6: &str = "sock_recvmsg6";
    pub const SOCK_GETPEERNAME6: &str = "sock_getpeername6";
    /// Iterator over the UDP sockets of its reader's network namespace
    /// (`iter/udp`): writes a `SockNotesRecord` for every one holding notes in
    /// `SOCK_NOTES`. The kernel's socket diagnostics report socket-local
    /// storage of TCP sockets only, so this is how the agent reads the notes
    /// of UDP sockets.
    pub const SOCK_NOTES_DUMP: &str = "sock_notes_dump";
    /// `SOCK_NOTES_DUMP` over `SOCK_NOTES6`: a `SockNotes6Record` for every
    /// socket holding notes of IPv6 backends.
    pub const SOCK_NOTES6_DUMP: &str = "sock_notes6_dump";
}

/// Indexes into the per-CPU `SOCK_COUNTERS` array (the socket hooks).
pub mod sock_counter {
    /// A `connect()` to a frontend, sent to a backend instead.
    pub const TRANSLATED: u32 = 0;
    /// A `connect()` to a frontend without endpoints, refused.
    pub const REFUSED: u32 = 1;
    /// A datagram of an unconnected UDP socket to a frontend, sent to a
    /// backend instead.
    pub const SENDMSG_TRANSLATED: u32 = 2;
    pub const COUNT: u32 = 3;
    pub const NAMES: [&str; 3] = [
        "sock_connect_translated",
        "sock_connect_refused",
        "sock_sendmsg_translated",
    ];
}

/// One backend a socket of the node was sent to in a frontend's place by
/// the socket hooks, for its answers (UDP) and its peer (`getpeername()`)
/// to show the frontend, and for the agent to know which connected UDP
/// sockets the hook connected. Of either family's backends (`SockNote`,
/// `SockNote6`); a `backend_be` of zeros is an empty note (no backend has
/// the address 0.0.0.0 or ::).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockNoteOf<A> {
    pub backend_be: A,
    pub frontend_be: A,
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    /// `sock_note` bits: how the hooks sent the socket there.
    pub how: u32,
}

/// A note of an IPv4 backend, in `SOCK_NOTES` (an IPv6 socket sent to an
/// IPv4-mapped backend is noted here too, by the IPv4 address).
pub type SockNote = SockNoteOf<u32>;
/// A note of an IPv6 backend, in `SOCK_NOTES6`, which only the IPv6 hooks
/// keep.
pub type SockNote6 = SockNoteOf<[u32; 4]>;

/// `SockNote::how` bits.
pub mod sock_note {
    /// `connect()`: the socket is connected to the backend.
    pub const CONNECTED: u32 = 1;
    /// `sendmsg()` with an address: a datagram of an unconnected socket.
    pub const SENT: u32 = 2;
}

/// Notes a socket keeps (`SockNotes`). An unconnected UDP socket may send to
/// several backends of several frontends; a connected one needs one note.
pub const SOCK_NOTE_SLOTS: usize = 8;

/// Value of `SOCK_NOTES` and `SOCK_NOTES6`, socket-local storage
/// (`BPF_MAP_TYPE_SK_STORAGE`): the kernel keeps it in the socket itself and
/// frees it with the socket, so no other socket can evict it and nothing
/// outlives its socket. A note sits at its backend's slot
/// (`SockAddr::note_slot`); a later backend hashing to the same slot
/// overwrites it (an unconnected socket talking to more than one backend
/// per slot at once may then see an answer with the backend's address, as
/// it would have without the hooks' rewrite).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockNotesOf<A> {
    pub notes: [SockNoteOf<A>; SOCK_NOTE_SLOTS],
}

/// Notes of IPv4 backends (`SOCK_NOTES`).
pub type SockNotes = SockNotesOf<u32>;
/// Notes of IPv6 backends (`SOCK_NOTES6`).
pub type SockNotes6 = SockNotesOf<[u32; 4]>;

impl<A: SockAddr> SockNotesOf<A> {
    /// The note for backend `backend_be:port_be`, if the socket has one.
    #[inline(always)]
    pub fn find(&self, backend_be: &A, port_be: u16) -> Option<&SockNoteOf<A>> {
        let note = &self.notes[backend_be.note_slot(port_be)];
        (!backend_be.same(&A::default())
            && note.backend_be.same(backend_be)
            && note.backend_port_be == port_be)
            .then_some(note)
    }
}

/// An address a socket note is kept by: where in `SockNotesOf` its note
/// sits.
pub trait SockAddr: FlowAddr {
    /// The slot of backend `self:port_be`, below `SOCK_NOTE_SLOTS`.
    fn note_slot(&self, port_be: u16) -> usize;
}

impl SockAddr for u32 {
    #[inline(always)]
    fn note_slot(&self, port_be: u16) -> usize {
        sock_note_slot(*self, port_be)
    }
}

/// IPv6's words folded into one, whose low word (the host part of most
/// subnets) carries the spread.
impl SockAddr for [u32; 4] {
    #[inline(always)]
    fn note_slot(&self, port_be: u16) -> usize {
        sock_note_slot(self[0] ^ self[1] ^ self[2] ^ self[3], port_be)
    }
}

/// What `program_names::SOCK_NOTES_DUMP` writes per socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockNotesRecordOf<A> {
    /// The socket's cookie, as socket diagnostics show it.
    pub cookie: u64,
    pub notes: SockNotesOf<A>,
}

/// A socket's notes of IPv4 backends, as the dump writes them.
pub type SockNotesRecord = SockNotesRecordOf<u32>;
/// A socket's notes of IPv6 backends, as `SOCK_NOTES6_DUMP` writes them.
pub type SockNotes6Record = SockNotesRecordOf<[u32; 4]>;

/// Where in `SockNotes` the note of backend `backend_be:port_be` sits: the
/// top bits of a multiplicative hash, so that backends of one subnet and
/// port spread over the slots.
#[inline(always)]
pub const fn sock_note_slot(backend_be: u32, port_be: u16) -> usize {
    let port = port_be as u32;
    let h = (backend_be ^ (port << 16 | port)).wrapping_mul(0x9E37_79B9);
    (h >> 29) as usize & (SOCK_NOTE_SLOTS - 1)
}

/// Map capacities. The service, slot and backend maps are not preallocated
/// (`BPF_F_NO_PREALLOC`), so these are ceilings that cost nothing until
/// used: 100,000 services x 10 endpoints fit, with room for the
/// double-buffered slot sets a replacement needs while it is applied. The
/// LRU maps are preallocated (the kernel requires it) and sized for a busy
/// node.
pub const MAX_SERVICES: u32 = 262_144;
pub const MAX_BACKEND_SLOTS: u32 = 2_097_152;
pub const MAX_BACKENDS: u32 = 1_048_576;
pub const MAX_CONNTRACK: u32 = 262_144;
/// Entries of `CT_NEW` and of `CT_NEW6`, the flows not yet assured (two
/// entries each): a flood of new flows turns it over, never `CONNTRACK`
/// (`CONNTRACK6`). Fixed rather than
/// tied to `--conntrack-max`: it only has to hold the flows whose handshake
/// or first exchange is under way, 32,768 at a time.
pub const MAX_CT_NEW: u32 = 65_536;
/// Entries of `CT_SOURCES` and of `CT_SOURCES6`: the client addresses
/// whose assured flows are counted. An LRU map: a client evicted from it
/// starts counting again, and the agent's recount puts it back.
pub const MAX_CT_SOURCES: u32 = 65_536;
pub const MAX_AFFINITY: u32 = 65_536;
pub const MAX_NODE_ADDRS: u32 = 256;
pub const MAX_SOURCE_RANGES: u32 = 65_536;
pub const MAX_CLUSTER_CIDRS: u32 = 64;
/// Entries of `SERVICE_CIDRS`: the service CIDRs, and the ClusterIPs of
/// every Service (two for a dual-stack one). Not preallocated.
pub const MAX_SERVICE_CIDRS: u32 = 2 * MAX_SERVICES + 64;
/// Entries of `LOCAL_IFACES`: a bridge, or every pod's host-side interface
/// of a node.
pub const MAX_LOCAL_IFACES: u32 = 4096;
/// Entries of `POD_IFACES`: every pod's host-side interface of a node.
pub const MAX_POD_IFACES: u32 = 4096;
/// Fragmented datagrams in flight whose ports `FRAGMENTS` remembers (an
/// LRU map: the oldest go first; a datagram's fragments arrive within
/// microseconds of each other).
pub const MAX_FRAGMENTS: u32 = 8192;

/// `BPF_F_NO_PREALLOC`, for the map definitions.
pub const MAP_F_NO_PREALLOC: usize = 1;
/// `BPF_F_MMAPABLE`: an array the agent maps into its memory and writes
/// without a system call (`PREFILTER`, `PREFILTER_FLOWS`).
pub const MAP_F_MMAPABLE: usize = 1 << 10;

/// Largest backend set one frontend may have (a slot index is below this).
pub const MAX_BACKENDS_PER_SERVICE: u32 = 65_536;

/// An IPv4 address in the IPv4-mapped IPv6 form (`::ffff:a.b.c.d`), as four
/// words each holding 4 bytes in network order, so that v4 and v6 share one
/// key layout.
#[inline(always)]
pub const fn v4_mapped(ip_be: u32) -> [u32; 4] {
    [0, 0, u32::from_ne_bytes([0, 0, 0xff, 0xff]), ip_be]
}

/// True when `addr` is an IPv4-mapped address; the IPv4 address is word 3.
#[inline(always)]
pub const fn is_v4_mapped(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == u32::from_ne_bytes([0, 0, 0xff, 0xff])
}

/// The backend slot for a uniform random `r` among `count` slots:
/// `(r * count) >> 32`, nftables' `numgen random mod n`. Each slot gets
/// floor or ceil of 2^32/count of the draws, so its probability is within
/// 2^-32 of 1/count; kube-proxy's iptables cascade gives the same
/// distribution to within 1e-9 (proven in the model's probability tests).
#[inline(always)]
pub const fn slot_for(r: u32, count: u32) -> u32 {
    ((r as u64 * count as u64) >> 32) as u32
}

/// Source address given to hairpin flows (a pod reaching itself through its
/// service): without it the pod would see a packet from itself to itself,
/// which the kernel drops as martian. Link-local, never routed off the node;
/// Cilium uses the same address for the same purpose.
pub const HAIRPIN_ADDR: [u8; 4] = [169, 254, 42, 1];

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_SCTP: u8 = 132;

/// `ServiceKey::scope`: which clients a frontend entry is for.
pub mod scope {
    /// Every client. ClusterIPs have only this entry.
    pub const ANY: u8 = 0;
    /// In-cluster clients only (sources in `CLUSTER_CIDRS`); looked up
    /// first, for frontends whose in-cluster backends differ from the
    /// external ones.
    pub const INTERNAL: u8 = 1;
}

/// Key of the `CLUSTER_CIDRS` and `SERVICE_CIDRS` LPM tries: an address
/// (IPv4-mapped, so an IPv4 CIDR's prefix length is 96 more than its own).
/// A source inside a `CLUSTER_CIDRS` one is an in-cluster client, as
/// kube-proxy's `--cluster-cidr` local detector decides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ClusterCidrKey {
    pub addr_be: [u32; 4],
}

/// `SERVICE_CIDRS` values: what a packet to an address under the entry
/// becomes when no frontend has its port and protocol, as kube-proxy's
/// nftables mode treats the service CIDRs (its `cluster-ips-check` chain).
pub mod service_cidr {
    /// A service CIDR: an address of it that no Service holds is dropped.
    pub const RANGE: u32 = 1;
    /// A ClusterIP (a /32 or /128 entry): a port its Service does not
    /// define is rejected (TCP reset, ICMP port unreachable).
    pub const HELD: u32 = 2;
    /// A ClusterIP of a Service another proxy serves (labelled
    /// `service.kubernetes.io/service-proxy-name`): passed as if outside
    /// the ranges, for that proxy to translate.
    pub const FOREIGN: u32 = 3;
}

/// A frontend: (address, port, protocol, scope).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceKey {
    pub addr_be: [u32; 4],
    pub port_be: u16,
    pub proto: u8,
    pub scope: u8,
}

/// `ServiceValue::flags` bits.
pub mod service_flags {
    /// ClientIP session affinity; `affinity_timeout_s` is set.
    pub const AFFINITY: u32 = 1 << 0;
    /// With no backends, drop rather than reject (ITP/ETP Local with no
    /// local endpoint, as kube-proxy does).
    pub const NO_EP_DROP: u32 = 1 << 1;
    /// A NodePort, ExternalIP or LoadBalancer frontend: a backend on another
    /// node is reached with SNAT to this node's address, so that its replies
    /// come back through here to be reverse-translated (kube-proxy
    /// masquerades the same traffic).
    pub const EXTERNAL: u32 = 1 << 2;
    /// loadBalancerSourceRanges are set: a new flow is served only if its
    /// client is in `SOURCE_RANGES` for this frontend, else dropped.
    pub const SOURCE_RANGES: u32 = 1 << 3;
    /// An address of status.loadBalancer.ingress. No program reads it:
    /// it tells `ebpf-proxy status` a LoadBalancer frontend from an
    /// ExternalIP, which the datapath treats alike.
    pub const LOAD_BALANCER: u32 = 1 << 4;
    /// The slot set is the frontend's Maglev table: a new flow takes slot
    /// `maglev::flow_hash(.., hash_seed) % count` rather than a random one,
    /// the same on every node.
    pub const MAGLEV: u32 = 1 << 5;
}

/// What a frontend points at. A packet copies this once and only uses slots
/// `0..count` of `slot_set`, so the agent can grow a set in place (slots
/// first, then count) or swap in a whole new set (new `slot_set`, one update
/// of this value) without a packet ever seeing half a backend set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceValue {
    /// Stable id of the service port: keys affinity and reverse NAT.
    pub service_id: u32,
    /// Which generation of `BACKEND_SLOTS` entries is current.
    pub slot_set: u32,
    /// Number of usable slots; 0 means reject (or drop, see flags).
    pub count: u32,
    pub flags: u32,
    pub affinity_timeout_s: u32,
    /// The seed of the flow hash, with `service_flags::MAGLEV`: the agent's
    /// `--maglev-hash-seed`, the same on every node. Was padding: an older
    /// agent wrote zeros, and never the flag.
    pub hash_seed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct BackendSlotKey {
    pub slot_set: u32,
    pub slot: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct BackendSlot {
    pub backend_id: u32,
}

/// Longest namespace and Service name a `ServiceName` holds: both are DNS
/// labels in Kubernetes (63 bytes), so one byte of NUL padding is always
/// left.
pub const SERVICE_NAME_LEN: usize = 64;
/// Longest port name a `ServiceName` holds: Kubernetes allows 15 bytes.
pub const SERVICE_PORT_NAME_LEN: usize = 32;

/// `SERVICE_NAMES` value: the Service port a `ServiceValue::service_id`
/// stands for, so that a tool reading the pins can name a frontend. Text is
/// UTF-8, NUL padded; a field filled to its end has no NUL.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceName {
    pub namespace: [u8; SERVICE_NAME_LEN],
    pub name: [u8; SERVICE_NAME_LEN],
    /// `spec.ports[].name`; empty for a Service's only, unnamed port.
    pub port_name: [u8; SERVICE_PORT_NAME_LEN],
    /// `spec.ports[].port`, host order.
    pub port: u16,
    /// `PROTO_TCP`, `PROTO_UDP` or `PROTO_SCTP`.
    pub proto: u8,
    pub _pad: u8,
}

// Arrays past 32 elements have no derived `Default`.
impl Default for ServiceName {
    fn default() -> Self {
        Self {
            namespace: [0; SERVICE_NAME_LEN],
            name: [0; SERVICE_NAME_LEN],
            port_name: [0; SERVICE_PORT_NAME_LEN],
            port: 0,
            proto: 0,
            _pad: 0,
        }
    }
}

/// The types `bpftool map dump` prints the shared structs' fields as
/// (docs/maps.md, "Reading the maps"): at load, the agent retypes in the
/// object's BTF alone each field named `*_be` as the bytes it holds, in
/// network order, and each `proto`, `dir` and `scope` as its enum, so that 10.96.0.10 reads
/// `[10,96,0,10]`, port 53 `[0,53]`, 6 `TCP` (and a flow's `dir` and a
/// frontend's `scope` by their constants' names), and a Service's name as
/// a string. Memory and code are as
/// declared; only the names bpftool prints by change. The `WIRE_VIEW` map
/// carries these types into the object's BTF; no program reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireView {
    /// What a 16-byte address (`[u32; 4]`, IPv4 mapped) is shown as.
    pub bytes16: [u8; 16],
    /// What a 4-byte field (`u32`: an IPv4 address, two ports) is shown as.
    pub bytes4: [u8; 4],
    /// What a port (`u16`) is shown as.
    pub bytes2: [u8; 2],
    /// What a protocol number (`u8`) is shown as.
    pub proto: IpProtocol,
    /// What a flow's direction (`dir`, `ct_dir`) is shown as.
    pub dir: FlowDirection,
    /// What a frontend's scope (`scope`) is shown as.
    pub scope: FrontendScope,
    /// The element of the text fields' arrays below: the agent names its
    /// type `char` (this field's name), which bpftool prints an array of,
    /// NUL terminated and printable, as a string.
    pub char: i8,
    /// What the text fields (`namespace`, `name`, `port_name`, `reason`,
    /// `text`, UTF-8 NUL padded) are shown as, by their length.
    pub text16: [i8; 16],
    pub text32: [i8; 32],
    pub text64: [i8; 64],
    pub text256: [i8; 256],
    pub _pad: [u8; 6],
}

/// `ct_dir`, by the names `bpftool` prints.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowDirection {
    FORWARD = ct_dir::FORWARD,
    REPLY = ct_dir::REPLY,
}

/// `scope`, by the names `bpftool` prints.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontendScope {
    ANY = scope::ANY,
    INTERNAL = scope::INTERNAL,
}

/// The IP protocol numbers the datapath knows, by the names `bpftool`
/// prints (a number no variant has is printed as the number).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpProtocol {
    ICMP = 1,
    TCP = PROTO_TCP,
    UDP = PROTO_UDP,
    ICMPV6 = 58,
    SCTP = PROTO_SCTP,
}

/// Longest reason label a `RefusalRecord` holds (`budget`, `cluster_ip`,
/// `invalid`...).
pub const REFUSAL_REASON_LEN: usize = 16;
/// Longest account of a refusal a `RefusalRecord` holds; a longer one is
/// cut, ending in "...".
pub const REFUSAL_TEXT_LEN: usize = 256;
/// Entries of `SERVICE_REFUSALS`: past them a refusal is in the log, the
/// Events and the metrics, but not in `ebpf-proxy status`.
pub const MAX_REFUSALS: u32 = 4_096;

/// `SERVICE_REFUSALS` key: the `index`th refusal of a Service, by name
/// (a Service refused as a whole has no service id). Text as `ServiceName`'s.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RefusalKey {
    pub namespace: [u8; SERVICE_NAME_LEN],
    pub name: [u8; SERVICE_NAME_LEN],
    pub index: u32,
}

impl Default for RefusalKey {
    fn default() -> Self {
        Self {
            namespace: [0; SERVICE_NAME_LEN],
            name: [0; SERVICE_NAME_LEN],
            index: 0,
        }
    }
}

/// `SERVICE_REFUSALS` value: what the agent refused to program of a
/// Service and why, for `ebpf-proxy status`; no program reads it. Text as
/// `ServiceName`'s.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RefusalRecord {
    /// The `reason` label of `ebpf_proxy_service_address_refusals`, or
    /// `invalid` for a Service the model cannot program at all.
    pub reason: [u8; REFUSAL_REASON_LEN],
    pub text: [u8; REFUSAL_TEXT_LEN],
}

impl Default for RefusalRecord {
    fn default() -> Self {
        Self {
            reason: [0; REFUSAL_REASON_LEN],
            text: [0; REFUSAL_TEXT_LEN],
        }
    }
}

/// `SERVICE_COUNTERS` value: one Service port's traffic on one CPU, at
/// the index of its service id (`ServiceValue::service_id`). Packets and
/// bytes are counted on every packet of an established flow, so they are
/// 64-bit; what happens once a flow at most (a flow started, refused) is
/// too, except the refusals, kept to 32 bits so that the whole value fits
/// 56 bytes (a per-CPU array costs its size times the CPUs): a CPU's count
/// wraps after 2^32 refusals, which a reader sees as a counter reset.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceCounters {
    /// By `ct_dir`: client to backend, then backend to client.
    pub packets: [u64; 2],
    /// Whole IP packets, headers included, as `packets`.
    pub bytes: [u64; 2],
    /// Flows started: by tc and XDP (conntrack entries created) and by the
    /// socket hooks (`connect()`s sent to a backend).
    pub flows: u64,
    /// New flows to the port while it had no endpoints, refused with a
    /// reset, an ICMP error or `ECONNREFUSED` (or dropped by the rejects'
    /// rate limit).
    pub rejected: u32,
    /// New flows dropped, by `service_drop` reason.
    pub dropped: [u32; service_drop::COUNT as usize],
}

// What the memory per CPU in docs/maps.md is worked out from.
const _: () = assert!(size_of::<ServiceCounters>() == 56);

/// Indexes into `ServiceCounters::dropped`: why a new flow to a Service
/// port was dropped.
pub mod service_drop {
    /// Its client is outside the port's `loadBalancerSourceRanges`.
    pub const SOURCE_RANGE: u32 = 0;
    /// No endpoint where the traffic policy allows only local ones.
    pub const NO_ENDPOINT: u32 = 1;
    /// No SNAT port was free for it.
    pub const SNAT_EXHAUSTED: u32 = 2;
    pub const COUNT: u32 = 3;
    /// The `reason` label of each.
    pub const NAMES: [&str; COUNT as usize] = ["source_range", "no_endpoint", "snat_exhausted"];
}

/// Entries of `SERVICE_COUNTERS` the agent sizes it at by default
/// (`--service-counters`): service ids below it are counted. 56 bytes a
/// CPU each, 896 KiB a CPU.
pub const DEFAULT_SERVICE_COUNTERS: u32 = 16_384;

/// `Backend::flags` bits.
pub mod backend_flags {
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 1 << 0;
    /// The endpoint is serving but terminating (used only as a fallback).
    pub const TERMINATING: u8 = 1 << 1;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend {
    pub addr_be: [u32; 4],
    pub port_be: u16,
    pub proto: u8,
    pub flags: u8,
}

/// `CtValue::dir`.
pub mod ct_dir {
    /// client -> frontend, as the client sent it.
    pub const FORWARD: u8 = 0;
    /// backend -> client, as the backend answers.
    pub const REPLY: u8 = 1;
}

/// An address as flows are keyed by it, in network order: IPv4's one word
/// or IPv6's four. Conntrack and the flow cache are written once over it.
pub trait FlowAddr:
    Copy + Default + PartialEq + Eq + core::hash::Hash + core::fmt::Debug + 'static
{
    /// The address folded into one word, for the flow cache's hash.
    fn fold(&self) -> u32;
    /// The address as `ServiceKey` and `Backend` hold it: IPv4 mapped.
    fn mapped(&self) -> [u32; 4];
    /// Whether two addresses are equal, in a few register operations: `==`
    /// on an array may become a call to `bcmp`, which BPF has not.
    fn same(&self, other: &Self) -> bool;
}

impl FlowAddr for u32 {
    #[inline(always)]
    fn fold(&self) -> u32 {
        *self
    }

    #[inline(always)]
    fn mapped(&self) -> [u32; 4] {
        v4_mapped(*self)
    }

    #[inline(always)]
    fn same(&self, other: &Self) -> bool {
        self == other
    }
}

impl FlowAddr for [u32; 4] {
    #[inline(always)]
    fn fold(&self) -> u32 {
        let [w0, w1, w2, w3] = *self;
        w0 ^ w1.rotate_left(8) ^ w2.rotate_left(16) ^ w3.rotate_left(24)
    }

    #[inline(always)]
    fn mapped(&self) -> [u32; 4] {
        *self
    }

    #[inline(always)]
    fn same(&self, other: &Self) -> bool {
        let mut diff = 0;
        for i in 0..4 {
            diff |= self[i] ^ other[i];
        }
        diff == 0
    }
}

/// A flow as one direction of it appears on the wire, of either family
/// (`CtKey`, `Ct6Key`). Both directions of a translated flow have an entry,
/// told apart by `CtValueOf::dir`, so that any packet needs exactly one
/// conntrack lookup.
///
/// Conntrack is per address family: every packet hashes this key, and
/// IPv4's 16 bytes hash in one jhash round where IPv6-wide addresses take
/// four. So each family has maps of its own, of this one type over its
/// address.
/// The padding is two fields, not a byte array, so that building a key is
/// plain stores (a `[u8; 3]` compiled to a call to `memset`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKeyOf<A> {
    pub src_be: A,
    pub dst_be: A,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    pub _pad0: u8,
    pub _pad1: u16,
}

/// An IPv4 flow's key, in `CONNTRACK` and `CT_NEW`.
pub type CtKey = CtKeyOf<u32>;
/// An IPv6 flow's key, in `CONNTRACK6` and `CT_NEW6`.
pub type Ct6Key = CtKeyOf<[u32; 4]>;

impl<A: FlowAddr> CtKeyOf<A> {
    pub const fn new(src_be: A, dst_be: A, sport_be: u16, dport_be: u16, proto: u8) -> Self {
        CtKeyOf {
            src_be,
            dst_be,
            sport_be,
            dport_be,
            proto,
            _pad0: 0,
            _pad1: 0,
        }
    }

    /// Whether two keys have the same addresses and ports (see
    /// `FlowAddr::same`); their protocols are the caller's to compare (the
    /// flow cache tells its absent copies by theirs, `FLOW_CACHE_ABSENT`).
    #[inline(always)]
    pub fn same_ends(&self, other: &Self) -> bool {
        self.src_be.same(&other.src_be)
            && self.dst_be.same(&other.dst_be)
            && self.sport_be == other.sport_be
            && self.dport_be == other.dport_be
    }
}

/// `CtValue::flags` bits.
pub mod ct_flags {
    /// The flow is closed: an RST inside the window was seen, or a FIN each
    /// way. Its entries live on for `CtTimeouts::tcp_close_ns` after an RST
    /// and `tcp_time_wait_ns` after the FINs, holding its SNAT port.
    pub const CLOSING: u8 = 1 << 0;
    /// A reply was seen: the flow is established.
    pub const SEEN_REPLY: u8 = 1 << 1;
    /// Hairpin flow: the client is its own backend, and the flow is SNATed
    /// to the hairpin address (`alt_*` is in use).
    pub const HAIRPIN: u8 = 1 << 2;
    /// The flow's source is rewritten (`alt_*` is in use): to this node's
    /// address for an external flow to a backend on another node, or to
    /// another port of its source address (the client's own, or with
    /// `HAIRPIN` the hairpin address) for a flow whose tuple clashed at its
    /// backend with another flow's (`counter::CT_PORT_REMAPPED`).
    pub const SNAT: u8 = 1 << 3;
    /// After translation the packet's source is an address of this node,
    /// which the stack would drop as martian: it is routed by a FIB lookup
    /// and redirected instead. On a forward entry without `TWO_SIDED` (the
    /// client's address kept), the flow goes by direct server return: its
    /// packets carry their frontend to the backend's node (`dsr`), and its
    /// replies never come back here.
    pub const REDIRECT: u8 = 1 << 4;
    /// `alt_*` is in use: the other address of the packet is rewritten too.
    pub const TWO_SIDED: u8 = HAIRPIN | SNAT;
    /// The flow is assured (its client spoke again after a reply) and lives
    /// in `CONNTRACK`. Until then a TCP flow that has seen a reply keeps the
    /// handshake's timeout, as netfilter's `SYN_RECV`: a half-open flow (a
    /// SYN-ACK to a spoofed client) is not kept for hours.
    pub const ASSURED: u8 = 1 << 5;
    /// A FIN inside the window from the client's side (a TCP flow half
    /// closed by it: the other side may go on sending for as long as the
    /// close-wait timeout, as netfilter tracks each direction).
    pub const FIN_FORWARD: u8 = 1 << 6;
    /// A FIN inside the window from the backend's side.
    pub const FIN_REPLY: u8 = 1 << 7;
    /// Both FINs: the flow is closed.
    pub const FIN_BOTH: u8 = FIN_FORWARD | FIN_REPLY;
}

/// The source ports (host order, inclusive) a client's port `sport` is
/// changed within when its flow's tuple at the backend is another live
/// flow's (`counter::CT_PORT_REMAPPED`): netfilter's classes for it
/// (`nf_nat_l4proto_unique_tuple`), a privileged port staying privileged,
/// below 512 or above, any other taking one of 1024-65535.
#[inline(always)]
pub fn remap_ports(sport: u16) -> (u16, u16) {
    match sport {
        0..512 => (1, 511),
        512..1024 => (600, 1023),
        _ => (1024, 65535),
    }
}

/// For a FORWARD entry, `nat_*` is the backend the flow was sent to and
/// `alt_*` the source it is given (SNAT or hairpin); for a REPLY entry,
/// `nat_*` is the frontend the client addressed (what replies are rewritten
/// back to) and `alt_*` the client's own address and port (where SNATed
/// replies go back to). `alt_*` is used only when a `TWO_SIDED` flag is set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtValueOf<A> {
    pub nat_addr_be: A,
    pub alt_addr_be: A,
    pub nat_port_be: u16,
    pub alt_port_be: u16,
    pub flags: u8,
    pub dir: u8,
    /// The MTU of the route the stack forwards this direction's translated
    /// packets on, learnt when the flow began (0: none known, or the
    /// datapath sends them itself and routes each one). A longer packet is
    /// answered by the datapath, quoting it as its sender sent it, where
    /// the stack's own error would quote it translated, which the sender
    /// cannot match to its socket.
    pub path_mtu: u16,
    pub backend_id: u32,
    pub service_id: u32,
    /// The datapath clock (`Clock`) when the entry was created, in seconds.
    pub created_s: u32,
    /// The highest acknowledgment number this direction's TCP packets have
    /// carried (host order; 0: none yet), as of its last packet that took
    /// the conntrack path (at least once a second while packets flow): what
    /// tells an FIN or RST of the other direction inside the window from
    /// one outside it (`tcp_in_window`). A value from up to a second ago
    /// only ever lags the true one. Of an SCTP flow: the verification tag
    /// this direction's packets carry, as on the wire (0: not known yet).
    pub tcp_max_ack: u32,
    /// The datapath clock at the last packet (updated at most once a
    /// second).
    pub last_seen_ns: u64,
}

/// An IPv4 flow's entry, in `CONNTRACK` and `CT_NEW`.
pub type CtValue = CtValueOf<u32>;
/// An IPv6 flow's entry, in `CONNTRACK6` and `CT_NEW6`.
pub type Ct6Value = CtValueOf<[u32; 4]>;

/// Idle timeout of a conntrack entry with `flags` (`ct_flags`) of a flow of
/// `proto`; the datapath and the agent's reaper share it so that they never
/// disagree on what is alive. TCP's follow netfilter's states: a FIN each
/// way is `TIME_WAIT`, an RST `CLOSE`, one FIN `CLOSE_WAIT` (the half-closed
/// flow's other side may go on sending), an assured flow `ESTABLISHED`,
/// anything before `SYN_SENT`/`SYN_RECV`. An SCTP association takes TCP's
/// timeouts of the same stage: ended by an ABORT or SHUTDOWN COMPLETE
/// (`CLOSING`), TCP's close; assured (its COOKIE ECHO's exchange done), its
/// established; before, its handshake's. Its heartbeats (every 30 s by
/// default) keep an idle association's entries alive.
#[inline(always)]
pub fn idle_timeout_ns(flags: u8, proto: u8, timeouts: &CtTimeouts) -> u64 {
    if proto == PROTO_SCTP {
        return if flags & ct_flags::CLOSING != 0 {
            timeouts.tcp_close_ns
        } else if flags & ct_flags::ASSURED != 0 {
            timeouts.tcp_established_ns
        } else {
            timeouts.tcp_syn_ns
        };
    }
    if proto != PROTO_TCP {
        return timeouts.udp_ns;
    }
    let fins = flags & ct_flags::FIN_BOTH;
    if fins == ct_flags::FIN_BOTH {
        timeouts.tcp_time_wait_ns
    } else if flags & ct_flags::CLOSING != 0 {
        timeouts.tcp_close_ns
    } else if fins != 0 {
        timeouts.tcp_close_wait_ns
    } else if flags & (ct_flags::SEEN_REPLY | ct_flags::ASSURED)
        == ct_flags::SEEN_REPLY | ct_flags::ASSURED
    {
        timeouts.tcp_established_ns
    } else {
        timeouts.tcp_syn_ns
    }
}

/// The largest window TCP can advertise (RFC 7323 2.3: 65,535 shifted by at
/// most 14).
pub const TCP_MAX_WINDOW: u32 = 1 << 30;

/// Whether a FIN or RST with sequence number `seq` (host order) falls
/// inside its receiver's window, the receiver's highest acknowledgment
/// number being at least `max_ack` (`CtValueOf::tcp_max_ack`; 0: unknown,
/// as before the receiver's first ACK, and then taken as inside). A
/// segment before what its receiver already acknowledged, or further past
/// it than any window reaches, is stale or forged: netfilter ignores it
/// (its `tcp_in_window`), and so does the datapath, keeping the flow.
#[inline(always)]
pub fn tcp_in_window(seq: u32, max_ack: u32) -> bool {
    max_ack == 0 || seq.wrapping_sub(max_ack) <= TCP_MAX_WINDOW
}

/// `max_ack` after a packet acknowledging `ack`: sequence numbers wrap, so
/// "higher" is within half the space ahead (RFC 1982).
#[inline(always)]
pub fn tcp_ack_after(max_ack: u32, ack: u32) -> u32 {
    if max_ack == 0 || (ack.wrapping_sub(max_ack) as i32) > 0 {
        ack
    } else {
        max_ack
    }
}

/// What a TCP FIN or RST (`fin`, `rst`) with sequence number `seq`, sent in
/// direction `dir` (`ct_dir`) of a flow whose entry has `flags`, does to
/// them, its receiver having acknowledged at least `receiver_max_ack`: the
/// new flags, or None when it is outside the window and changes nothing.
/// A FIN closes its own direction only; an RST, or the second direction's
/// FIN, closes the flow.
#[inline(always)]
pub fn tcp_close_step(
    flags: u8,
    dir: u8,
    fin: bool,
    rst: bool,
    seq: u32,
    receiver_max_ack: u32,
) -> Option<u8> {
    if !tcp_in_window(seq, receiver_max_ack) {
        return None;
    }
    let mut flags = flags;
    if fin {
        flags |= if dir == ct_dir::FORWARD {
            ct_flags::FIN_FORWARD
        } else {
            ct_flags::FIN_REPLY
        };
    }
    if rst || flags & ct_flags::FIN_BOTH == ct_flags::FIN_BOTH {
        flags |= ct_flags::CLOSING;
    }
    Some(flags)
}

/// Default idle timeouts of conntrack entries: kube-proxy's where it sets
/// them (close-wait), netfilter's for the closing states, Cilium's for the
/// others; the agent may set others in the `CT_TIMEOUTS` map. An expired
/// entry is treated as absent by the datapath and reaped by the agent.
pub mod ct_timeout {
    const S: u64 = 1_000_000_000;
    /// TCP flow that has not seen a reply yet.
    pub const TCP_SYN_NS: u64 = 60 * S;
    pub const TCP_ESTABLISHED_NS: u64 = 21_600 * S;
    /// Half closed (a FIN one way): kube-proxy's
    /// `--conntrack-tcp-timeout-close-wait`.
    pub const TCP_CLOSE_WAIT_NS: u64 = 3_600 * S;
    /// Closed by a FIN each way: netfilter's `TIME_WAIT`, long enough that
    /// no packet of the flow is still in the network when its SNAT port
    /// goes to another client.
    pub const TCP_TIME_WAIT_NS: u64 = 120 * S;
    /// Reset: netfilter's `CLOSE`.
    pub const TCP_CLOSE_NS: u64 = 10 * S;
    pub const UDP_NS: u64 = 60 * S;
    /// `last_seen_ns` is refreshed at most this often, to spare a map write
    /// per packet.
    pub const REFRESH_NS: u64 = S;
}

/// The datapath's clock. `bpf_ktime_get_coarse_ns` is a helper call on every
/// packet; `bpf_jiffies64` the JIT reads inline. Jiffies advance once a
/// kernel tick, kept in step with the monotonic clock, so
/// `ns + (jiffies64 - jiffies) * tick_ns` is `CLOCK_MONOTONIC` to within a
/// tick, the precision of the coarse clock itself. `CLOCK[IN_FORCE]` holds
/// the scale the agent calibrated (all zeros: not calibrated, the datapath
/// reads the coarse clock); `CLOCK[SAMPLE]` is where `clock_probe` leaves a
/// reading of both clocks (`tick_ns` 0) for the agent to calibrate from.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Clock {
    pub jiffies: u64,
    pub ns: u64,
    pub tick_ns: u64,
}

/// A per-CPU copy of a live conntrack entry, in `FLOW_CACHE` slot
/// `flow_cache_slot(&key)`, so that a packet of an established flow is
/// translated with an inline array lookup instead of a hash lookup (a call
/// into the kernel, which hashes and compares the key).
///
/// A copy is only good while nothing that could have changed its entry has
/// happened since it was taken; `FLOW_GEN` counts those events. Its slot
/// `s < FLOW_CACHE_SLOTS` is bumped by the datapath whenever it removes or
/// overwrites a conntrack entry whose key falls in cache slot `s`, and
/// after it creates one (a flow's two entries, once both are in); slot
/// `FLOW_GEN_EPOCH` by the agent after it removes entries or adds any. A
/// slot may also hold an absent copy: that conntrack had no live entry for
/// its key (`FLOW_CACHE_ABSENT`), under the same counters. A copy records
/// both counters as they were read *before* the conntrack lookup it copies,
/// and is used only while both are unchanged, for at most
/// `ct_timeout::REFRESH_NS` (so the entry's own timestamp keeps being
/// refreshed), and never for a packet with SYN, FIN or RST (which change a
/// flow's state and so always take the conntrack path).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowCacheEntryOf<A> {
    pub key: CtKeyOf<A>,
    /// The entry as it was read; `last_seen_ns` is when it was copied.
    pub value: CtValueOf<A>,
    /// `FLOW_GEN[flow_cache_slot(&key)]` before the lookup (its low half:
    /// a copy lives far too short for that to wrap round).
    pub slot_gen: u32,
    /// `FLOW_GEN[FLOW_GEN_EPOCH]` before the lookup (its low half).
    pub epoch: u32,
}

/// The bit flipped in an absent copy's `key.proto`: the slot says that
/// conntrack had no live entry for the key with the protocol unflipped, and
/// its `value` holds nothing but `last_seen_ns` (when it was written). A
/// packet from a backend's port that no flow knows (its pod answering a
/// client that reached it by its pod IP) finds it where it would otherwise
/// take three hash lookups. No protocol conntrack tracks is another's with
/// this bit flipped (TCP, UDP, SCTP: 6, 17, 132), so a reader that knows
/// no absent copies (an older agent's programs, on the pinned maps) never
/// matches one.
pub const FLOW_CACHE_ABSENT: u8 = 0x80;

/// A copy of an IPv4 flow's entry, in `FLOW_CACHE`.
pub type FlowCacheEntry = FlowCacheEntryOf<u32>;
/// A copy of an IPv6 flow's entry, in `FLOW_CACHE6`, under the same
/// contract: its slot's counter and the epoch are `FLOW_GEN`'s, which both
/// families share (an IPv4 and an IPv6 flow in the same slot only void each
/// other's copies early).
pub type FlowCache6Entry = FlowCacheEntryOf<[u32; 4]>;

/// Key of `FRAGMENTS`: what identifies one fragmented datagram on the wire
/// (RFC 791: source, destination, protocol and identification; RFC 8200:
/// the same without the protocol, 0 here). Addresses are IPv4-mapped IPv6
/// and the id 32 bits wide, so that IPv6's fragment header (a 32-bit
/// identification) fits the same map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragKey {
    pub src_be: [u32; 4],
    pub dst_be: [u32; 4],
    /// The identification as on the wire: IPv4's 16 bits in the low-address
    /// half, 0 in the other.
    pub id_be: u32,
    pub proto: u8,
    pub _pad0: u8,
    pub _pad1: u16,
}

/// Value of `FRAGMENTS`: the ports a datagram's first fragment carried,
/// which its later fragments (no L4 header) are translated by.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragValue {
    pub sport_be: u16,
    pub dport_be: u16,
    /// An IPv6 datagram's transport protocol: its key has none (RFC 8200
    /// 4.5 ties fragments by addresses and identification alone), and a
    /// later fragment's fragment header may name an extension header
    /// rather than it. 0 for IPv4, whose key holds the protocol.
    pub proto6: u32,
    /// The datapath clock when the first fragment was seen.
    pub seen_ns: u64,
}

/// How long a first fragment's ports serve its later fragments: Linux's
/// reassembly timeout (`ipfrag_time`, 30 s), after which the receiver has
/// given the datagram up anyway. Bounds how long a stale entry could hand
/// its ports to an unrelated datagram reusing the identification.
pub const FRAG_TIMEOUT_NS: u64 = 30_000_000_000;

/// Slots of the per-CPU flow cache (a power of two).
pub const FLOW_CACHE_SLOTS: u32 = 4096;
/// The `FLOW_GEN` slot the agent bumps (the others are the datapath's).
pub const FLOW_GEN_EPOCH: u32 = FLOW_CACHE_SLOTS;

/// The flow cache slot of `key` (in its family's cache, and its counter's
/// in `FLOW_GEN`): a multiplicative hash of its words, each address folded
/// into one, cheap enough to compute inline on every packet.
#[inline(always)]
pub fn flow_cache_slot<A: FlowAddr>(key: &CtKeyOf<A>) -> u32 {
    let ports = u32::from(key.sport_be) | (u32::from(key.dport_be) << 16);
    let mixed = key.src_be.fold().rotate_left(7)
        ^ key.dst_be.fold()
        ^ ports.rotate_left(19)
        ^ u32::from(key.proto);
    mixed.wrapping_mul(0x9e37_79b1) >> (32 - FLOW_CACHE_SLOTS.trailing_zeros())
}

/// Slots of the `CLOCK` array.
pub mod clock_slot {
    pub const IN_FORCE: u32 = 0;
    pub const SAMPLE: u32 = 1;
    pub const COUNT: u32 = 2;
}

impl Clock {
    /// This clock's reading at `jiffies` (when calibrated).
    #[inline(always)]
    pub fn at(&self, jiffies: u64) -> u64 {
        self.ns.wrapping_add(
            jiffies
                .wrapping_sub(self.jiffies)
                .wrapping_mul(self.tick_ns),
        )
    }
}

/// Conntrack idle timeouts in force: the single entry of the `CT_TIMEOUTS`
/// array, written by the agent at start (kube-proxy's `--conntrack-*` flags).
/// An entry of zeros (never written) means the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtTimeouts {
    /// TCP flow that has not seen a reply yet.
    pub tcp_syn_ns: u64,
    pub tcp_established_ns: u64,
    /// Half closed: a FIN one way.
    pub tcp_close_wait_ns: u64,
    /// Closed by a FIN each way.
    pub tcp_time_wait_ns: u64,
    /// Reset.
    pub tcp_close_ns: u64,
    pub udp_ns: u64,
}

impl CtTimeouts {
    pub const DEFAULT: CtTimeouts = CtTimeouts {
        tcp_syn_ns: ct_timeout::TCP_SYN_NS,
        tcp_established_ns: ct_timeout::TCP_ESTABLISHED_NS,
        tcp_close_wait_ns: ct_timeout::TCP_CLOSE_WAIT_NS,
        tcp_time_wait_ns: ct_timeout::TCP_TIME_WAIT_NS,
        tcp_close_ns: ct_timeout::TCP_CLOSE_NS,
        udp_ns: ct_timeout::UDP_NS,
    };

    /// The defaults when the map entry was never written.
    #[inline(always)]
    pub fn or_default(self) -> CtTimeouts {
        if self.udp_ns == 0 {
            CtTimeouts::DEFAULT
        } else {
            self
        }
    }
}

impl Default for CtTimeouts {
    fn default() -> Self {
        CtTimeouts::DEFAULT
    }
}

impl<A> CtValueOf<A> {
    /// Idle timeout of this entry; the datapath and the agent's reaper share
    /// it so that they never disagree on what is alive.
    #[inline(always)]
    pub fn idle_timeout_ns(&self, proto: u8, timeouts: &CtTimeouts) -> u64 {
        idle_timeout_ns(self.flags, proto, timeouts)
    }

    #[inline(always)]
    pub fn expired(&self, proto: u8, now_ns: u64, timeouts: &CtTimeouts) -> bool {
        now_ns.saturating_sub(self.last_seen_ns) > self.idle_timeout_ns(proto, timeouts)
    }
}

/// The one entry of `REJECT_LIMIT`: how many rejects the datapath may
/// send, held to the budget the kernel holds its own ICMP errors to
/// (`net.ipv4.icmp_msgs_per_sec` and `icmp_msgs_burst`, which cover ICMPv6
/// too), and the bucket that budget is spent from: one for the node, every
/// CPU and both families, as the kernel's `icmp_global_allow`. Not pinned:
/// the agent writes the node's limits at each load.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct RejectLimit {
    /// Rejects a second, refilled by the millisecond; 0 with `configured`
    /// is none after the burst, as the kernel reads 0.
    pub msgs_per_sec: u32,
    /// The most the bucket holds.
    pub burst: u32,
    /// Nonzero once the agent has written the node's limits; until then
    /// the kernel's defaults (`REJECT_MSGS_PER_SEC`, `REJECT_MSGS_BURST`).
    pub configured: u32,
    /// Rejects the bucket holds now (the datapath's).
    pub credit: u32,
    /// The datapath clock when the bucket was last refilled.
    pub stamp_ns: u64,
}

/// The kernel's defaults of `icmp_msgs_per_sec` and `icmp_msgs_burst`.
pub const REJECT_MSGS_PER_SEC: u32 = 1000;
pub const REJECT_MSGS_BURST: u32 = 50;

/// `NodeAddr::flags` bits.
pub mod node_addr_flags {
    /// NodePorts are served on this address (it matches
    /// `--nodeport-addresses`).
    pub const NODEPORT: u32 = 1 << 0;
}

/// An address of this node (key of `NODE_ADDRS`), IPv4-mapped like every
/// address here.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct NodeAddrKey {
    pub addr_be: [u32; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct NodeAddr {
    pub flags: u32,
}

/// The node-wide settings of the datapath: the single entry of the
/// `NODE_CONFIG` array. Zeros (never written) mean no SNAT address, so
/// external flows to remote backends are passed untranslated.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct NodeConfig {
    /// The address external flows to remote backends are SNATed to.
    pub snat_addr_be: [u32; 4],
    /// SNAT source ports are drawn from `snat_port_min..=snat_port_max`
    /// (host order).
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// `node_config_flags`. Was padding: an older agent wrote zeros.
    pub flags: u32,
    /// The most assured flows one client address may hold in `CONNTRACK`
    /// (`CONNTRACK6`): past it, its flows stay unassured in `CT_NEW`, where
    /// they compete with other unassured flows only, so that a client
    /// completing handshakes by the thousand evicts its own flows rather
    /// than others' established ones. 0: no share. Read from
    /// `NODE_CONFIG` for both families.
    pub ct_source_share: u32,
}

/// Bits of `NodeConfig::flags`.
pub mod node_config_flags {
    /// The node's own connections to `127.0.0.0/8` reach NodePorts, as
    /// kube-proxy's `--iptables-localhost-nodeports`. Only its sockets: a
    /// packet from outside addressed to a loopback address is never
    /// translated (CVE-2020-8558).
    pub const LOCALHOST_NODEPORTS: u32 = 1 << 0;
    /// Flows netfilter translated before this datapath took over (kube-
    /// proxy's) may still live: a packet to a frontend that has no flow
    /// here and starts none is left to netfilter when its conntrack has the
    /// packet's tuple (`netfilter_ct`). Set by the agent from the takeover
    /// until the last such flow is gone.
    pub const NETFILTER_FLOWS: u32 = 1 << 1;
    /// Every new flow to a Service is SNATed to the node, as kube-proxy's
    /// `--masquerade-all` marks every Service packet for masquerade; hairpin
    /// flows keep their own SNAT. Without it only external flows to
    /// backends on other nodes are.
    pub const MASQUERADE_ALL: u32 = 1 << 2;
    /// A new flow to a ClusterIP from a client that is not in-cluster (not
    /// in `CLUSTER_CIDRS`, nor arrived on one of `LOCAL_IFACES`) is SNATed to
    /// the node, as kube-proxy masquerades off-cluster traffic to a
    /// ClusterIP where it has a local traffic detector. In `NODE_CONFIG` for
    /// IPv4, in `NODE_CONFIG6` for IPv6 (each family's detector is its own).
    pub const MASQUERADE_OFF_CLUSTER: u32 = 1 << 3;
    /// Direct server return (`--lb-mode dsr`): a new flow from outside to
    /// an external frontend whose backend is on another node keeps the
    /// client's address. It is DNATed and sent to the backend's node with
    /// the frontend in an IP option (`dsr`), whose replies then leave
    /// straight to the client. The option is also what this node accepts
    /// from others. In `NODE_CONFIG` for both families.
    pub const DSR: u32 = 1 << 4;
    /// With `DSR`, only TCP flows go by direct server return; UDP's are
    /// SNATed (`--lb-mode hybrid`).
    pub const DSR_TCP_ONLY: u32 = 1 << 5;
    /// Pods' TCP `connect()`s to ClusterIPs are sent to a backend by the
    /// socket hooks too, as the node's are, and their packets carry the
    /// backend's address from the first one: no translation at tc and no
    /// conntrack entry (`--socket-lb-pods`). Only ClusterIPs without
    /// session affinity, and never with `MASQUERADE_ALL`: the hook knows
    /// no client address to keep affinity by or to masquerade. A pod is
    /// taken as in-cluster. In `NODE_CONFIG` for both families.
    pub const SOCKET_LB_PODS: u32 = 1 << 6;
    /// A packet tc translated (a new or known flow's, either direction,
    /// the client's address kept) whose route leads into a pod of this
    /// node (its egress is one of `POD_IFACES`) is sent straight into the
    /// pod's namespace (`bpf_redirect_peer`), not through the node's
    /// forwarding: no netfilter `FORWARD` or `POSTROUTING`, no qdisc on the
    /// pod's host-side interface (`--host-routing bpf`). In `NODE_CONFIG`
    /// for both families.
    pub const HOST_ROUTING_BPF: u32 = 1 << 7;
}

/// Default SNAT source port range: below the NodePort range (30000-32767)
/// and Linux's ephemeral range (32768-60999), so a SNATed flow never takes
/// the 4-tuple of a connection of the node itself.
pub const SNAT_PORT_MIN: u16 = 1024;
pub const SNAT_PORT_MAX: u16 = 29_999;

/// Key of the `SOURCE_RANGES` LPM trie: the frontend (a LoadBalancer IP,
/// port and protocol) is matched in full, then the client address by the
/// range's prefix. Each frontend owns its entries, as each LoadBalancer IP
/// has its own firewall chain in kube-proxy.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SourceRangeKey {
    pub frontend: ServiceKey,
    pub client_be: [u32; 4],
}

/// Bits of a `SourceRangeKey` before the client address: the whole
/// frontend.
pub const SOURCE_RANGE_FRONTEND_BITS: u32 = 8 * size_of::<ServiceKey>() as u32;

/// Prefix length of a `SOURCE_RANGES` entry for a client range of
/// `prefix` bits of its 128-bit (IPv4-mapped for IPv4) address.
pub const fn source_range_prefix(prefix128: u32) -> u32 {
    SOURCE_RANGE_FRONTEND_BITS + prefix128
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityKey {
    pub client_be: [u32; 4],
    pub service_id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    /// The datapath clock (`Clock`) at the last new connection that used
    /// this entry.
    pub last_used_ns: u64,
}

/// Indexes into the per-CPU `COUNTERS` array.
pub mod counter {
    /// First packet of a flow to a frontend, DNATed to a backend.
    pub const DNAT_NEW: u32 = 0;
    /// Later packet of a known flow, DNATed by its conntrack entry.
    pub const DNAT_ESTABLISHED: u32 = 1;
    /// Reply rewritten back to the frontend address.
    pub const REV_NAT: u32 = 2;
    /// Frontend without backends: rejected with ICMP port unreachable.
    pub const REJECT: u32 = 3;
    /// Frontend without usable backends whose policy is to drop.
    pub const DROP_NO_ENDPOINT: u32 = 4;
    /// Packet that could not be parsed; passed untouched.
    pub const PASS_MALFORMED: u32 = 5;
    /// Conntrack insert failed; the packet was still translated.
    pub const CT_INSERT_FAILED: u32 = 6;
    /// A slot or backend lookup missed (agent mid-update); passed.
    pub const LOOKUP_MISS: u32 = 7;
    /// Packet to a frontend whose protocol the datapath does not handle.
    /// Every protocol a frontend can have is translated now (SCTP was the
    /// last): never counted, kept so that what reads it by name still finds
    /// it.
    pub const UNSUPPORTED_PROTO: u32 = 8;
    /// New hairpin flow (a backend reaching itself through its service).
    pub const HAIRPIN: u32 = 9;
    /// New external flow SNATed to this node's address.
    pub const SNAT_NEW: u32 = 10;
    /// No free SNAT source port for a new flow: dropped.
    pub const SNAT_EXHAUSTED: u32 = 11;
    /// New flow to a LoadBalancer IP from outside its source ranges: dropped.
    pub const DROP_SOURCE_RANGE: u32 = 12;
    /// Packet routed by a FIB lookup and redirected (its new source is a node
    /// address the stack would refuse).
    pub const REDIRECT: u32 = 13;
    /// XDP left a packet it could have translated to tc (no neighbour entry
    /// yet, another egress interface, or a reject).
    pub const XDP_TO_TC: u32 = 14;
    /// Packet translated at XDP and sent back out of the interface it came
    /// in on (by `XDP_REDIRECT`).
    pub const XDP_TX: u32 = 15;
    /// A later fragment of a datagram whose first fragment was translated
    /// (no L4 header of its own: translated by the first one's ports).
    pub const FRAG_TRANSLATED: u32 = 16;
    /// A later fragment of a datagram whose first fragment this datapath
    /// did not translate (not a Service's, or it arrived before its first
    /// fragment, or the first one's entry expired): passed as it is.
    pub const FRAG_UNTRACKED: u32 = 17;
    /// A new flow's entries made (in `CT_NEW` or `CT_NEW6`; or where
    /// `CT_REOPENED` says).
    pub const CT_NEW_FLOW: u32 = 18;
    /// A flow assured and moved to `CONNTRACK` (`CONNTRACK6`).
    pub const CT_ASSURED: u32 = 19;
    /// A packet the datapath routes itself (see `REDIRECT`) whose TTL was
    /// spent: dropped, as a router drops it.
    pub const DROP_TTL: u32 = 20;
    /// A packet the datapath routes itself with no route, or no way to its
    /// next hop: dropped (the stack would drop it for its source anyway).
    pub const DROP_NO_ROUTE: u32 = 21;
    /// A rewrite that could not be finished (headers out of reach): the
    /// packet is dropped rather than sent with wrong checksums.
    pub const DROP_REWRITE: u32 = 22;
    /// A reject (RST or ICMP) that could not be built from the packet: the
    /// packet is dropped instead.
    pub const DROP_REJECT_FAILED: u32 = 23;
    /// An ICMP error about a translated flow (destination unreachable, time
    /// exceeded, parameter problem), its quoted header and its addresses
    /// translated back as the flow's packets are.
    pub const ICMP_ERROR_TRANSLATED: u32 = 24;
    /// A datapath log record not written: its CPU had used its share of
    /// the rate limit (`datapath_log::PER_CPU_PER_WINDOW`).
    pub const LOG_RATE_LIMITED: u32 = 25;
    /// An IPv6 packet whose extension headers could not be walked to its
    /// transport header (more than the datapath walks, one it does not
    /// know, or cut short): passed untouched.
    pub const PASS_V6_EXT_HEADERS: u32 = 26;
    /// Packet translated at XDP and passed on to the stack (a translation
    /// the node routes as it would the packet: DNAT to a backend, the reply
    /// of such a flow), where `XDP_TX` counts those XDP sends back out.
    pub const XDP_TRANSLATED: u32 = 27;
    /// A packet of a flow netfilter translated before this datapath took
    /// over (kube-proxy's), found in the kernel's conntrack by tc and left
    /// to netfilter, which goes on translating it (`netfilter_ct`).
    pub const NETFILTER_PASS: u32 = 28;
    /// A packet the datapath routes itself that is longer than its route's
    /// MTU (each segment, for a GSO packet): answered, as a router answers,
    /// with ICMP "fragmentation needed" or ICMPv6 "packet too big" and the
    /// MTU, so that its sender lowers its path MTU; an IPv4 packet that
    /// may be fragmented (no DF) is dropped, as fragmenting is the stack's.
    pub const TOO_BIG: u32 = 29;
    /// A reject (RST or ICMP port unreachable) not sent, the node's budget
    /// of ICMP errors being spent (`RejectLimit`): the packet is dropped, so
    /// that a spoofed flood to a frontend without endpoints does not turn
    /// the node into a reflector. Counted in `REJECT` too.
    pub const REJECT_RATE_LIMITED: u32 = 30;
    /// A SNAT port every try found held, taken from a flow whose backend
    /// never answered (a flood of SYNs or one-way datagrams holding the
    /// range), as netfilter drops unassured entries first: that flow is
    /// removed, the new one served.
    pub const SNAT_RECLAIMED: u32 = 31;
    /// A TCP FIN or RST outside its receiver's window (`tcp_in_window`):
    /// stale, or forged by someone who guessed the flow's addresses and
    /// ports. The flow's state is left as it was; the packet goes on, for
    /// its receiver to judge.
    pub const CT_OUT_OF_WINDOW: u32 = 32;
    /// A packet that would have assured its flow, left unassured (in
    /// `CT_NEW`) because its client already holds its share of assured
    /// flows (`NodeConfig::ct_source_share`): each of the flow's packets of
    /// its client's direction tries again, and counts.
    pub const CT_SHARE_REFUSED: u32 = 33;
    /// A packet to an address of a service CIDR that no Service holds
    /// (`service_cidr::RANGE`), dropped.
    pub const DROP_UNALLOCATED: u32 = 34;
    /// A packet to a ClusterIP on a port (or protocol) its Service does not
    /// define (`service_cidr::HELD`), rejected.
    pub const REJECT_UNDEFINED_PORT: u32 = 35;
    /// An SCTP packet of a known association whose verification tag is not
    /// the one its direction carries (RFC 9260 8.5): stale, or forged by
    /// someone who guessed the association's addresses and ports. Dropped,
    /// as netfilter marks it invalid and kube-proxy drops invalid packets.
    pub const DROP_SCTP_VTAG: u32 = 36;
    /// New flow from outside to a backend on another node sent by direct
    /// server return (`node_config_flags::DSR`): DNATed with the client's
    /// address kept, the frontend carried in an IP option (`dsr`).
    pub const DSR_NEW: u32 = 37;
    /// Flow a backend's node took from the DSR option of a packet another
    /// node sent: its backend's replies leave here, from the frontend.
    pub const DSR_LEARNT: u32 = 38;
    /// Packet with a DSR option this node refused: the frontend it names is
    /// not an external frontend here, or DSR is off on this node. Passed
    /// untranslated (to a pod that then answers from its own address).
    pub const DSR_REFUSED: u32 = 39;
    /// A new TCP flow whose entries went into `CONNTRACK` (`CONNTRACK6`),
    /// in the room its client port's closed flow left there when the SYN
    /// removed both of that flow's entries: assured in place by its
    /// handshake, never moved (counted in `CT_NEW_FLOW` too, never in
    /// `CT_ASSURED`).
    pub const CT_REOPENED: u32 = 40;
    /// A new flow whose source address and port (its client's; an IPv4
    /// hairpin flow's, the hairpin address and the pod's port) a live flow
    /// of another client tuple already had at the same backend (the client
    /// reached it from that port through another frontend): its source
    /// port changed, as netfilter's NAT changes a clashing tuple's, so that
    /// the backend sees two connections (counted in `CT_NEW_FLOW` too).
    pub const CT_PORT_REMAPPED: u32 = 41;
    /// A translated packet sent straight into a pod of this node
    /// (`node_config_flags::HOST_ROUTING_BPF`), not through the node's
    /// forwarding.
    pub const TO_POD: u32 = 42;
    pub const COUNT: u32 = 43;
    /// Entries of the `COUNTERS` map: room for counters added later without
    /// a new layout version.
    pub const SLOTS: u32 = 64;
    pub const NAMES: [&str; COUNT as usize] = [
        "dnat_new",
        "dnat_established",
        "rev_nat",
        "reject",
        "drop_no_endpoint",
        "pass_malformed",
        "ct_insert_failed",
        "lookup_miss",
        "unsupported_proto",
        "hairpin",
        "snat_new",
        "snat_exhausted",
        "drop_source_range",
        "redirect",
        "xdp_to_tc",
        "xdp_tx",
        "frag_translated",
        "frag_untracked",
        "ct_new_flow",
        "ct_assured",
        "drop_ttl",
        "drop_no_route",
        "drop_rewrite",
        "drop_reject_failed",
        "icmp_error_translated",
        "log_rate_limited",
        "pass_v6_ext_headers",
        "xdp_translated",
        "netfilter_pass",
        "too_big",
        "reject_rate_limited",
        "snat_reclaimed",
        "ct_out_of_window",
        "ct_share_refused",
        "drop_unallocated",
        "reject_undefined_port",
        "drop_sctp_vtag",
        "dsr_new",
        "dsr_learnt",
        "dsr_refused",
        "ct_reopened",
        "ct_port_remapped",
        "to_pod",
    ];
}

#[cfg(feature = "user")]
mod pod_impls {
    use super::{
        AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, Clock, ClusterCidrKey,
        Ct6Key, Ct6Value, CtKey, CtTimeouts, CtValue, FlowCache6Entry, FlowCacheEntry, FragKey,
        FragValue, NodeAddr, NodeAddrKey, NodeConfig, RefusalKey, RefusalRecord, RejectLimit,
        SOCK_NOTE_SLOTS, ServiceCounters, ServiceKey, ServiceName, ServiceValue, SockNote,
        SockNote6, SockNotes, SockNotes6, SockNotes6Record, SockNotesRecord, SourceRangeKey,
    };
    macro_rules! pod {
        ($($t:ty),+ $(,)?) => {$(
            // SAFETY: all of these are #[repr(C)] with explicit padding and only
            // integer fields; bytemuck's derive has already proven there is no
            // implicit padding.
            unsafe impl aya::Pod for $t {}
        )+};
    }
    /// The conntrack types are generic over the address, which bytemuck's
    /// derive does not take: their lack of padding is proven here instead,
    /// each size being the sum of its fields' (a padded layout is larger).
    macro_rules! generic_pod {
        ($($t:ty = $fields:expr),+ $(,)?) => {$(
            const _: () = assert!(core::mem::size_of::<$t>() == $fields, "implicit padding");
            // SAFETY: #[repr(C)] with integer fields only, and no padding
            // (asserted above).
            unsafe impl bytemuck::Zeroable for $t {}
            // SAFETY: as above.
            unsafe impl bytemuck::Pod for $t {}
        )+};
    }
    generic_pod!(
        CtKey = 2 * 4 + 2 + 2 + 1 + 1 + 2,
        Ct6Key = 2 * 16 + 2 + 2 + 1 + 1 + 2,
        CtValue = 2 * 4 + 2 + 2 + 1 + 1 + 2 + 4 + 4 + 8 + 8,
        Ct6Value = 2 * 16 + 2 + 2 + 1 + 1 + 2 + 4 + 4 + 8 + 8,
        FlowCacheEntry = 16 + 40 + 4 + 4,
        FlowCache6Entry = 40 + 64 + 4 + 4,
        SockNote = 2 * 4 + 2 + 2 + 4,
        SockNote6 = 2 * 16 + 2 + 2 + 4,
        SockNotes = SOCK_NOTE_SLOTS * 16,
        SockNotes6 = SOCK_NOTE_SLOTS * 40,
        SockNotesRecord = 8 + SOCK_NOTE_SLOTS * 16,
        SockNotes6Record = 8 + SOCK_NOTE_SLOTS * 40,
    );
    pod!(
        ServiceKey,
        ServiceValue,
        ServiceName,
        RefusalKey,
        RefusalRecord,
        ServiceCounters,
        BackendSlotKey,
        BackendSlot,
        Backend,
        CtKey,
        CtValue,
        Ct6Key,
        Ct6Value,
        FlowCacheEntry,
        FlowCache6Entry,
        Clock,
        AffinityKey,
        AffinityValue,
        CtTimeouts,
        NodeAddrKey,
        NodeAddr,
        NodeConfig,
        RejectLimit,
        SourceRangeKey,
        ClusterCidrKey,
        SockNotes,
        SockNotes6,
        FragKey,
        FragValue
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes docs/maps.md promises: 100,000 Services of one port and
    /// 10 endpoints each, every endpoint its own backend, and a second
    /// slot set for each frontend while a replacement is applied.
    #[test]
    fn default_capacities_hold_100000_services_of_10_endpoints() {
        let (services, endpoints) = (100_000u32, 10u32);
        assert!(MAX_SERVICES >= services, "SERVICES: {MAX_SERVICES}");
        assert!(
            MAX_BACKENDS >= services * endpoints,
            "BACKENDS: {MAX_BACKENDS}"
        );
        assert!(
            MAX_BACKEND_SLOTS >= 2 * services * endpoints,
            "BACKEND_SLOTS: {MAX_BACKEND_SLOTS}"
        );
    }

    /// An SCTP association ages as a TCP connection of the same stage:
    /// its handshake's, its established, its close's.
    #[test]
    fn sctp_entries_take_tcps_timeouts_by_stage() {
        let t = CtTimeouts::DEFAULT;
        let stage = |flags| idle_timeout_ns(flags, PROTO_SCTP, &t);
        assert_eq!(stage(0), t.tcp_syn_ns, "INIT sent, no reply");
        assert_eq!(stage(ct_flags::SEEN_REPLY), t.tcp_syn_ns, "INIT ACK seen");
        assert_eq!(
            stage(ct_flags::SEEN_REPLY | ct_flags::ASSURED),
            t.tcp_established_ns,
            "assured"
        );
        assert_eq!(
            stage(ct_flags::SEEN_REPLY | ct_flags::ASSURED | ct_flags::CLOSING),
            t.tcp_close_ns,
            "aborted or shut down"
        );
        assert_eq!(idle_timeout_ns(0, PROTO_UDP, &t), t.udp_ns, "UDP unchanged");
    }

    #[test]
    fn a_subnets_backends_spread_over_the_note_slots() {
        let mut used = [0u32; SOCK_NOTE_SLOTS];
        for host in 1..=64u8 {
            let addr = u32::from_ne_bytes([10, 200, 0, host]);
            used[sock_note_slot(addr, 5353u16.to_be())] += 1;
        }
        assert!(
            used.iter().all(|n| (4..=12).contains(n)),
            "64 backends of one /24 and port over the slots: {used:?}"
        );
    }

    #[test]
    fn a_note_is_found_only_for_its_own_backend() {
        let (backend, port) = (u32::from_ne_bytes([10, 200, 0, 11]), 5353u16.to_be());
        let mut notes = SockNotes::default();
        assert_eq!(notes.find(&backend, port), None, "an empty table");
        let note = SockNote {
            backend_be: backend,
            frontend_be: u32::from_ne_bytes([10, 96, 0, 10]),
            backend_port_be: port,
            frontend_port_be: 53u16.to_be(),
            how: sock_note::SENT,
        };
        notes.notes[sock_note_slot(backend, port)] = note;
        assert_eq!(notes.find(&backend, port), Some(&note));
        assert_eq!(notes.find(&backend, 5354u16.to_be()), None, "another port");
        assert_eq!(notes.find(&0, 0), None, "the empty address");
    }

    #[test]
    fn v4_mapped_is_the_ipv6_mapped_form() {
        let ip = u32::from_ne_bytes([10, 96, 0, 1]);
        let words = v4_mapped(ip);
        let mut bytes = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            bytes[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        assert_eq!(
            bytes,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 96, 0, 1]
        );
        assert!(is_v4_mapped(&words));
    }
}
