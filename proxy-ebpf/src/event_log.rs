//! The datapath's log of rare events, in aya-log's records: the agent
//! reads them from aya-log-ebpf's ring buffer with aya-log and forwards
//! each into its own log. Every event here is also a counter; the log adds
//! who was involved (addresses and ports).
//!
//! Off unless the agent writes a level into `DATAPATH_LOG`. Every site is
//! on a rare path, and is there one call of `record`, which holds the
//! level's lookup and the writing of the record, out of line and marked
//! cold, so that the paths that pass no site, above all tc's established
//! flows, compile as if there were none: `tc_ingress` is one body whose
//! registers the compiler allocates as a whole, and with the sites inlined,
//! or out of line but not known to be rare, it kept the context pointer in
//! a stack slot from the first helper call on. What that cost is below what
//! the datapath bench can tell apart (bench/README.md).
//! Each CPU writes at most `datapath_log::PER_CPU_PER_WINDOW` records a
//! second, so that a flood of rejects cannot flood the log; the rest are
//! counted.
//!
//! `tc_ingress6`'s sites go through `record6`, the same body for a record
//! with 16-byte addresses (aya-log's IPv6 address fields, printed
//! `[addr]:port`), which takes them by value (see `log6_ports`).
//!
//! The records are laid out here, at compile time, rather than by
//! aya-log-ebpf's macros: those build a record in about 230 bytes of stack
//! and many verifier steps per site, and `tc_ingress` already uses 472 of
//! the 512 bytes a program's call chain may. Here a record is one
//! constant-size copy into the ring buffer and a few stores at constant
//! offsets: every record has the same fields, the event's text last.

use aya_ebpf::{btf_maps::PerCpuArray, helpers::bpf_ktime_get_coarse_ns, macros::btf_map};
use aya_log_common::{ArgumentKind, Level, LogValueLength, RecordFieldKind};
use aya_log_ebpf::macro_support::AYA_LOGS;
use proxy_common::{PROTO_TCP, PROTO_UDP, counter, datapath_log};

use crate::{
    maps::{DATAPATH_LOG, count},
    packet::Flow,
    packet6::Flow6,
};

/// Each CPU's use of the rate limit: the window it counts in, and the
/// records written in it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LogBudget {
    pub window: u64,
    pub used: u64,
}

#[btf_map]
static LOG_BUDGET: PerCpuArray<LogBudget, 1> = PerCpuArray::new();

/// What happened. The number is what `emit` is passed.
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum Event {
    /// A TCP reset or ICMP port unreachable sent for a frontend without
    /// endpoints.
    Reject = 0,
    /// The same, when the reply could not be built: the packet was dropped.
    RejectFailed = 1,
    /// A new flow from outside a LoadBalancer's source ranges.
    SourceRange = 2,
    /// A frontend without endpoints whose policy is to drop.
    NoEndpoint = 3,
    /// No free SNAT port for a new flow.
    SnatExhausted = 4,
    /// A conntrack insert failed: the map is full.
    CtInsertFailed = 5,
    /// A later fragment that no translated first fragment explains.
    FragUntracked = 6,
    /// A packet the datapath routes itself with its TTL spent.
    Ttl = 7,
    /// A packet the datapath routes itself with no route.
    NoRoute = 8,
    /// A rewrite that could not be finished.
    Rewrite = 9,
    /// A packet longer than its route's MTU: answered with the MTU, or
    /// dropped where IPv4 may fragment it.
    TooBig = 10,
}

impl Event {
    /// The least level of `DATAPATH_LOG` that logs this event.
    #[inline(always)]
    const fn level(self) -> u32 {
        match self {
            Event::Rewrite => datapath_log::ERROR,
            Event::RejectFailed | Event::SnatExhausted | Event::CtInsertFailed | Event::NoRoute => {
                datapath_log::WARN
            }
            Event::Reject | Event::SourceRange | Event::NoEndpoint => datapath_log::INFO,
            Event::FragUntracked | Event::Ttl | Event::TooBig => datapath_log::DEBUG,
        }
    }
}

/// Logs `event` about `flow`'s packet, if the level asks for it. The
/// fields go by value: a pointer would pin the flow to a stack slot of its
/// own at every site.
#[inline(always)]
pub fn log(event: Event, flow: &Flow) {
    record(
        event,
        flow.src_be,
        flow.dst_be,
        (u32::from(flow.sport_be) << 16) | u32::from(flow.dport_be),
        u32::from(flow.proto),
    );
}

/// `log` for a packet known by its addresses only; its ports show as 0.
#[inline(always)]
pub fn log_addrs(event: Event, proto: u8, src_be: u32, dst_be: u32) {
    record(event, src_be, dst_be, 0, u32::from(proto));
}

/// `log` of an IPv6 packet.
#[inline(always)]
pub fn log6(event: Event, flow: &Flow6) {
    log6_ports(
        event,
        flow.proto,
        &flow.src_be,
        &flow.dst_be,
        (u32::from(flow.sport_be) << 16) | u32::from(flow.dport_be),
    );
}

/// `log_addrs` of an IPv6 packet.
#[inline(always)]
pub fn log6_addrs(event: Event, proto: u8, src_be: &[u32; 4], dst_be: &[u32; 4]) {
    log6_ports(event, proto, src_be, dst_be, 0);
}

/// The addresses go by value, two words each, and the event, protocol and
/// ports share the fifth register: the BPF backend of this toolchain fails
/// on an out-of-line call from `tc_ingress6` that passes pointers.
#[inline(always)]
fn log6_ports(event: Event, proto: u8, src_be: &[u32; 4], dst_be: &[u32; 4], ports_be: u32) {
    let pair = |a: u32, b: u32| u64::from(a) | (u64::from(b) << 32);
    record6(
        u64::from(event as u32) | (u64::from(proto) << 8) | (u64::from(ports_be) << 32),
        pair(src_be[0], src_be[1]),
        pair(src_be[2], src_be[3]),
        pair(dst_be[0], dst_be[1]),
        pair(dst_be[2], dst_be[3]),
    );
}

/// `record` of IPv6 packets: `what` is the event (low byte), the protocol
/// (next byte) and the ports (high half, as `emit` takes them).
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text")]
fn record6(what: u64, src_lo: u64, src_hi: u64, dst_lo: u64, dst_hi: u64) {
    let event = (what & 0xff) as u32;
    if event < EVENTS as u32 && enabled_level(EVENT_LEVELS[event as usize]) {
        // By value (`move`): a captured reference would put the words in
        // stack slots, on a call chain with few to spare.
        emit6(
            event,
            (what >> 32) as u32,
            ((what >> 8) & 0xff) as u32,
            move |out, t| {
                out[t.src_at..t.src_at + 8].copy_from_slice(&src_lo.to_ne_bytes());
                out[t.src_at + 8..t.src_at + 16].copy_from_slice(&src_hi.to_ne_bytes());
                out[t.dst_at..t.dst_at + 8].copy_from_slice(&dst_lo.to_ne_bytes());
                out[t.dst_at + 8..t.dst_at + 16].copy_from_slice(&dst_hi.to_ne_bytes());
            },
        );
    }
}

/// The one body of every site (see the module's documentation). In
/// `.text`, with the other functions the programs call, rather than the
/// `.text.unlikely.` the compiler gives cold ones.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text")]
fn record(event: Event, src_be: u32, dst_be: u32, ports_be: u32, proto: u32) {
    if enabled(event) {
        emit(event as u32, src_be, dst_be, ports_be, proto);
    }
}

/// Whether the level in `DATAPATH_LOG` asks for `event`.
#[inline(always)]
fn enabled(event: Event) -> bool {
    enabled_level(event.level())
}

/// Whether the level in `DATAPATH_LOG` asks for events of `level`.
#[inline(always)]
fn enabled_level(level: u32) -> bool {
    // SAFETY: a valid array value pointer for this program's run.
    let set = DATAPATH_LOG
        .get_ptr(0)
        .map_or(datapath_log::OFF, |p| unsafe { *p });
    set >= level
}

/// Whether this CPU may write one more record in the current window.
#[inline(always)]
fn within_rate() -> bool {
    let Some(budget) = LOG_BUDGET.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: a helper that takes no pointers and has no preconditions.
    let window = unsafe { bpf_ktime_get_coarse_ns() } / datapath_log::WINDOW_NS;
    // SAFETY: this CPU's slot; nothing else runs on it meanwhile.
    let budget = unsafe { &mut *budget };
    if budget.window != window {
        budget.window = window;
        budget.used = 0;
    }
    if budget.used >= u64::from(datapath_log::PER_CPU_PER_WINDOW) {
        return false;
    }
    budget.used += 1;
    true
}

/// Bytes reserved for a record: its fields and the longest text.
const RECORD: usize = 192;
const _: () = assert!(RECORD.is_multiple_of(8));
/// The same for an IPv6 packet's record: 24 more bytes of addresses, and
/// brackets around them.
const RECORD6: usize = 216;
const _: () = assert!(RECORD6.is_multiple_of(8));
/// Room for an event's text.
const TEXT_MAX: usize = 64;
const EVENTS: usize = 11;

/// What each event says after `proto src:port -> dst:port`, by `Event`.
const TEXTS: [&str; EVENTS] = [
    ": reject sent, no endpoints",
    ": reject could not be built, dropped",
    ": dropped, source outside loadBalancerSourceRanges",
    ": dropped, no endpoints",
    ": dropped, SNAT ports exhausted",
    ": conntrack full, flow not tracked",
    ": later fragment without a translated first one, passed",
    ": dropped, TTL spent",
    ": dropped, no route",
    ": dropped, rewrite not finished",
    ": longer than the route's MTU, answered with it",
];

/// `DATAPATH_LOG`'s least level of each event, by `Event`.
const EVENT_LEVELS: [u32; EVENTS] = {
    let mut levels = [0; EVENTS];
    let mut i = 0;
    while i < EVENTS {
        levels[i] = ALL_EVENTS[i].level();
        i += 1;
    }
    levels
};

const ALL_EVENTS: [Event; EVENTS] = [
    Event::Reject,
    Event::RejectFailed,
    Event::SourceRange,
    Event::NoEndpoint,
    Event::SnatExhausted,
    Event::CtInsertFailed,
    Event::FragUntracked,
    Event::Ttl,
    Event::NoRoute,
    Event::Rewrite,
    Event::TooBig,
];

/// aya-log's level of each event, by `Event`.
const LEVELS: [u8; EVENTS] = {
    let events = ALL_EVENTS;
    let mut levels = [0u8; EVENTS];
    let mut i = 0;
    while i < EVENTS {
        assert!(events[i] as usize == i, "events in discriminant order");
        levels[i] = match events[i].level() {
            datapath_log::ERROR => Level::Error as u8,
            datapath_log::WARN => Level::Warn as u8,
            datapath_log::INFO => Level::Info as u8,
            _ => Level::Debug as u8,
        };
        i += 1;
    }
    levels
};

/// The texts, each padded to `TEXT_MAX`, so that one copy of constant
/// size takes any of them.
static PADDED_TEXTS: [[u8; TEXT_MAX]; EVENTS] = {
    let mut out = [[0u8; TEXT_MAX]; EVENTS];
    let mut e = 0;
    while e < EVENTS {
        let text = TEXTS[e].as_bytes();
        assert!(text.len() <= TEXT_MAX, "an event's text is too long");
        let mut i = 0;
        while i < text.len() {
            out[e][i] = text[i];
            i += 1;
        }
        e += 1;
    }
    out
};

static TEXT_LENS: [u8; EVENTS] = {
    let mut out = [0u8; EVENTS];
    let mut e = 0;
    while e < EVENTS {
        out[e] = TEXTS[e].len() as u8;
        e += 1;
    }
    out
};

/// A record with every field but the event's, and where the fields that
/// change go.
struct Template<const N: usize> {
    bytes: Record<N>,
    level_at: usize,
    proto_at: usize,
    src_at: usize,
    sport_at: usize,
    dst_at: usize,
    dport_at: usize,
    /// Where the text field starts (its kind, then its length, then it).
    text_at: usize,
}

/// A record's bytes, aligned so that a copy of them is 8-byte words (a
/// copy the compiler writes out, where an unaligned one of this size
/// becomes a call to a byte loop the verifier walks byte by byte).
#[repr(C, align(8))]
struct Record<const N: usize>([u8; N]);

/// Writes one aya-log field (kind, native-order u16 length, value) at
/// `at`; returns where its value starts and where the next field does.
const fn field<const N: usize>(
    out: &mut [u8; N],
    at: usize,
    kind: u8,
    value: &[u8],
) -> (usize, usize) {
    out[at] = kind;
    let len = (value.len() as LogValueLength).to_ne_bytes();
    out[at + 1] = len[0];
    out[at + 2] = len[1];
    let mut i = 0;
    while i < value.len() {
        out[at + 3 + i] = value[i];
        i += 1;
    }
    (at + 3, at + 3 + value.len())
}

/// IPv4's record: `tcp 10.0.0.1:80 -> 10.0.0.2:8080: <text>`.
const TEMPLATE: Template<RECORD> = template(false);
/// IPv6's: `tcp [fd00::1]:80 -> [fd00::2]:8080: <text>`, which aya-log's
/// reader prints from 16-byte address fields.
const TEMPLATE6: Template<RECORD6> = template(true);

const fn template<const N: usize>(v6: bool) -> Template<N> {
    let mut b = [0u8; N];
    let str_kind = ArgumentKind::Str as u8;
    let (addr_kind, addr, open, close, arrow): (u8, &[u8], &[u8], &[u8], &[u8]) = if v6 {
        (
            ArgumentKind::Ipv6Addr as u8,
            &[0; 16],
            b" [",
            b"]:",
            b" -> [",
        )
    } else {
        (ArgumentKind::Ipv4Addr as u8, &[0; 4], b" ", b":", b" -> ")
    };
    // The size field comes first; it is written per record.
    let at = size_of::<LogValueLength>();
    let (_, at) = field(&mut b, at, RecordFieldKind::Target as u8, b"datapath");
    let (level_at, at) = field(
        &mut b,
        at,
        RecordFieldKind::Level as u8,
        &[Level::Info as u8],
    );
    let (_, at) = field(
        &mut b,
        at,
        RecordFieldKind::Module as u8,
        b"proxy_ebpf::event_log",
    );
    let (_, at) = field(&mut b, at, RecordFieldKind::File as u8, b"event_log.rs");
    let (_, at) = field(&mut b, at, RecordFieldKind::Line as u8, &0u32.to_ne_bytes());
    let (_, at) = field(
        &mut b,
        at,
        RecordFieldKind::NumArgs as u8,
        &10u32.to_ne_bytes(),
    );
    let (proto_at, at) = field(&mut b, at, str_kind, b"tcp");
    let (_, at) = field(&mut b, at, str_kind, open);
    let (src_at, at) = field(&mut b, at, addr_kind, addr);
    let (_, at) = field(&mut b, at, str_kind, close);
    let (sport_at, at) = field(&mut b, at, ArgumentKind::U16 as u8, &[0; 2]);
    let (_, at) = field(&mut b, at, str_kind, arrow);
    let (dst_at, at) = field(&mut b, at, addr_kind, addr);
    let (_, at) = field(&mut b, at, str_kind, close);
    let (dport_at, at) = field(&mut b, at, ArgumentKind::U16 as u8, &[0; 2]);
    assert!(at + 3 + TEXT_MAX <= N, "record too small");
    b[at] = str_kind;
    Template {
        bytes: Record(b),
        level_at,
        proto_at,
        src_at,
        sport_at,
        dst_at,
        dport_at,
        text_at: at,
    }
}

/// Three letters, the length of the template's protocol field.
#[inline(always)]
fn proto_name(proto: u32) -> [u8; 3] {
    match proto as u8 {
        PROTO_TCP => *b"tcp",
        PROTO_UDP => *b"udp",
        _ => *b"ip ",
    }
}

/// Writes one record, within the rate limit. Inlined into `record`, so
/// that a record costs one frame below the site's, not two: `tc_ingress`
/// leaves `record` 32 of the 512 bytes of stack a call chain may use.
/// Addresses and ports come as the packet carries them (network order),
/// the ports as source << 16 | destination.
#[inline(always)]
fn emit(event: u32, src_be: u32, dst_be: u32, ports_be: u32, proto: u32) {
    let event = event as usize;
    if event >= EVENTS {
        return;
    }
    if !within_rate() {
        count(counter::LOG_RATE_LIMITED);
        return;
    }
    let Some(mut buf) = AYA_LOGS.reserve_bytes(RECORD, 0) else {
        // The agent is behind by 128 KiB of records: this one is lost.
        return;
    };
    let Some(out) = buf.get_mut(..RECORD) else {
        buf.discard(0);
        return;
    };
    let t = &TEMPLATE;
    #[expect(
        clippy::cast_ptr_alignment,
        reason = "`Template` is `align(8)` and ring buffer records start 8-aligned"
    )]
    // SAFETY: `out` is RECORD bytes; ring buffer records start 8-aligned,
    // and RECORD is a multiple of 8.
    unsafe {
        core::ptr::copy_nonoverlapping(
            t.bytes.0.as_ptr().cast::<u64>(),
            out.as_mut_ptr().cast::<u64>(),
            RECORD / 8,
        );
    };
    out[t.level_at] = LEVELS[event];
    out[t.proto_at..t.proto_at + 3].copy_from_slice(&proto_name(proto));
    out[t.src_at..t.src_at + 4].copy_from_slice(&src_be.to_ne_bytes());
    let sport = u16::from_be((ports_be >> 16) as u16);
    out[t.sport_at..t.sport_at + 2].copy_from_slice(&sport.to_ne_bytes());
    out[t.dst_at..t.dst_at + 4].copy_from_slice(&dst_be.to_ne_bytes());
    let dport = u16::from_be(ports_be as u16);
    out[t.dport_at..t.dport_at + 2].copy_from_slice(&dport.to_ne_bytes());
    let len = TEXT_LENS[event] as usize;
    let len_bytes = (len as LogValueLength).to_ne_bytes();
    out[t.text_at + 1] = len_bytes[0];
    out[t.text_at + 2] = len_bytes[1];
    out[t.text_at + 3..t.text_at + 3 + TEXT_MAX].copy_from_slice(&PADDED_TEXTS[event]);
    let size = ((t.text_at + 3 + len) as LogValueLength).to_ne_bytes();
    out[0] = size[0];
    out[1] = size[1];
    buf.submit(0);
}

/// `emit` of an IPv6 packet's record (`TEMPLATE6`), whose addresses
/// `addrs` writes; `event` is below `EVENTS`.
#[inline(always)]
fn emit6(event: u32, ports_be: u32, proto: u32, addrs: impl FnOnce(&mut [u8], &Template<RECORD6>)) {
    let event = event as usize;
    if event >= EVENTS {
        return;
    }
    if !within_rate() {
        count(counter::LOG_RATE_LIMITED);
        return;
    }
    let Some(mut buf) = AYA_LOGS.reserve_bytes(RECORD6, 0) else {
        return;
    };
    let Some(out) = buf.get_mut(..RECORD6) else {
        buf.discard(0);
        return;
    };
    let t = &TEMPLATE6;
    #[expect(
        clippy::cast_ptr_alignment,
        reason = "`Template` is `align(8)` and ring buffer records start 8-aligned"
    )]
    // SAFETY: as in `emit`, for RECORD6 bytes.
    unsafe {
        core::ptr::copy_nonoverlapping(
            t.bytes.0.as_ptr().cast::<u64>(),
            out.as_mut_ptr().cast::<u64>(),
            RECORD6 / 8,
        );
    };
    out[t.level_at] = LEVELS[event];
    out[t.proto_at..t.proto_at + 3].copy_from_slice(&proto_name(proto));
    addrs(out, t);
    let sport = u16::from_be((ports_be >> 16) as u16);
    out[t.sport_at..t.sport_at + 2].copy_from_slice(&sport.to_ne_bytes());
    let dport = u16::from_be(ports_be as u16);
    out[t.dport_at..t.dport_at + 2].copy_from_slice(&dport.to_ne_bytes());
    let len = TEXT_LENS[event] as usize;
    let len_bytes = (len as LogValueLength).to_ne_bytes();
    out[t.text_at + 1] = len_bytes[0];
    out[t.text_at + 2] = len_bytes[1];
    out[t.text_at + 3..t.text_at + 3 + TEXT_MAX].copy_from_slice(&PADDED_TEXTS[event]);
    let size = ((t.text_at + 3 + len) as LogValueLength).to_ne_bytes();
    out[0] = size[0];
    out[1] = size[1];
    buf.submit(0);
}
