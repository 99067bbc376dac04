//! The socket notes iterators' links (`program_names::SOCK_NOTES_DUMP`,
//! `SOCK_NOTES6_DUMP`), made and pinned at load: reading the pinned file
//! runs the iterator (`housekeeping::sock_notes` reads it).

use std::{
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    Btf, BtfError, Ebpf,
    programs::{Iter, ProgramError},
};

use super::sys;

#[derive(Debug, thiserror::Error)]
pub enum IterLinkError {
    #[error("the socket notes iterator needs the kernel's BTF: {0}")]
    Btf(#[source] BtfError),
    #[error("loading the socket notes iterator: {0}")]
    Load(#[source] ProgramError),
    #[error("creating the socket notes iterator's link: {0}")]
    Link(#[source] io::Error),
    #[error("pinning the socket notes iterator at {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// `enum bpf_attach_type`: `BPF_TRACE_ITER`.
const BPF_TRACE_ITER: u32 = 28;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_LINK_CREATE: libc::c_long = 28;

/// `bpf_attr.link_create` of an iterator link with no target of its own.
#[repr(C)]
struct LinkCreate {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    /// `union bpf_iter_link_info`: none, for the UDP table.
    iter_info: u64,
    iter_info_len: u32,
    _pad: u32,
}

/// `bpf_attr.obj_pin`.
#[repr(C)]
struct ObjPin {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Loads the iterator `program` over the UDP table (it reads the object's
/// `SOCK_NOTES` or `SOCK_NOTES6`) and pins its link at `path`, in place of
/// an earlier agent's (Linux 5.9). The link is made and pinned by two raw
/// bpf(2) calls, as aya keeps an iterator's link to itself.
pub fn pin_iterator(ebpf: &mut Ebpf, program: &str, path: &Path) -> Result<(), IterLinkError> {
    let btf = Btf::from_sys_fs().map_err(IterLinkError::Btf)?;
    let program: &mut Iter = ebpf
        .program_mut(program)
        .ok_or(IterLinkError::Load(ProgramError::UnexpectedProgramType))?
        .try_into()
        .map_err(IterLinkError::Load)?;
    if program.fd().is_err() {
        program.load("udp", &btf).map_err(IterLinkError::Load)?;
    }
    let prog = program.fd().map_err(IterLinkError::Load)?;
    let link = link_create(prog.as_fd()).map_err(IterLinkError::Link)?;
    let pin_error = |source| IterLinkError::Pin {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(pin_error(e)),
        _ => {}
    }
    obj_pin(link.as_fd(), path).map_err(pin_error)
}

fn link_create(prog: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: 0,
        attach_type: BPF_TRACE_ITER,
        flags: 0,
        iter_info: 0,
        iter_info_len: 0,
        _pad: 0,
    };
    // SAFETY: `link_create` as the kernel lays it out, pointing at nothing.
    let fd = unsafe { sys::bpf(BPF_LINK_CREATE, &mut attr)? } as i32;
    // SAFETY: a new fd returned by the kernel, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut attr = ObjPin {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    // SAFETY: `obj_pin` as the kernel lays it out; the path outlives the call.
    unsafe { sys::bpf(BPF_OBJ_PIN, &mut attr)? };
    Ok(())
}
