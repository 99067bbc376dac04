//! bpf(2) commands aya does not offer the tests: links made straight from a
//! program descriptor (`BPF_LINK_CREATE`), and programs loaded from a handful
//! of instructions, where a test needs programs of its own in an interface's
//! hooks and the datapath's object would be far too heavy to load that often.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `BPF_TCX_INGRESS`, the attach type of a tcx ingress link.
pub const BPF_TCX_INGRESS: u32 = 46;

/// A tcx link's flag: at the end of the interface's chain.
pub const BPF_F_AFTER: u32 = 1 << 4;

/// `BPF_XDP`, the attach type of an XDP link.
pub const BPF_XDP: u32 = 37;

/// An XDP link's flag: in the driver (native XDP).
pub const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// `BPF_LINK_CREATE`: `prog` on `ifindex` (of the calling thread's namespace) as
/// `attach_type` with `flags`; the link lasts as long as the descriptor.
pub fn link_create(
    prog: BorrowedFd<'_>,
    ifindex: u32,
    attach_type: u32,
    flags: u32,
) -> std::io::Result<OwnedFd> {
    const BPF_LINK_CREATE: libc::c_long = 28;
    #[repr(C)]
    struct LinkCreate {
        prog_fd: u32,
        target_ifindex: u32,
        attach_type: u32,
        flags: u32,
        rest: [u64; 6],
    }
    let attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: ifindex,
        attach_type,
        flags,
        rest: [0; 6],
    };
    // SAFETY: a valid `link_create` member of `union bpf_attr`.
    unsafe { bpf_fd(BPF_LINK_CREATE, &attr) }
}

/// Loads a tc program (`BPF_PROG_TYPE_SCHED_CLS`) named `name` that hands every
/// packet on down the chain (`TCX_NEXT`, -1) and does nothing else: a
/// stand-in for another tc user's program.
pub fn load_tc_next(name: &str) -> std::io::Result<OwnedFd> {
    const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
    load_returning(BPF_PROG_TYPE_SCHED_CLS, -1, name)
}

/// Loads an XDP program (`BPF_PROG_TYPE_XDP`) named `name` that passes every
/// packet (`XDP_PASS`, 2) and does nothing else: a stand-in for another XDP
/// user's program.
pub fn load_xdp_pass(name: &str) -> std::io::Result<OwnedFd> {
    const BPF_PROG_TYPE_XDP: u32 = 6;
    load_returning(BPF_PROG_TYPE_XDP, 2, name)
}

/// Loads a program of type `prog_type` named `name` that returns `verdict`.
fn load_returning(prog_type: u32, verdict: i32, name: &str) -> std::io::Result<OwnedFd> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    // r0 = verdict (BPF_ALU64 | BPF_MOV | BPF_K, the immediate in the high
    // 32 bits); exit (BPF_JMP | BPF_EXIT).
    let insns: [u64; 2] = [
        (u64::from(verdict as u32) << 32) | 0xb7,
        0x0000_0000_0000_0095,
    ];
    let license = c"GPL";
    #[repr(C)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        prog_name: [u8; 16],
    }
    let mut prog_name = [0u8; 16];
    for (slot, byte) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *slot = byte;
    }
    let attr = ProgLoad {
        prog_type,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
        prog_name,
    };
    // SAFETY: a valid `prog_load` member of `union bpf_attr`, whose
    // instructions and license outlive the call.
    unsafe { bpf_fd(BPF_PROG_LOAD, &attr) }
}

/// Runs bpf(2) command `cmd`, which returns a new descriptor, with `attr`.
///
/// # Safety
///
/// `attr` must be the command's member of `union bpf_attr`, every pointer in it
/// valid for what the command reads through it.
unsafe fn bpf_fd<A>(cmd: libc::c_long, attr: &A) -> std::io::Result<OwnedFd> {
    // SAFETY: as the caller promised; the kernel reads no more than the size
    // passed, and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_ref(attr), size_of::<A>()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just made for us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}
