//! A conntrack map of another capacity than `--conntrack-max` asks for: the
//! flag changed since the maps were pinned. aya would reuse the pinned map
//! as it is, so before loading, that map's pin is moved aside and the load
//! creates one of the asked size in its place. Its flows are copied over
//! twice: once before this agent's programs take over the links (the older
//! ones go on translating with the set-aside map until then), and once
//! after, for the flows those made meanwhile. Then the set-aside pin goes.

use std::path::{Path, PathBuf};

use aya::maps::{MapData, MapError, MapInfo};
use proxy_common::{Ct6Key, Ct6Value, CtKey, CtValue, ct_flags, map_names};

use super::{
    batch::{self, BatchError},
    maps::Maps,
};

#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    #[error("reading the pinned conntrack map {path}: {source}")]
    Info {
        path: String,
        #[source]
        source: MapError,
    },
    #[error("moving the pinned conntrack map {path} aside: {source}")]
    Rename {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the set-aside conntrack map {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: BatchError,
    },
    #[error("opening the set-aside conntrack map {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: MapError,
    },
}

/// Where the older conntrack map waits while its flows are copied (bpffs
/// refuses names with a dot).
fn aside_path(pin: &Path) -> PathBuf {
    let mut name = pin.file_name().unwrap_or_default().to_os_string();
    name.push("-resizing");
    pin.with_file_name(name)
}

/// A conntrack map being replaced by one of another size.
#[derive(Debug)]
pub struct Resize {
    aside: PathBuf,
    /// `CONNTRACK6`'s rather than `CONNTRACK`'s.
    v6: bool,
    /// Capacities in entries, before and after; `from` is None for a map
    /// set aside by an agent that stopped before it finished.
    pub from: Option<u32>,
    pub to: u32,
}

/// Before the load: moves the conntrack map pinned at `pin` aside when its
/// capacity is not `entries`. Also picks up a map an earlier agent set aside
/// and did not finish with. None when there is nothing to carry over.
pub fn set_aside(pin: &Path, entries: u32) -> Result<Option<Resize>, ResizeError> {
    let aside = aside_path(pin);
    let mut from = None;
    if pin.exists() {
        let capacity = pinned_capacity(pin)?;
        if capacity != entries {
            // A set-aside map still there is older than the pinned one,
            // whose flows it would overwrite: the pinned one's win.
            let _ = std::fs::remove_file(&aside);
            std::fs::rename(pin, &aside).map_err(|source| ResizeError::Rename {
                path: pin.display().to_string(),
                source,
            })?;
            from = Some(capacity);
        }
    }
    Ok(aside.exists().then_some(Resize {
        aside,
        v6: false,
        from,
        to: entries,
    }))
}

/// `set_aside` for the IPv6 conntrack map pinned at `pin`.
pub fn set_aside6(pin: &Path, entries: u32) -> Result<Option<Resize>, ResizeError> {
    Ok(set_aside(pin, entries)?.map(|r| Resize { v6: true, ..r }))
}

impl Resize {
    /// Copies the set-aside map's flows into `maps`' conntrack, keeping any
    /// entry the new datapath already made for the same tuple. Returns how
    /// many were copied. The ids in the entries stay valid: the maps they
    /// refer to are the same pinned ones.
    pub fn carry(&self, maps: &mut Maps) -> Result<usize, ResizeError> {
        let path = self.aside.display().to_string();
        let older = MapData::from_pin(&self.aside).map_err(|source| ResizeError::Open {
            path: path.clone(),
            source,
        })?;
        if self.v6 {
            let mut entries: Vec<(Ct6Key, Ct6Value)> = Vec::new();
            batch::for_each_chunk(
                &older,
                batch::CHUNK,
                |keys: &[Ct6Key], values: &[Ct6Value]| {
                    entries.extend(keys.iter().copied().zip(values.iter().copied()));
                },
            )
            .map_err(|source| ResizeError::Read { path, source })?;
            return Ok(carry_in6(maps, entries));
        }
        let mut entries: Vec<(CtKey, CtValue)> = Vec::new();
        batch::for_each_chunk(
            &older,
            batch::CHUNK,
            |keys: &[CtKey], values: &[CtValue]| {
                entries.extend(keys.iter().copied().zip(values.iter().copied()));
            },
        )
        .map_err(|source| ResizeError::Read { path, source })?;
        Ok(carry_in(maps, entries))
    }

    /// Copies what the older programs added since `carry`, then unpins the
    /// set-aside map (the kernel frees it with its last program).
    pub fn finish(self, maps: &mut Maps) -> Result<usize, ResizeError> {
        let carried = self.carry(maps)?;
        if let Err(e) = std::fs::remove_file(&self.aside) {
            tracing::warn!(pin = %self.aside.display(), error = %e, "removing the set-aside conntrack map");
        }
        Ok(carried)
    }
}

/// The capacity in entries of the conntrack map pinned under `maps_dir`.
pub fn capacity(maps_dir: &Path) -> Result<u32, ResizeError> {
    pinned_capacity(&maps_dir.join(map_names::CONNTRACK))
}

/// The capacity in entries of the map pinned at `pin`.
fn pinned_capacity(pin: &Path) -> Result<u32, ResizeError> {
    MapInfo::from_pin(pin)
        .map(|info| info.max_entries())
        .map_err(|source| ResizeError::Info {
            path: pin.display().to_string(),
            source,
        })
}

/// Inserts `flows` into this agent's conntrack of assured flows, each only
/// where the datapath has no entry of its own for the tuple yet (carried
/// over from an older map: a resized one, or an older layout's, which knew
/// no unassured flows). Returns how many went in.
pub fn carry_in(maps: &mut Maps, flows: impl IntoIterator<Item = (CtKey, CtValue)>) -> usize {
    const BPF_NOEXIST: u64 = 1;
    // Before flows go in that the datapath did not mark, so that their
    // replies pass from the first.
    maps.open_flow_marks();
    let carried = flows
        .into_iter()
        .map(|(key, value)| {
            let assured = CtValue {
                flags: value.flags | ct_flags::ASSURED,
                ..value
            };
            (key, assured)
        })
        .filter(|(key, value)| maps.conntrack.insert(key, value, BPF_NOEXIST).is_ok())
        .count();
    carried_in(maps, carried)
}

/// Voids the flow cache's absent copies of the flows just carried in, which
/// the programs running since the load may have taken (a packet of such a
/// flow before its entry came). One that outlives a failed bump is good
/// for a second at most (`proxy_common::FLOW_CACHE_ABSENT`).
fn carried_in(maps: &mut Maps, carried: usize) -> usize {
    if carried > 0
        && let Err(e) = maps.bump_flow_epoch()
    {
        tracing::warn!(error = %e, carried, "voiding the flow cache after carrying flows in");
    }
    carried
}

/// `carry_in` for IPv6 flows, into `CONNTRACK6`, assured as IPv4's are
/// (an older map held IPv6 flows assured or not).
pub fn carry_in6(maps: &mut Maps, flows: impl IntoIterator<Item = (Ct6Key, Ct6Value)>) -> usize {
    const BPF_NOEXIST: u64 = 1;
    // Before flows go in that the datapath did not mark, so that their
    // replies pass from the first.
    maps.open_flow_marks();
    let Some(map) = &mut maps.conntrack6 else {
        return 0;
    };
    let carried = flows
        .into_iter()
        .map(|(key, value)| {
            let assured = Ct6Value {
                flags: value.flags | ct_flags::ASSURED,
                ..value
            };
            (key, assured)
        })
        .filter(|(key, value)| map.insert(key, value, BPF_NOEXIST).is_ok())
        .count();
    carried_in(maps, carried)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_aside_pin_sits_beside_the_map() {
        assert_eq!(
            aside_path(Path::new("/sys/fs/bpf/ebpf-proxy/v3/maps/CONNTRACK")),
            Path::new("/sys/fs/bpf/ebpf-proxy/v3/maps/CONNTRACK-resizing")
        );
    }
}
