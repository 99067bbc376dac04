//! The golden layouts of every `#[repr(C)]` type the kernel programs and the
//! agent share, under the `LAYOUT_VERSION` they were written for.
//!
//! Pins live under `v<LAYOUT_VERSION>/` and aya reuses a pin without checking
//! its shape (docs/maps.md, "Pins and the layout version"), so a key or value
//! that changes under an unchanged version is read with the wrong shape by
//! the other side of an upgrade. The table below is the shape of version
//! `GOLDEN_VERSION`: a change to any size, alignment or offset fails here until
//! the version moves and the table is written anew for it.

use core::mem::{align_of, offset_of, size_of};
use std::{collections::BTreeSet, fs, path::Path};

use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, Clock, ClusterCidrKey,
    Ct6Key, Ct6Value, CtKey, CtTimeouts, CtValue, FlowCache6Entry, FlowCacheEntry, FragKey,
    FragValue, LAYOUT_VERSION, NodeAddr, NodeAddrKey, NodeConfig, RefusalKey, RefusalRecord,
    RejectLimit, ServiceCounters, ServiceKey, ServiceName, ServiceValue, SockNote, SockNote6,
    SockNotes, SockNotes6, SockNotes6Record, SockNotesRecord, SourceRangeKey, TraceRecord,
    WireView, ct_reap::Header,
};

/// The layout version the table below describes.
const GOLDEN_VERSION: u32 = 5;

const MOVE_THE_VERSION: &str = "a shared layout changed: move LAYOUT_VERSION and update this table";

/// One type's shape: what it is now beside what the table says.
struct Layout {
    name: &'static str,
    size: (usize, usize),
    align: (usize, usize),
    /// Field name, offset now, offset in the table.
    fields: Vec<(&'static str, usize, usize)>,
}

/// `Type: size, align { field: offset, ... }` for each type. Every field must
/// be named: the pattern below destructures the type without `..`, so a field
/// added or renamed without a row stops this file compiling.
macro_rules! golden {
    ($($ty:ident: $size:literal, $align:literal { $($field:ident: $offset:literal),+ $(,)? })+) => {
        vec![$({
            #[expect(dead_code, reason = "a compile-time check that every field has a row")]
            fn every_field_has_a_row(v: $ty) {
                let $ty { $($field: _),+ } = v;
            }
            Layout {
                name: stringify!($ty),
                size: (size_of::<$ty>(), $size),
                align: (align_of::<$ty>(), $align),
                fields: vec![$((stringify!($field), offset_of!($ty, $field), $offset)),+],
            }
        }),+]
    };
}

fn table() -> Vec<Layout> {
    golden! {
        ServiceKey: 20, 4 { addr_be: 0, port_be: 16, proto: 18, scope: 19 }
        ServiceValue: 24, 4 {
            service_id: 0, slot_set: 4, count: 8, flags: 12, affinity_timeout_s: 16, hash_seed: 20,
        }
        // A map added to this version: older agents of it have no
        // SERVICE_NAMES pin, so the shape is new, not changed.
        ServiceName: 164, 2 { namespace: 0, name: 64, port_name: 128, port: 160, proto: 162, _pad: 163 }
        // Maps added to this version, read by no program:
        RefusalKey: 132, 4 { namespace: 0, name: 64, index: 128 }
        RefusalRecord: 272, 1 { reason: 0, text: 16 }
        // Never pinned, read by nothing: the types bpftool prints fields as.
        WireView: 400, 1 {
            bytes16: 0, bytes4: 16, bytes2: 20, proto: 22, dir: 23, scope: 24, char: 25,
            text16: 26, text32: 42, text64: 74, text256: 138, _pad: 394,
        }
        // Each agent's own, sized at its load, pinned in place of the last.
        ServiceCounters: 56, 8 { packets: 0, bytes: 16, flows: 32, rejected: 40, dropped: 44 }
        // A map added to this version, as SERVICE_NAMES; never stored
        // across agents, but read by `ebpf-proxy trace` of another release.
        TraceRecord: 64, 4 {
            service_id: 0, verdict: 4, reason: 5, proto: 6, family: 7, hook: 8, _pad: 9,
            client_port_be: 10, frontend_port_be: 12, backend_port_be: 14, client_be: 16,
            frontend_be: 32, backend_be: 48,
        }
        BackendSlotKey: 8, 4 { slot_set: 0, slot: 4 }
        BackendSlot: 4, 4 { backend_id: 0 }
        Backend: 20, 4 { addr_be: 0, port_be: 16, proto: 18, flags: 19 }
        CtKey: 16, 4 {
            src_be: 0, dst_be: 4, sport_be: 8, dport_be: 10, proto: 12, _pad0: 13, _pad1: 14,
        }
        CtValue: 40, 8 {
            nat_addr_be: 0, alt_addr_be: 4, nat_port_be: 8, alt_port_be: 10, flags: 12, dir: 13,
            path_mtu: 14, backend_id: 16, service_id: 20, created_s: 24, tcp_max_ack: 28,
            last_seen_ns: 32,
        }
        Ct6Key: 40, 4 {
            src_be: 0, dst_be: 16, sport_be: 32, dport_be: 34, proto: 36, _pad0: 37, _pad1: 38,
        }
        Ct6Value: 64, 8 {
            nat_addr_be: 0, alt_addr_be: 16, nat_port_be: 32, alt_port_be: 34, flags: 36,
            dir: 37, path_mtu: 38, backend_id: 40, service_id: 44, created_s: 48, tcp_max_ack: 52,
            last_seen_ns: 56,
        }
        FlowCacheEntry: 64, 8 { key: 0, value: 16, slot_gen: 56, epoch: 60 }
        FlowCache6Entry: 112, 8 { key: 0, value: 40, slot_gen: 104, epoch: 108 }
        Clock: 24, 8 { jiffies: 0, ns: 8, tick_ns: 16 }
        CtTimeouts: 48, 8 {
            tcp_syn_ns: 0, tcp_established_ns: 8, tcp_close_wait_ns: 16, tcp_time_wait_ns: 24,
            tcp_close_ns: 32, udp_ns: 40,
        }
        AffinityKey: 20, 4 { client_be: 0, service_id: 16 }
        AffinityValue: 16, 8 { backend_id: 0, _pad: 4, last_used_ns: 8 }
        NodeAddrKey: 16, 4 { addr_be: 0 }
        NodeAddr: 4, 4 { flags: 0 }
        NodeConfig: 28, 4 {
            snat_addr_be: 0, snat_port_min: 16, snat_port_max: 18, flags: 20, ct_source_share: 24,
        }
        RejectLimit: 24, 8 { msgs_per_sec: 0, burst: 4, configured: 8, credit: 12, stamp_ns: 16 }
        SourceRangeKey: 36, 4 { frontend: 0, client_be: 20 }
        ClusterCidrKey: 16, 4 { addr_be: 0 }
        FragKey: 40, 4 { src_be: 0, dst_be: 16, id_be: 32, proto: 36, _pad0: 37, _pad1: 38 }
        FragValue: 16, 8 { sport_be: 0, dport_be: 2, proto6: 4, seen_ns: 8 }
        SockNote: 16, 4 {
            backend_be: 0, frontend_be: 4, backend_port_be: 8, frontend_port_be: 10, how: 12,
        }
        SockNotes: 128, 4 { notes: 0 }
        SockNote6: 40, 4 {
            backend_be: 0, frontend_be: 16, backend_port_be: 32, frontend_port_be: 34, how: 36,
        }
        SockNotes6: 320, 4 { notes: 0 }
        SockNotesRecord: 136, 8 { cookie: 0, notes: 8 }
        SockNotes6Record: 328, 8 { cookie: 0, notes: 8 }
        // Never pinned: the frame the agent hands its own `ct_reap`.
        Header: 24, 8 { now_ns: 0, map: 8, keys: 12, removed: 16, _pad: 20 }
    }
}

#[test]
fn shared_layouts_are_those_of_their_layout_version() {
    assert_eq!(
        LAYOUT_VERSION, GOLDEN_VERSION,
        "LAYOUT_VERSION moved: write this table anew for the new version's layouts and move \
         GOLDEN_VERSION with it"
    );
    let mut differ = Vec::new();
    for layout in table() {
        let name = layout.name;
        let (size, golden_size) = layout.size;
        if size != golden_size {
            differ.push(format!(
                "{name}: {size} bytes, the table says {golden_size}"
            ));
        }
        let (align, golden_align) = layout.align;
        if align != golden_align {
            differ.push(format!(
                "{name}: aligned to {align}, the table says {golden_align}"
            ));
        }
        for (field, offset, golden_offset) in layout.fields {
            if offset != golden_offset {
                differ.push(format!(
                    "{name}.{field}: at offset {offset}, the table says {golden_offset}"
                ));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "{MOVE_THE_VERSION}:\n  {}",
        differ.join("\n  ")
    );
}

/// The names of the `#[repr(C)]` items declared in the Rust files under `dir`.
fn repr_c_items(dir: &Path, found: &mut BTreeSet<String>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            repr_c_items(&path, found);
            continue;
        }
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        let text =
            fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let mut lines = text.lines().map(str::trim);
        while let Some(line) = lines.next() {
            if !(line.starts_with("#[repr(C") || line.starts_with("#[repr(packed")) {
                continue;
            }
            // The item follows its attributes and doc comments.
            let item = lines
                .by_ref()
                .find(|l| !(l.starts_with("#[") || l.starts_with("//")))
                .unwrap_or_default();
            let name = item
                .split_whitespace()
                .skip_while(|word| !matches!(*word, "struct" | "union" | "enum"))
                .nth(1)
                .map(|word| {
                    word.trim_end_matches(|c: char| !c.is_alphanumeric() && c != '_' && c != '<')
                });
            let name = name.unwrap_or_else(|| {
                panic!(
                    "{}: a #[repr(C)] attribute on `{item}`, not a struct, union or enum",
                    path.display()
                )
            });
            // A generic type's layouts are its instantiations' (`GENERIC`).
            match name.split_once('<') {
                Some((generic, _)) => {
                    let (_, instances) = GENERIC
                        .iter()
                        .find(|(g, _)| *g == generic)
                        .unwrap_or_else(|| {
                            panic!(
                                "{}: generic #[repr(C)] type {generic} has no entry in GENERIC \
                                 (tests/layout.rs): name the aliases it is shared as",
                                path.display()
                            )
                        });
                    found.extend(instances.iter().map(|i| (*i).to_owned()));
                }
                None => {
                    found.insert(name.to_owned());
                }
            }
        }
    }
}

/// The generic shared types and the aliases of their instantiations, each
/// of which has its row: one type per family, one layout each.
const GENERIC: &[(&str, &[&str])] = &[
    ("CtKeyOf", &["CtKey", "Ct6Key"]),
    ("CtValueOf", &["CtValue", "Ct6Value"]),
    ("FlowCacheEntryOf", &["FlowCacheEntry", "FlowCache6Entry"]),
    ("SockNoteOf", &["SockNote", "SockNote6"]),
    ("SockNotesOf", &["SockNotes", "SockNotes6"]),
    (
        "SockNotesRecordOf",
        &["SockNotesRecord", "SockNotes6Record"],
    ),
];

#[test]
fn every_shared_type_has_a_row() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut declared = BTreeSet::new();
    repr_c_items(&src, &mut declared);
    let in_table: BTreeSet<String> = table().iter().map(|l| l.name.to_owned()).collect();
    let missing: Vec<&String> = declared.difference(&in_table).collect();
    assert!(
        missing.is_empty(),
        "#[repr(C)] types in proxy-common/src without a row in tests/layout.rs: {missing:?}; \
         {MOVE_THE_VERSION}"
    );
    // A row whose type is no longer repr(C) would keep a layout nothing promises.
    let stale: Vec<&String> = in_table.difference(&declared).collect();
    assert!(
        stale.is_empty(),
        "rows in tests/layout.rs for types proxy-common/src no longer declares #[repr(C)]: \
         {stale:?}"
    );
}
