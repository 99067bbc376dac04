//! Batched reads and deletes of hash maps (`BPF_MAP_LOOKUP_BATCH`,
//! `BPF_MAP_DELETE_BATCH`, kernel 5.6+), which aya does not wrap. Reading a
//! map of 240,000 conntrack entries one by one takes two system calls per
//! entry (next key, then value): about 0.8 s of CPU on a 2-core node, every
//! reap period, taken from the traffic it serves. In chunks it is a few
//! dozen calls.
//!
//! The kernel reads and writes these buffers by the map's own key and value
//! sizes and the count it is given: every call first checks that the Rust
//! types are exactly the map's sizes and that the counts are what the
//! buffers hold ([`check_layout`]), and refuses otherwise rather than let the
//! kernel write past a buffer.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::maps::MapData;
use bytemuck::Pod;

use super::sys;

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
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
    #[error(
        "{op} on map fd {fd}: the map's keys are {map_key} bytes and its values {map_value}, the buffers' {key} and {value}; refused"
    )]
    Layout {
        op: &'static str,
        fd: u32,
        key: usize,
        value: usize,
        map_key: u32,
        map_value: u32,
    },
    #[error("{op}: {keys} keys against {values} values, or more than one call can take; refused")]
    Count {
        op: &'static str,
        keys: usize,
        values: usize,
    },
}

impl BatchError {
    /// The kernel has no such batch operation (before 5.6, or not for this
    /// kind of map).
    pub fn unsupported(&self) -> bool {
        // ENOTSUPP, the kernel-internal 524 that reaches user space here.
        matches!(
            self,
            BatchError::Syscall { source, .. }
                if matches!(source.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP | 524))
        )
    }
}

/// The start of `struct bpf_map_info` (include/uapi/linux/bpf.h): the
/// kernel fills no more than the length it is given.
#[repr(C)]
#[derive(Default)]
struct MapInfoHead {
    map_type: u32,
    id: u32,
    key_size: u32,
    value_size: u32,
}

/// The `info` member of `union bpf_attr`, for `BPF_OBJ_GET_INFO_BY_FD`.
#[repr(C)]
#[derive(Default)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The key and value sizes of the map behind `fd`.
fn map_sizes(op: &'static str, fd: u32) -> Result<(u32, u32), BatchError> {
    let mut info = MapInfoHead::default();
    let mut attr = InfoAttr {
        bpf_fd: fd,
        info_len: size_of::<MapInfoHead>() as u32,
        info: &raw mut info as u64,
    };
    // SAFETY: `info` is `info_len` bytes the kernel may write.
    unsafe { sys::bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr) }.map_err(|source| {
        BatchError::Syscall {
            op,
            fd,
            source: std::io::Error::new(
                source.kind(),
                format!("reading the map's key and value sizes: {source}"),
            ),
        }
    })?;
    Ok((info.key_size, info.value_size))
}

/// What the unsafe calls below assume: the map's keys are exactly `K` and
/// its values exactly `V` (`V = ()` where no value is passed), and the
/// counts given are what the buffers hold and fit the kernel's `u32`.
fn check_layout<K, V>(
    op: &'static str,
    fd: u32,
    (map_key, map_value): (u32, u32),
    (keys, values): (usize, Option<usize>),
) -> Result<(), BatchError> {
    let key = size_of::<K>();
    let value = size_of::<V>();
    let value_ok = values.is_none() || map_value as usize == value;
    if map_key as usize != key || !value_ok || key == 0 {
        return Err(BatchError::Layout {
            op,
            fd,
            key,
            value,
            map_key,
            map_value,
        });
    }
    if values.is_some_and(|v| v != keys) || u32::try_from(keys).is_err() {
        return Err(BatchError::Count {
            op,
            keys,
            values: values.unwrap_or(keys),
        });
    }
    Ok(())
}

/// [`check_layout`] against the map behind `fd`.
fn checked<K, V>(
    op: &'static str,
    fd: u32,
    keys: usize,
    values: Option<usize>,
) -> Result<(), BatchError> {
    check_layout::<K, V>(op, fd, map_sizes(op, fd)?, (keys, values))
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
    checked::<K, V>("BPF_MAP_LOOKUP_BATCH", fd, chunk.max(1), Some(chunk.max(1)))?;
    let mut keys = vec![K::zeroed(); chunk.max(1)];
    let mut values = vec![V::zeroed(); chunk.max(1)];
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
        // SAFETY: the buffers hold `count` keys and values, of the map's
        // key and value sizes (checked above).
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
                check_layout::<K, V>(
                    "BPF_MAP_LOOKUP_BATCH",
                    fd,
                    (size_of::<K>() as u32, size_of::<V>() as u32),
                    (bigger, Some(bigger)),
                )?;
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
    if keys.is_empty() {
        return Ok(0);
    }
    // The count is checked to fit a call below: a longer list goes in
    // several.
    checked::<K, ()>("BPF_MAP_DELETE_BATCH", fd, 1, None)?;
    let mut deleted = 0;
    let mut rest = keys;
    while !rest.is_empty() {
        let count = rest.len().min(u32::MAX as usize);
        let mut attr = BatchAttr {
            keys: rest.as_ptr() as u64,
            count: count as u32,
            map_fd: fd,
            ..Default::default()
        };
        // SAFETY: `rest` holds at least `count` keys of the map's key size
        // (checked above); the kernel only reads them.
        let result = unsafe { sys::bpf(BPF_MAP_DELETE_BATCH, &mut attr) };
        let done = (attr.count as usize).min(count);
        deleted += done;
        match result {
            Ok(_) if count == rest.len() => return Ok(deleted),
            Ok(_) => rest = &rest[count..],
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

/// One `BPF_MAP_UPDATE_ELEM` of the map behind `fd`.
///
/// # Safety
/// `key` and `value` must point at a key and a value of the map's sizes (a
/// per-CPU map's value being one for each possible CPU); the kernel only
/// reads them.
pub(crate) unsafe fn update_elem(fd: u32, key: *const u8, value: *const u8) -> std::io::Result<()> {
    let mut attr = ElemAttr {
        map_fd: fd,
        key: key as u64,
        value: value as u64,
        ..Default::default()
    };
    // SAFETY: as the caller promised.
    unsafe { sys::bpf(BPF_MAP_UPDATE_ELEM, &mut attr) }.map(|_| ())
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
    if keys.is_empty() && values.is_empty() {
        return Ok(());
    }
    checked::<K, V>("BPF_MAP_UPDATE_BATCH", fd, keys.len(), Some(values.len()))
        .map_err(|e| (0, e))?;
    let n = keys.len();
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: n as u32,
        map_fd: fd,
        ..Default::default()
    };
    // SAFETY: `keys` and `values` hold `count` keys and values of the map's
    // key and value sizes (checked above), and the kernel only reads them.
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
        // SAFETY: `key` and `value` are a key and a value of the map's key
        // and value sizes (checked above).
        unsafe {
            update_elem(
                fd,
                std::ptr::from_ref(key).cast(),
                std::ptr::from_ref(value).cast(),
            )
        }
        .map_err(|source| {
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

#[cfg(test)]
mod tests {
    use super::*;

    const OP: &str = "BPF_MAP_LOOKUP_BATCH";

    #[test]
    fn the_types_must_be_the_maps_sizes() {
        assert!(check_layout::<u64, [u8; 12]>(OP, 3, (8, 12), (16, Some(16))).is_ok());
        for (map, what) in [
            ((4, 12), "keys smaller in the map"),
            (
                (16, 12),
                "keys larger in the map: the kernel would write past the buffer",
            ),
            ((8, 8), "values smaller in the map"),
            (
                (8, 24),
                "values larger in the map: the kernel would write past the buffer",
            ),
        ] {
            let err = check_layout::<u64, [u8; 12]>(OP, 3, map, (16, Some(16))).expect_err(what);
            assert!(
                matches!(
                    err,
                    BatchError::Layout {
                        key: 8,
                        value: 12,
                        ..
                    }
                ),
                "{what}: {err}"
            );
            assert!(err.to_string().contains("refused"), "{err}");
        }
    }

    #[test]
    fn a_delete_checks_the_keys_alone() {
        assert!(check_layout::<u32, ()>(OP, 3, (4, 64), (10, None)).is_ok());
        assert!(check_layout::<u32, ()>(OP, 3, (8, 64), (10, None)).is_err());
        assert!(
            check_layout::<(), ()>(OP, 3, (0, 0), (10, None)).is_err(),
            "no zero-sized keys"
        );
    }

    #[test]
    fn the_counts_must_match_and_fit_a_call() {
        let err = check_layout::<u32, u64>(OP, 3, (4, 8), (10, Some(9)))
            .expect_err("fewer values than keys");
        assert!(
            matches!(
                err,
                BatchError::Count {
                    keys: 10,
                    values: 9,
                    ..
                }
            ),
            "{err}"
        );
        let too_many = u32::MAX as usize + 1;
        assert!(
            check_layout::<u32, u64>(OP, 3, (4, 8), (too_many, Some(too_many))).is_err(),
            "more than a u32 count"
        );
    }

    #[test]
    fn a_layout_refusal_is_not_taken_for_an_old_kernel() {
        let err = check_layout::<u32, u64>(OP, 3, (8, 8), (1, Some(1))).expect_err("wrong key");
        assert!(!err.unsupported(), "update must not fall back on it");
    }
}
