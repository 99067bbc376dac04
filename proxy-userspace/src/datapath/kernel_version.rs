//! The running kernel's release against the oldest kernel each datapath
//! feature works on, checked before anything is loaded: an old kernel
//! otherwise shows up as a verifier or attach error that names neither the
//! feature nor the version it needs.
//!
//! The release is all that is read, so a distribution kernel that carries a
//! feature back to an older version is still refused; what fails later on
//! such a kernel (a program load, an attach) says what it lacked.

use std::{ffi::CStr, fmt};

/// A kernel version, as far as features are tied to one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelVersion {
    pub major: u32,
    pub minor: u32,
}

impl KernelVersion {
    pub const fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// The version at the start of a release string as `uname -r` prints it:
    /// "6.1.0-18-amd64", "5.15.0-91-generic", "6.18.3+deb14", "6.6".
    pub fn parse(release: &str) -> Result<Self, KernelVersionError> {
        let bad = || KernelVersionError::Unparsable {
            release: release.to_owned(),
        };
        let mut parts = release.trim().splitn(3, '.');
        let major = parts.next().and_then(leading_number).ok_or_else(bad)?;
        let minor = parts.next().and_then(leading_number).ok_or_else(bad)?;
        Ok(Self { major, minor })
    }
}

/// The number at the start of `part` ("0-18-amd64" -> 0); None when it
/// starts with no digit.
fn leading_number(part: &str) -> Option<u32> {
    let end = part
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(part.len());
    part[..end].parse().ok()
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// What the agent does on a kernel without a feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// It cannot run.
    Mandatory,
    /// It runs without; the text says what is then off.
    Optional { without: &'static str },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feature {
    pub name: &'static str,
    /// The first mainline release that has it.
    pub since: KernelVersion,
    pub need: Need,
}

const fn mandatory(name: &'static str, major: u32, minor: u32) -> Feature {
    Feature {
        name,
        since: KernelVersion::new(major, minor),
        need: Need::Mandatory,
    }
}

/// Every kernel feature the datapath and its loader use that is newer than
/// eBPF's basics (maps, tc and XDP programs, direct packet access), with
/// the release that brought it. The rustdoc of each program in proxy-ebpf
/// and of each loader function names the ones it needs.
pub const FEATURES: &[Feature] = &[
    mandatory("tcx: tc programs attached through bpf links", 6, 6),
    mandatory("cgroup recvmsg4 hook", 5, 2),
    mandatory("cgroup getpeername4 hook", 5, 8),
    mandatory("bpf links on cgroups", 5, 7),
    mandatory("bpf links for XDP", 5, 9),
    mandatory(
        "BPF ring buffer (aya-log's AYA_LOGS, the datapath log)",
        5,
        8,
    ),
    mandatory("bpf_redirect_neigh helper", 5, 10),
    mandatory("bpf_ktime_get_coarse_ns helper", 5, 11),
    mandatory(
        "BPF memory charged to the memory cgroup (the agent never raises RLIMIT_MEMLOCK)",
        5,
        11,
    ),
    Feature {
        name: "bpf_cast_to_kern_ctx kfunc",
        since: KernelVersion::new(6, 2),
        need: Need::Optional {
            without: "tc cannot read socket buffers' checksum state and updates every L4 checksum through the kernel's helper",
        },
    },
    Feature {
        name: "iterators over bpf_sk_storage maps",
        since: KernelVersion::new(5, 9),
        need: Need::Optional {
            without: "the node's UDP sockets connected to departed backends are not closed",
        },
    },
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelVersionError {
    #[error(
        "Linux {running} (release {release}) is too old: {feature} needs Linux {needs} or later"
    )]
    TooOld {
        feature: &'static str,
        needs: KernelVersion,
        running: KernelVersion,
        release: String,
    },
    #[error("the kernel release {release:?} does not start with a version (major.minor)")]
    Unparsable { release: String },
    #[error("reading the kernel release (uname): {0}")]
    Uname(String),
}

/// The features of `features` that `release` lacks, all optional; an error
/// for the first mandatory one it lacks.
pub fn missing<'a>(
    release: &str,
    features: &'a [Feature],
) -> Result<Vec<&'a Feature>, KernelVersionError> {
    let running = KernelVersion::parse(release)?;
    let lacking = features.iter().filter(|f| running < f.since);
    let mut optional = Vec::new();
    for feature in lacking {
        match feature.need {
            Need::Mandatory => {
                return Err(KernelVersionError::TooOld {
                    feature: feature.name,
                    needs: feature.since,
                    running,
                    release: release.to_owned(),
                });
            }
            Need::Optional { .. } => optional.push(feature),
        }
    }
    Ok(optional)
}

/// The running kernel's release, as `uname -r` prints it.
pub fn running_release() -> Result<String, KernelVersionError> {
    // SAFETY: uname fills the struct it is given; a zeroed utsname is valid.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable utsname that outlives the call.
    if unsafe { libc::uname(&raw mut uts) } != 0 {
        return Err(KernelVersionError::Uname(
            std::io::Error::last_os_error().to_string(),
        ));
    }
    // SAFETY: the kernel NUL-terminates release within the array.
    let release = unsafe { CStr::from_ptr(uts.release.as_ptr()) };
    Ok(release.to_string_lossy().into_owned())
}

/// Checks the running kernel against `FEATURES`: an error naming the
/// feature and the version it needs when a mandatory one is missing, a
/// warning for each optional one, naming what is off. A release that names
/// no version is let through with a warning, as a refusal would then rest
/// on a guess.
pub fn check() -> Result<(), KernelVersionError> {
    let release = running_release()?;
    match missing(&release, FEATURES) {
        Ok(optional) => {
            for feature in optional {
                if let Need::Optional { without } = feature.need {
                    tracing::warn!(
                        release,
                        feature = feature.name,
                        needs = %feature.since,
                        "the kernel lacks an optional feature: {without}"
                    );
                }
            }
            Ok(())
        }
        Err(e @ KernelVersionError::Unparsable { .. }) => {
            tracing::warn!(error = %e, "kernel minimums not checked");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_distribution_releases() {
        for (release, major, minor) in [
            ("6.1.0-18-amd64", 6, 1),
            ("5.15.0-91-generic", 5, 15),
            ("6.18.3+deb14", 6, 18),
            ("6.18.44-fc-v669", 6, 18),
            ("4.18.0-553.el8_10.x86_64", 4, 18),
            ("6.6", 6, 6),
            ("6.10-rc1", 6, 10),
            (" 6.8.0-1\n", 6, 8),
        ] {
            assert_eq!(
                KernelVersion::parse(release),
                Ok(KernelVersion::new(major, minor)),
                "release {release:?}"
            );
        }
    }

    #[test]
    fn refuses_releases_without_a_version() {
        for release in ["", "6", "linux-6.1", "6.x.1", ".1.2"] {
            assert_eq!(
                KernelVersion::parse(release),
                Err(KernelVersionError::Unparsable {
                    release: release.to_owned()
                }),
                "release {release:?}"
            );
        }
    }

    #[test]
    fn versions_order_by_minor_as_a_number() {
        assert!(KernelVersion::new(6, 10) > KernelVersion::new(6, 6));
        assert!(KernelVersion::new(5, 15) < KernelVersion::new(6, 1));
    }

    #[test]
    fn kernels_before_tcx_are_refused_naming_it() {
        for (release, running) in [
            ("6.1.0-18-amd64", KernelVersion::new(6, 1)),
            ("5.15.0-91-generic", KernelVersion::new(5, 15)),
            ("6.5.13", KernelVersion::new(6, 5)),
        ] {
            let err = missing(release, FEATURES).expect_err(release);
            assert_eq!(
                err,
                KernelVersionError::TooOld {
                    feature: "tcx: tc programs attached through bpf links",
                    needs: KernelVersion::new(6, 6),
                    running,
                    release: release.to_owned(),
                },
                "release {release}"
            );
            let text = err.to_string();
            assert!(
                text.contains("tcx") && text.contains("needs Linux 6.6 or later"),
                "the message names the feature and its version: {text}"
            );
        }
    }

    #[test]
    fn the_oldest_lacking_feature_is_named_first() {
        // 5.4 lacks getpeername4 (5.8) and more; the first in FEATURES wins.
        let err = missing("5.4.0-150-generic", FEATURES).unwrap_err();
        assert!(
            matches!(err, KernelVersionError::TooOld { feature, .. } if feature.starts_with("tcx")),
            "{err}"
        );
    }

    #[test]
    fn kernels_from_6_6_lack_nothing() {
        for release in ["6.6.0", "6.18.3+deb14", "7.0.0-rc2"] {
            assert_eq!(missing(release, FEATURES), Ok(vec![]), "release {release}");
        }
    }

    #[test]
    fn optional_features_are_listed_not_refused() {
        let table = [
            mandatory("base", 5, 10),
            Feature {
                name: "newer thing",
                since: KernelVersion::new(6, 8),
                need: Need::Optional {
                    without: "it is off",
                },
            },
            Feature {
                name: "older thing",
                since: KernelVersion::new(5, 12),
                need: Need::Optional {
                    without: "also off",
                },
            },
        ];
        let names =
            |r: &str| -> Vec<&str> { missing(r, &table).unwrap().iter().map(|f| f.name).collect() };
        assert_eq!(names("6.1.0-18-amd64"), ["newer thing"]);
        assert_eq!(names("5.10.0-28-amd64"), ["newer thing", "older thing"]);
        assert_eq!(names("6.8.0"), Vec::<&str>::new());
        assert!(matches!(
            missing("5.4.0", &table),
            Err(KernelVersionError::TooOld {
                feature: "base",
                ..
            })
        ));
    }

    #[test]
    fn reads_this_kernel() {
        let release = running_release().expect("uname");
        KernelVersion::parse(&release).expect("this kernel's release names a version");
        check().expect("the kernel the tests run on has every mandatory feature");
    }
}
