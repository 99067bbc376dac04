//! The capabilities the agent runs with, and naming the one that is missing.
//!
//! deploy/daemonset.yaml drops every capability and adds back exactly
//! [`REQUIRED`]; docs/building.md ("Least privilege") says what each is for on
//! a current kernel and why nothing else is needed. A container started with
//! fewer would otherwise fail deep inside a syscall with a bare EPERM, or
//! with a verifier log that says "!root"; so the agent checks its effective
//! set at start, and an operation refused later is reported with the
//! capability that operation lacked.

pub mod shed;

use std::{collections::HashSet, error::Error, io};

use caps::{CapSet, Capability};

/// One capability the agent needs, and what for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requirement {
    pub capability: Capability,
    /// Also grants it: the kernel accepts `CAP_SYS_ADMIN` in place of
    /// `CAP_BPF` and `CAP_PERFMON` (`bpf_capable`, `perfmon_capable`), which is
    /// how a privileged container passes.
    pub or: Option<Capability>,
    pub needed_for: &'static str,
}

pub const BPF: Requirement = Requirement {
    capability: Capability::CAP_BPF,
    or: Some(Capability::CAP_SYS_ADMIN),
    needed_for: "creating the maps and loading the programs",
};

pub const PERFMON: Requirement = Requirement {
    capability: Capability::CAP_PERFMON,
    or: Some(Capability::CAP_SYS_ADMIN),
    needed_for: "the verifier to accept the tc and XDP programs' pointer arithmetic on packets",
};

pub const NET_ADMIN: Requirement = Requirement {
    capability: Capability::CAP_NET_ADMIN,
    or: None,
    needed_for: "loading and attaching the tc, XDP and socket hook programs, and closing sockets to removed backends",
};

/// What deploy/daemonset.yaml grants for the agent itself; it also grants
/// `CAP_NET_RAW`, which only the image's iptables-legacy tools use.
pub const REQUIRED: [Requirement; 3] = [BPF, PERFMON, NET_ADMIN];

/// What the running agent keeps once its programs are loaded and attached
/// (`shed`): map reads and writes, pins and iterators on descriptors it
/// holds need no capability on the kernels it runs on (6.6 and later), but
/// `CAP_BPF` is kept for the `bpf()` calls of attaching an interface that
/// appears; `CAP_NET_ADMIN` for attaching it (tcx and XDP links, netlink),
/// closing sockets to departed backends (`SOCK_DESTROY`) and reading the
/// kernel's conntrack (ctnetlink). `CAP_PERFMON` only ever served the
/// verifier, at load, and goes.
pub const STEADY: [Requirement; 2] = [
    BPF,
    Requirement {
        capability: Capability::CAP_NET_ADMIN,
        or: None,
        needed_for: "attaching interfaces that appear, closing sockets to removed backends, reading the kernel's conntrack",
    },
];

/// What the agent keeps while the takeover from kube-proxy still runs
/// netfilter tools (`netfilter_tools`): those are executed with at most the
/// agent's own capabilities, and iptables-legacy needs `CAP_NET_RAW`.
pub fn steady_state(netfilter_tools: bool) -> Result<HashSet<Capability>, PrivilegeError> {
    let effective = effective()?;
    let mut keep: HashSet<Capability> = HashSet::new();
    for req in STEADY {
        match req.or {
            // A privileged container may hold CAP_SYS_ADMIN alone for
            // CAP_BPF: it is kept in its place.
            Some(or) if !effective.contains(&req.capability) && effective.contains(&or) => {
                keep.insert(or);
            }
            _ => {
                keep.insert(req.capability);
            }
        }
    }
    if netfilter_tools {
        keep.insert(Capability::CAP_NET_RAW);
        keep.insert(Capability::CAP_NET_ADMIN);
    }
    Ok(keep)
}

/// What a kernel operation the agent performs needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// The object's type information (`BPF_BTF_LOAD`), before its maps.
    LoadBtf,
    CreateMap,
    LoadProgram,
    /// Attaching programs, netlink changes, socket destruction.
    Network,
}

impl Operation {
    fn needs(self) -> &'static [Requirement] {
        match self {
            Operation::LoadBtf | Operation::CreateMap => &[BPF],
            Operation::LoadProgram => &[BPF, NET_ADMIN, PERFMON],
            Operation::Network => &[NET_ADMIN],
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Operation::LoadBtf => "loading the object's BTF",
            Operation::CreateMap => "creating a map",
            Operation::LoadProgram => "loading a program",
            Operation::Network => "attaching or a network change",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("reading the effective capabilities: {0}")]
    Read(#[from] caps::errors::CapsError),
    #[error(
        "missing {}; grant {} (deploy/daemonset.yaml: securityContext.capabilities.add: [{}])",
        describe_missing(.0),
        if .0.len() == 1 { "it" } else { "them" },
        short_names(&REQUIRED)
    )]
    Missing(Vec<Requirement>),
    #[error(
        "{} was refused ({source}): missing {}; grant {} (deploy/daemonset.yaml: securityContext.capabilities.add: [{}])",
        .operation.describe(),
        describe_missing(.missing),
        if .missing.len() == 1 { "it" } else { "them" },
        short_names(&REQUIRED)
    )]
    Refused {
        operation: Operation,
        missing: Vec<Requirement>,
        source: io::Error,
    },
    #[error(
        "{} was refused ({source}) although every capability it needs is effective: a seccomp filter is in force, and container runtimes' default profiles refuse bpf() without CAP_SYS_ADMIN; run the agent with seccompProfile type Unconfined, as deploy/daemonset.yaml does"
    , .operation.describe())]
    Seccomp {
        operation: Operation,
        source: io::Error,
    },
}

fn describe_missing(missing: &[Requirement]) -> String {
    missing
        .iter()
        .map(|r| format!("{} ({})", r.capability, r.needed_for))
        .collect::<Vec<_>>()
        .join(", ")
}

fn short_names(reqs: &[Requirement]) -> String {
    reqs.iter()
        .map(|r| {
            r.capability
                .to_string()
                .trim_start_matches("CAP_")
                .to_owned()
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The calling thread's effective capabilities (capabilities are per thread;
/// the agent sets none of its own, so every thread has the process's).
pub fn effective() -> Result<HashSet<Capability>, PrivilegeError> {
    Ok(caps::read(None, CapSet::Effective)?)
}

/// Those of `reqs` that `effective` does not grant.
pub fn missing_from<S: std::hash::BuildHasher>(
    reqs: &[Requirement],
    effective: &HashSet<Capability, S>,
) -> Vec<Requirement> {
    reqs.iter()
        .copied()
        .filter(|r| {
            !effective.contains(&r.capability) && !r.or.is_some_and(|or| effective.contains(&or))
        })
        .collect()
}

/// The start-up check: every one of [`REQUIRED`] is effective.
pub fn check() -> Result<(), PrivilegeError> {
    let missing = missing_from(&REQUIRED, &effective()?);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(PrivilegeError::Missing(missing))
    }
}

/// When `err` comes from a kernel operation refused for want of privilege
/// (EPERM, or EACCES from the verifier), the capabilities that operation
/// needs and the thread lacks, as an error that names them. None when the
/// error has another cause, or every capability is there (the refusal is then
/// not about capabilities: a seccomp filter, an LSM, a read-only mount).
pub fn explain(err: &(dyn Error + 'static)) -> Option<PrivilegeError> {
    let mut operation = Operation::Network;
    let mut refused = None;
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(map) = e.downcast_ref::<aya::maps::MapError>()
            && matches!(map, aya::maps::MapError::CreateError { .. })
        {
            operation = Operation::CreateMap;
        }
        if let Some(aya::BtfError::LoadError { .. }) = e.downcast_ref::<aya::BtfError>() {
            operation = Operation::LoadBtf;
        }
        if let Some(aya::programs::ProgramError::LoadError { .. }) =
            e.downcast_ref::<aya::programs::ProgramError>()
        {
            operation = Operation::LoadProgram;
        }
        if let Some(io) = e.downcast_ref::<io::Error>()
            && matches!(io.raw_os_error(), Some(libc::EPERM | libc::EACCES))
        {
            refused = Some(io);
        }
        next = e.source();
    }
    let source = io::Error::from_raw_os_error(refused?.raw_os_error().unwrap_or(libc::EPERM));
    let missing = missing_from(operation.needs(), &effective().ok()?);
    if !missing.is_empty() {
        return Some(PrivilegeError::Refused {
            operation,
            missing,
            source,
        });
    }
    if operation != Operation::Network && seccomp_filtered() {
        return Some(PrivilegeError::Seccomp { operation, source });
    }
    None
}

/// Whether a seccomp filter is in force on this process (`Seccomp: 2` in
/// /proc/self/status).
fn seccomp_filtered() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .any(|l| l.strip_prefix("Seccomp:").is_some_and(|v| v.trim() == "2"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> HashSet<Capability> {
        caps::all()
    }

    #[test]
    fn sys_admin_stands_in_for_bpf_and_perfmon_but_not_net_admin() {
        let mut set: HashSet<_> = [Capability::CAP_SYS_ADMIN].into();
        assert_eq!(missing_from(&REQUIRED, &set), vec![NET_ADMIN]);
        set.insert(Capability::CAP_NET_ADMIN);
        assert_eq!(missing_from(&REQUIRED, &set), vec![]);
        assert_eq!(missing_from(&REQUIRED, &all()), vec![]);
    }

    #[test]
    fn each_missing_one_is_named() {
        for req in REQUIRED {
            let mut set = all();
            set.remove(&req.capability);
            if let Some(or) = req.or {
                set.remove(&or);
            }
            let missing = missing_from(&REQUIRED, &set);
            assert_eq!(missing, vec![req], "without {}", req.capability);
            let text = PrivilegeError::Missing(missing).to_string();
            assert!(
                text.contains(&format!("missing {} (", req.capability)),
                "the message names {}: {text}",
                req.capability
            );
        }
    }

    // The refusals of a real load without each capability need root: they are
    // in tests/tests/capabilities.rs with the agent's other capability tests.

    #[test]
    fn other_errors_are_not_explained() {
        let err = io::Error::from_raw_os_error(libc::ENOENT);
        assert!(explain(&err).is_none());
    }
}
