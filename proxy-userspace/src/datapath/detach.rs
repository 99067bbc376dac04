//! Detaching a pinned bpf link synchronously. Removing a link's pin drops the
//! last reference only once bpffs frees the inode, after an RCU grace period:
//! traffic would still be translated for a moment after `ebpf-proxy cleanup`
//! returned. `BPF_LINK_DETACH` cuts the link from its interface at once. aya
//! keeps a link's fd private, hence the raw bpf(2) calls here; one more swaps
//! the program of a pinned cgroup link, which aya cannot take over.

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

use super::sys;

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `union bpf_attr`, large enough for the two commands used here.
#[repr(C, align(8))]
struct Attr([u8; 128]);

/// The link pinned at `path`.
fn open_pinned_link(path: &Path) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = Attr([0; 128]);
    // bpf_attr.pathname (u64) at offset 0.
    attr.0[..8].copy_from_slice(&(c_path.as_ptr() as u64).to_ne_bytes());
    // SAFETY: a zeroed bpf_attr carrying a valid path pointer.
    let fd = unsafe { sys::bpf(BPF_OBJ_GET, &mut attr)? } as i32;
    // SAFETY: a new fd returned by the kernel, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Swaps the program of the link pinned at `path` for `prog_fd`'s in one
/// step, for link types aya cannot take over (cgroup links).
pub fn update_pinned_link(path: &Path, prog_fd: BorrowedFd<'_>) -> io::Result<()> {
    let link = open_pinned_link(path)?;
    let mut attr = Attr([0; 128]);
    // bpf_attr.link_update: link_fd (u32) at 0, new_prog_fd (u32) at 4.
    attr.0[..4].copy_from_slice(&(link.as_raw_fd() as u32).to_ne_bytes());
    attr.0[4..8].copy_from_slice(&(prog_fd.as_raw_fd() as u32).to_ne_bytes());
    // SAFETY: a zeroed bpf_attr carrying two valid fds.
    unsafe { sys::bpf(BPF_LINK_UPDATE, &mut attr)? };
    Ok(())
}

/// Opens the link pinned at `path` and detaches it from its hook.
pub fn detach_pinned_link(path: &Path) -> io::Result<()> {
    let fd = open_pinned_link(path)?;
    let mut attr = Attr([0; 128]);
    // bpf_attr.link_detach.link_fd (u32) at offset 0.
    attr.0[..4].copy_from_slice(&(fd.as_raw_fd() as u32).to_ne_bytes());
    // SAFETY: a zeroed bpf_attr carrying the link's fd.
    unsafe { sys::bpf(BPF_LINK_DETACH, &mut attr)? };
    Ok(())
}

/// Detaches every link pinned in `dir` (a layout's `links/`), so that none
/// acts on packets once this returns. A link that cannot be detached is
/// logged; it goes when its pin does.
pub fn detach_links_in(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if let Err(e) = detach_pinned_link(&entry.path()) {
            tracing::warn!(pin = %entry.path().display(), error = %e, "detaching link");
        }
    }
}
