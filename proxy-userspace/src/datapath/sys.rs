//! The bpf(2) system call, for the few commands aya does not wrap (link
//! detach, batched map operations; `cargo xtask profile`'s program info and
//! BTF).

use std::io;

/// Runs bpf(2) command `cmd` with `attr`, the command's member of
/// `union bpf_attr`, and returns the call's result.
///
/// # Safety
///
/// `attr` must be laid out as the kernel expects for `cmd`, and every
/// pointer in it valid for what the command reads or writes through it.
pub unsafe fn bpf<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
    // SAFETY: as the caller promised; the kernel reads no more than the
    // size passed.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut::<A>(attr),
            size_of::<A>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}
