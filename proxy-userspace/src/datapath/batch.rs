//! Batched reads and deletes of hash maps (`BPF_MAP_LOOKUP_BATCH`,
//! `BPF_MAP_DELETE_BATCH`, kernel 5.6+), which aya does not wrap. Reading a
//! map of 240,000 conntrack entries one by one takes two system calls per
//! entry (next key, then value): about 0.8 s of CPU on a 2-core node, every
//! reap period, taken from the traffic it serves. In chunks it is a few
//! dozen calls.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::maps::MapData;
use bytemuck::Pod;

use super::sys;

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// The `batch` member of `union bpf_attr` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("{op} on map fd {fd}: {source}")]
    Syscall {
        op: &'static str,
        fd: u32,
        #[source]
        source: std::io::Error,
    },
}

impl BatchError {
    /// The kernel has no such batch operation (before 5.6, or not for this
    /// kind of map).
    pub fn unsupported(&self) -> bool {
        let BatchError::Syscall { source, .. } = self;
        // ENOTSUPP, the kernel-internal 524 that reaches user space here.
        matches!(
            source.raw_os_error(),
            Some(libc::EINVAL | libc::EOPNOTSUPP | 524)
        )
    }
}

fn fd_of(map: &MapData) -> u32 {
    map.fd().as_fd().as_raw_fd() as u32
}

/// Entries read per call in a pass over a map: a few dozen calls for a full
/// conntrack table.
pub const CHUNK: usize = 4096;

/// Calls `f` with every entry of the hash map `map` (keys `K`, values `V`),
/// `chunk` at a time. `f` may delete entries it has been given.
pub fn for_each_chunk<K: Pod, V: Pod>(
    map: &MapData,
    chunk: usize,
    mut f: impl FnMut(&[K], &[V]),
) -> Result<(), BatchError> {
    let fd = fd_of(map);
    let mut keys = vec![K::zeroed(); chunk];
    let mut values = vec![V::zeroed(); chunk];
    // The kernel's position in the map between calls: a bucket index for
    // hash maps.
    let (mut position, mut next) = (0u64, 0u64);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &raw const position as u64 },
            out_batch: &raw mut next as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: keys.len() as u32,
            map_fd: fd,
            ..Default::default()
        };
        // SAFETY: the buffers hold `count` keys and values of the map's types.
        let result = unsafe { sys::bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let n = (attr.count as usize).min(keys.len());
        match result {
            Ok(_) => {}
            // The last chunk (possibly empty).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                f(&keys[..n], &values[..n]);
                return Ok(());
            }
            // A bucket with more entries than the buffers hold.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && n == 0 => {
                let bigger = keys.len() * 2;
                keys.resize(bigger, K::zeroed());
                values.resize(bigger, V::zeroed());
                continue;
            }
            Err(source) => {
                return Err(BatchError::Syscall {
                    op: "BPF_MAP_LOOKUP_BATCH",
                    fd,
                    source,
                });
            }
        }
        f(&keys[..n], &values[..n]);
        position = next;
        first = false;
    }
}

/// How many entries the hash map `map` (keys `K`, values `V`) holds, read
/// `chunk` at a time.
pub fn count<K: Pod, V: Pod>(map: &MapData, chunk: usize) -> Result<usize, BatchError> {
    let mut n = 0;
    for_each_chunk(map, chunk, |keys: &[K], _: &[V]| n += keys.len())?;
    Ok(n)
}

/// The keys of the entries of the hash map `map` that `pick` chooses, read
/// `chunk` at a time.
pub fn keys_where<K: Pod, V: Pod>(
    map: &MapData,
    chunk: usize,
    mut pick: impl FnMut(&K, &V) -> bool,
) -> Result<Vec<K>, BatchError> {
    let mut picked = Vec::new();
    for_each_chunk(map, chunk, |keys: &[K], values: &[V]| {
        picked.extend(
            keys.iter()
                .zip(values)
                .filter(|(k, v)| pick(k, v))
                .map(|(k, _)| *k),
        );
    })?;
    Ok(picked)
}

/// Deletes `keys` from the hash map `map`; keys already gone are skipped.
/// Returns how many were deleted.
pub fn delete<K: Pod>(map: &MapData, keys: &[K]) -> Result<usize, BatchError> {
    let fd = fd_of(map);
    let mut deleted = 0;
    let mut rest = keys;
    while !rest.is_empty() {
        let mut attr = BatchAttr {
            keys: rest.as_ptr() as u64,
            count: rest.len() as u32,
            map_fd: fd,
            ..Default::default()
        };
        // SAFETY: `keys` holds `count` keys of the map's key type.
        let result = unsafe { sys::bpf(BPF_MAP_DELETE_BATCH, &mut attr) };
        let done = (attr.count as usize).min(rest.len());
        deleted += done;
        match result {
            Ok(_) => return Ok(deleted),
            // The kernel stops at a key that is not there: skip it.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                rest = rest.get(done + 1..).unwrap_or_default();
            }
            Err(source) => {
                return Err(BatchError::Syscall {
                    op: "BPF_MAP_DELETE_BATCH",
                    fd,
                    source,
                });
            }
        }
    }
    Ok(deleted)
}

/// The element member of `union bpf_attr`, for `BPF_MAP_UPDATE_ELEM`.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Writes `keys[i]` → `values[i]` into the hash map behind `fd` in one call
/// (`BPF_MAP_UPDATE_BATCH`), in order; one call per entry on a kernel
/// without batched writes (before 5.6). On a failure, how many were written
/// before it: those, and only those, are in the map. Takes a descriptor
/// rather than aya's map so that a thread of its own can write (see
/// `write_behind`).
pub fn update<K: Pod, V: Pod>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), (usize, BatchError)> {
    let fd = fd.as_raw_fd() as u32;
    let n = keys.len().min(values.len());
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: n as u32,
        map_fd: fd,
        ..Default::default()
    };
    // SAFETY: `keys` and `values` hold `count` keys and values of the map's
    // types, and the kernel only reads them.
    let Err(source) = (unsafe { sys::bpf(BPF_MAP_UPDATE_BATCH, &mut attr) }) else {
        return Ok(());
    };
    let landed = (attr.count as usize).min(n);
    let error = BatchError::Syscall {
        op: "BPF_MAP_UPDATE_BATCH",
        fd,
        source,
    };
    if landed != 0 || !error.unsupported() {
        return Err((landed, error));
    }
    for (i, (key, value)) in keys.iter().zip(values).enumerate() {
        let mut attr = ElemAttr {
            map_fd: fd,
            key: std::ptr::from_ref(key) as u64,
            value: std::ptr::from_ref(value) as u64,
            ..Default::default()
        };
        // SAFETY: `key` and `value` are a key and a value of the map's types.
        unsafe { sys::bpf(BPF_MAP_UPDATE_ELEM, &mut attr) }.map_err(|source| {
            (
                i,
                BatchError::Syscall {
                    op: "BPF_MAP_UPDATE_ELEM",
                    fd,
                    source,
                },
            )
        })?;
    }
    Ok(())
}
