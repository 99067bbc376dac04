//! tc (TCX, kernel >= 6.6) and XDP attachment through pinned bpf links: a
//! pinned link keeps the program attached after the agent exits, and the
//! next agent swaps its own program into the same link atomically.

use std::{io, os::fd::AsFd, path::Path};

use aya::programs::{
    CgroupAttachMode, CgroupSockAddr, LinkOrder, SchedClassifier, TcAttachType, Xdp,
    links::{FdLink, LinkError, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
    xdp::{XdpLink, XdpMode},
};

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("attaching to {ifname}: {source}")]
    Attach {
        ifname: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinning the link of {ifname} at {path}: {source}")]
    Pin {
        ifname: String,
        path: String,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("opening {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("the link of {ifname} cannot be pinned: {source}")]
    Link {
        ifname: String,
        #[source]
        source: LinkError,
    },
}

impl AttachError {
    /// Whether the kernel refused the attach as one the interface cannot
    /// take at all in that mode (no native XDP in its driver, an MTU or
    /// setting XDP cannot work with): `EOPNOTSUPP`, the kernel's own
    /// `ENOTSUPP` (524) or `EINVAL`. Anything else (another program's XDP
    /// link or program in the way, `EBUSY`; memory) may pass, and is worth
    /// another try.
    pub fn unsupported(&self) -> bool {
        const ENOTSUPP: i32 = 524;
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = source {
            if let Some(io) = e.downcast_ref::<io::Error>() {
                return matches!(
                    io.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EINVAL | ENOTSUPP)
                );
            }
            source = e.source();
        }
        false
    }
}

/// Attaches a socket hook (`connect4`, `sendmsg4`, `recvmsg4`, `getpeername4`) to the
/// cgroup directory `cgroup` through a pinned bpf link at `pin`. Linux 5.7 for cgroup
/// links; the hooks themselves 4.17, 4.18, 5.2 and 5.8 (`kernel_version`). A link pinned by an earlier run gets
/// this program swapped in, in one step; a dead one is replaced. Other
/// programs on the cgroup (another agent's, systemd's) stay: the link allows
/// several.
pub fn attach_cgroup_hook(
    program: &mut CgroupSockAddr,
    cgroup: &Path,
    pin: &Path,
) -> Result<(), AttachError> {
    let what = format!("cgroup {}", cgroup.display());
    let err = |source| AttachError::Attach {
        ifname: what.clone(),
        source,
    };
    if pin.exists() {
        let prog_fd = program.fd().map_err(err)?;
        match super::detach::update_pinned_link(pin, prog_fd.as_fd()) {
            Ok(()) => {
                tracing::info!(pin = %pin.display(), "took over pinned cgroup link");
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(pin = %pin.display(), error = %e, "pinned cgroup link unusable; attaching anew");
                let _ = std::fs::remove_file(pin);
            }
        }
    }
    let dir = std::fs::File::open(cgroup).map_err(|source| AttachError::Open {
        path: cgroup.display().to_string(),
        source,
    })?;
    // A bpf link on a cgroup always lets others attach beside it; the
    // kernel refuses any attach flags with one, so the mode stays the
    // default (no flags).
    let link_id = program
        .attach(&dir, CgroupAttachMode::Single)
        .map_err(err)?;
    let link = program.take_link(link_id).map_err(err)?;
    pin_link(link.try_into(), &what, pin)
}

pub struct Attachment {
    pub ifindex: u32,
}

/// Attaches tc ingress on `ifname` through a tcx link pinned at `pin` (Linux 6.6,
/// `kernel_version`), at `order` in the interface's chain, or takes over the
/// one an earlier run pinned there (which keeps its place).
pub fn attach_tc_ingress(
    program: &mut SchedClassifier,
    ifname: &str,
    ifindex: u32,
    pin: &Path,
    order: LinkOrder,
) -> Result<Attachment, AttachError> {
    let err = |source| AttachError::Attach {
        ifname: ifname.to_string(),
        source,
    };
    let link_id = match take_over(program, pin) {
        Some(id) => id,
        None => program
            .attach_with_options(
                ifname,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(order),
            )
            .map_err(err)?,
    };
    let link = program.take_link(link_id).map_err(err)?;
    pin_link(link.try_into(), ifname, pin)?;
    Ok(Attachment { ifindex })
}

/// Detaches and unpins the link pinned at `pin`, if there is one: a link
/// of an earlier release this one no longer makes. A failure is said; the
/// link then goes with its interface or its pin.
pub fn detach_older_link(pin: &Path) {
    if !pin.exists() {
        return;
    }
    if let Err(e) = super::detach::detach_pinned_link(pin) {
        tracing::warn!(pin = %pin.display(), error = %e, "detaching an earlier release's link");
    }
    match std::fs::remove_file(pin) {
        Ok(()) => tracing::info!(pin = %pin.display(), "detached an earlier release's link"),
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "unpinning an earlier release's link");
        }
    }
}

/// Replaces the program in a pinned link of an earlier run. None when there
/// is no such link, or it is dead (its interface went away).
fn take_over(
    program: &mut SchedClassifier,
    pin: &Path,
) -> Option<aya::programs::tc::SchedClassifierLinkId> {
    let old = match PinnedLink::from_pin(pin) {
        Ok(old) => old,
        Err(LinkError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {
            return None;
        }
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "unusable link pin; attaching anew");
            let _ = std::fs::remove_file(pin);
            return None;
        }
    };
    let link: SchedClassifierLink = match FdLink::from(old).try_into() {
        Ok(link) => link,
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "pinned link is not a tc link; attaching anew");
            let _ = std::fs::remove_file(pin);
            return None;
        }
    };
    match program.attach_to_link(link) {
        Ok(id) => {
            tracing::info!(pin = %pin.display(), "took over pinned tc link");
            Some(id)
        }
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "pinned link is dead; attaching anew");
            let _ = std::fs::remove_file(pin);
            None
        }
    }
}

/// How the XDP program is attached (`--xdp-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpModeSetting {
    /// Native where the driver has it, never generic: an interface whose
    /// driver lacks it, and a veth, get tc only.
    Auto,
    /// In the driver only (veths too); an interface whose driver lacks it
    /// gets tc only.
    Native,
    /// Generic (in the stack, after the socket buffer is built).
    Generic,
    /// No XDP: north-south traffic is handled at tc ingress.
    Off,
}

/// Attaches XDP to `ifindex` through a pinned bpf link (Linux 5.9), taking over the
/// pinned link of an earlier run when there is one. Returns the mode used:
/// native (`auto`, `native`) or generic (`generic`).
pub fn attach_xdp(
    program: &mut Xdp,
    ifname: &str,
    ifindex: u32,
    setting: XdpModeSetting,
    pin: &Path,
) -> Result<&'static str, AttachError> {
    let err = |source| AttachError::Attach {
        ifname: ifname.to_string(),
        source,
    };
    if let Some(id) = take_over_xdp(program, pin) {
        let link = program.take_link(id).map_err(err)?;
        pin_link(link.try_into(), ifname, pin)?;
        return Ok("adopted");
    }
    let tries: &[(XdpMode, &'static str)] = match setting {
        XdpModeSetting::Auto | XdpModeSetting::Native => &[(XdpMode::Driver, "native")],
        XdpModeSetting::Generic => &[(XdpMode::Skb, "generic")],
        XdpModeSetting::Off => &[],
    };
    let mut last = None;
    for (mode, name) in tries {
        match program.attach_to_if_index(ifindex, *mode) {
            Ok(id) => {
                let link = program.take_link(id).map_err(err)?;
                pin_link(link.try_into(), ifname, pin)?;
                return Ok(name);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(err(last.unwrap_or(
        aya::programs::ProgramError::UnexpectedProgramType,
    )))
}

fn pin_link(link: Result<FdLink, LinkError>, ifname: &str, pin: &Path) -> Result<(), AttachError> {
    let fd_link = link.map_err(|source| AttachError::Link {
        ifname: ifname.to_string(),
        source,
    })?;
    let _ = std::fs::remove_file(pin);
    let pinned = fd_link.pin(pin).map_err(|source| AttachError::Pin {
        ifname: ifname.to_string(),
        path: pin.display().to_string(),
        source,
    })?;
    drop(pinned);
    Ok(())
}

fn take_over_xdp(program: &mut Xdp, pin: &Path) -> Option<aya::programs::xdp::XdpLinkId> {
    let old = PinnedLink::from_pin(pin).ok()?;
    let link = XdpLink::try_from(FdLink::from(old)).ok()?;
    match program.attach_to_link(link) {
        Ok(id) => {
            tracing::info!(pin = %pin.display(), "took over pinned XDP link");
            Some(id)
        }
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "pinned XDP link is dead; attaching anew");
            let _ = std::fs::remove_file(pin);
            None
        }
    }
}

/// The ids of the programs in `ifindex`'s tcx ingress chain, in order
/// (`BPF_PROG_QUERY`, which needs `CAP_NET_ADMIN` alone). aya's
/// `query_tcx` also opens each program by id, which needs `CAP_SYS_ADMIN`:
/// the DaemonSet does not grant it, and the running agent has no use for
/// more than the ids.
pub fn tcx_ingress_ids(ifindex: u32) -> io::Result<Vec<u32>> {
    const BPF_PROG_QUERY: libc::c_long = 16;
    const BPF_TCX_INGRESS: u32 = 46;
    /// The `query` member of `union bpf_attr`.
    #[repr(C)]
    #[derive(Default)]
    struct QueryAttr {
        target_ifindex: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        count: u32,
        _pad: u32,
        prog_attach_flags: u64,
        link_ids: u64,
        link_attach_flags: u64,
        revision: u64,
    }
    let mut ids = vec![0u32; 64];
    loop {
        let mut attr = QueryAttr {
            target_ifindex: ifindex,
            attach_type: BPF_TCX_INGRESS,
            prog_ids: ids.as_mut_ptr() as u64,
            count: ids.len() as u32,
            ..Default::default()
        };
        // SAFETY: `prog_ids` has room for `count` ids, which is all the
        // kernel writes there; the other pointers are null.
        match unsafe { super::sys::bpf(BPF_PROG_QUERY, &mut attr) } {
            Ok(_) => {
                ids.truncate(attr.count as usize);
                return Ok(ids);
            }
            // More programs than room: the kernel said how many.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                ids = vec![0u32; (attr.count as usize).max(ids.len() * 2)];
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An attach that failed with `errno`, as aya reports a failed
    /// `bpf_link_create`.
    fn failed_with(errno: i32) -> AttachError {
        AttachError::Attach {
            ifname: "eth0".into(),
            source: aya::programs::ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_link_create",
                io_error: io::Error::from_raw_os_error(errno),
            }),
        }
    }

    #[test]
    fn only_what_the_interface_cannot_take_is_unsupported() {
        for (errno, unsupported) in [
            (libc::EOPNOTSUPP, true),
            (524, true),
            (libc::EINVAL, true),
            (libc::EBUSY, false),
            (libc::ENOMEM, false),
            (libc::EEXIST, false),
        ] {
            assert_eq!(
                failed_with(errno).unsupported(),
                unsupported,
                "errno {errno}"
            );
        }
        let pin = AttachError::Open {
            path: "/sys/fs/bpf/x".into(),
            source: io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        };
        assert!(pin.unsupported(), "an errno under any variant");
        let no_errno = AttachError::Attach {
            ifname: "eth0".into(),
            source: aya::programs::ProgramError::UnexpectedProgramType,
        };
        assert!(!no_errno.unsupported(), "no errno: worth another try");
    }
}
