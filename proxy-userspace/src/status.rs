//! `ebpf-proxy status`: what the pinned maps hold, readable; with
//! `--flows`, the translated flows too (`flows`).

pub mod flows;

use std::fmt::Write;

use aya::maps::{IterableMap, MapInfo};
use proxy_common::{
    AffinityKey, AffinityValue, BackendSlotKey, Ct6Key, Ct6Value, CtKey, CtValue, MAX_CT_NEW,
    map_names, service_flags,
};

use crate::{
    datapath::resize,
    datapath::{
        Maps, PinLayout, batch,
        maps::{MapsError, batch_error},
    },
    housekeeping::{sock_diag, sock_notes},
    planner::encode,
};

/// The frontends with their backends in slot order, and the counters.
#[expect(
    clippy::too_many_lines,
    reason = "the report, section by section in the order it is printed"
)]
pub fn render(pins: &PinLayout) -> Result<String, MapsError> {
    let maps = Maps::open_pinned(pins)?;
    let stored = maps.read_service_state()?;
    let mut out = String::new();
    let mut rows: Vec<_> = stored.services.iter().collect();
    rows.sort_by_key(|(k, _)| encode::service_key_string(k));
    let _ = writeln!(
        out,
        "{} frontends, {} backends",
        rows.len(),
        stored.backends.len()
    );
    for (key, value) in rows {
        let mut notes = Vec::new();
        if value.flags & service_flags::AFFINITY != 0 {
            notes.push(format!("affinity {}s", value.affinity_timeout_s));
        }
        if value.flags & service_flags::SOURCE_RANGES != 0 {
            let ranges: Vec<String> = stored
                .source_ranges
                .iter()
                .filter(|(_, k)| k.frontend == *key)
                .map(|entry| {
                    let text = encode::source_range_string(entry);
                    text.rsplit(" from ").next().unwrap_or_default().to_string()
                })
                .collect();
            notes.push(format!("from {}", ranges.join(" ")));
        }
        if value.count == 0 {
            notes.push(if value.flags & service_flags::NO_EP_DROP != 0 {
                "no endpoints: drop".to_string()
            } else {
                "no endpoints: reject".to_string()
            });
        }
        let backends: Vec<String> = (0..value.count)
            .map(|slot| {
                let sk = BackendSlotKey {
                    slot_set: value.slot_set,
                    slot,
                };
                match stored.slots.get(&sk).and_then(|id| stored.backends.get(id)) {
                    Some(b) => encode::backend_string(b),
                    None => format!("<slot {slot} missing>"),
                }
            })
            .collect();
        let _ = writeln!(
            out,
            "{} (service id {}){}{} -> {}",
            encode::service_key_string(key),
            value.service_id,
            if notes.is_empty() { "" } else { " " },
            notes.join(", "),
            if backends.is_empty() {
                "-".to_string()
            } else {
                backends.join(" ")
            }
        );
    }
    let node: Vec<String> = maps
        .node_addrs
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| {
            let ip = encode::words_addr(&k.addr_be);
            if v.flags & proxy_common::node_addr_flags::NODEPORT != 0 {
                format!("{ip} (NodePorts)")
            } else {
                ip.to_string()
            }
        })
        .collect();
    let _ = writeln!(out, "node addresses: {}", node.join(", "));
    if let Ok(config) = maps.node_config.get(&0, 0) {
        let _ = writeln!(
            out,
            "SNAT to {} ports {}-{}",
            encode::words_addr(&config.snat_addr_be),
            config.snat_port_min,
            config.snat_port_max
        );
        let localhost = config.flags & proxy_common::node_config_flags::LOCALHOST_NODEPORTS != 0;
        let _ = writeln!(
            out,
            "localhost NodePorts: {}",
            if localhost { "on" } else { "off" }
        );
    }
    if let Some(Ok(config6)) = maps.node_config6.as_ref().map(|m| m.get(&0, 0)) {
        let _ = match config6.snat_addr_be {
            [0, 0, 0, 0] => writeln!(out, "node IPv6 address: none"),
            addr => writeln!(out, "node IPv6 address: {}", encode::words_addr(&addr)),
        };
    }
    if let Ok(clock) = maps.clock.get(&proxy_common::clock_slot::IN_FORCE, 0) {
        let _ = match clock.tick_ns {
            0 => writeln!(out, "datapath clock: coarse monotonic (not calibrated)"),
            tick => writeln!(
                out,
                "datapath clock: jiffies x {tick} ns (HZ {})",
                (1_000_000_000 + tick / 2) / tick
            ),
        };
    }
    let mut links: Vec<String> = std::fs::read_dir(pins.links_dir())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    links.sort();
    let _ = writeln!(out, "attached: {}", links.join(", "));
    // In chunks: a table of a million entries read one at a time would take
    // seconds.
    let entries = batch::count::<CtKey, CtValue>(maps.conntrack.map(), batch::CHUNK)
        .map_err(batch_error(map_names::CONNTRACK))?;
    let _ = match resize::capacity(&pins.maps_dir()) {
        Ok(capacity) => writeln!(
            out,
            "conntrack entries: {entries} of {capacity} ({} connections)",
            capacity / 2
        ),
        Err(_) => writeln!(out, "conntrack entries: {entries}"),
    };
    let unassured = batch::count::<CtKey, CtValue>(maps.ct_new.map(), batch::CHUNK)
        .map_err(batch_error(map_names::CT_NEW))?;
    let _ = writeln!(
        out,
        "unassured conntrack entries: {unassured} of {MAX_CT_NEW} (flows whose handshake or first exchange is under way)"
    );
    let flows6 = match &maps.conntrack6 {
        Some(map) => batch::count::<Ct6Key, Ct6Value>(map.map(), batch::CHUNK)
            .map_err(batch_error(map_names::CONNTRACK6))?,
        None => 0,
    };
    let unassured6 = match &maps.ct_new6 {
        Some(map) => batch::count::<Ct6Key, Ct6Value>(map.map(), batch::CHUNK)
            .map_err(batch_error(map_names::CT_NEW6))?,
        None => 0,
    };
    let _ = writeln!(out, "{}", socket_notes(pins));
    let affinity = batch::count::<AffinityKey, AffinityValue>(maps.affinity.map(), batch::CHUNK)
        .map_err(batch_error(map_names::AFFINITY))?;
    for (name, entries) in [
        (map_names::SERVICES, stored.services.len()),
        (map_names::BACKEND_SLOTS, stored.slots.len()),
        (map_names::BACKENDS, stored.backends.len()),
        (map_names::SOURCE_RANGES, stored.source_ranges.len()),
        (map_names::AFFINITY, affinity),
        (map_names::CONNTRACK, entries),
        (map_names::CT_NEW, unassured),
        (map_names::CONNTRACK6, flows6),
        (map_names::CT_NEW6, unassured6),
    ] {
        let _ = writeln!(out, "{}", fill(pins, name, entries));
    }
    if let Some(prefilter) = &maps.prefilter {
        let ones = prefilter.ones();
        let _ = writeln!(
            out,
            "prefilter: {ones} of {} bits set ({:.2}%)",
            proxy_common::prefilter::BITS,
            100.0 * f64::from(ones) / f64::from(proxy_common::prefilter::BITS)
        );
    }
    for (name, value) in maps.counters()? {
        let _ = writeln!(out, "counter {name}: {value}");
    }
    Ok(out)
}

/// `render`, then every translated flow in conntrack, one a line
/// (`flows`).
pub fn render_with_flows(pins: &PinLayout) -> Result<String, MapsError> {
    let mut out = render(pins)?;
    let flows = flows::read(&Maps::open_pinned(pins)?)?;
    let _ = writeln!(
        out,
        "flows: {} (client -> frontend => backend)",
        flows.len()
    );
    for flow in flows {
        let _ = writeln!(out, "flow {flow}");
    }
    Ok(out)
}

/// `map fill NAME: entries of capacity (percent)`: how close a map is to
/// refusing writes (docs/maps.md, "Sizes").
fn fill(pins: &PinLayout, name: &str, entries: usize) -> String {
    match MapInfo::from_pin(pins.map(name)).map(|info| info.max_entries()) {
        Ok(capacity) if capacity > 0 => format!(
            "map fill {name}: {entries} of {capacity} ({:.1}%)",
            100.0 * entries as f64 / f64::from(capacity)
        ),
        Ok(_) => format!("map fill {name}: {entries}"),
        Err(e) => format!("map fill {name}: {entries} of unknown capacity ({e})"),
    }
}

/// How many UDP sockets of this network namespace (the node's, where status
/// is run) hold the socket hooks' notes (they live in the sockets
/// themselves, `SOCK_NOTES` and `SOCK_NOTES6`), and how many of them, IPv4 or
/// IPv6, the `connect()` hook connected. The IPv6
/// notes count where their iterator is pinned (an agent of this version).
fn socket_notes(pins: &PinLayout) -> String {
    let notes = match sock_notes::read(&pins.sock_notes()) {
        Ok(notes) => notes,
        Err(e) => return format!("sockets with socket hook notes: unknown ({e})"),
    };
    let notes6 = sock_notes::read6(&pins.sock_notes6()).unwrap_or_default();
    let holding: std::collections::HashSet<u64> = notes.cookies().chain(notes6.cookies()).collect();
    let connected = sock_diag::SockDiag::open()
        .and_then(|mut diag| diag.connected_udp())
        .map_or_else(
            |e| format!("unknown ({e})"),
            |sockets| {
                let n = sockets
                    .iter()
                    .filter(|s| s.hook_connected(&notes, &notes6))
                    .count();
                n.to_string()
            },
        );
    format!(
        "sockets with socket hook notes: {} (connected UDP sockets here connected by the hook: {connected})",
        holding.len()
    )
}
