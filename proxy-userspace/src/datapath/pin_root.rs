//! `--bpf-root` checked before anything is pinned there: a pin is the
//! datapath's handle on its maps and links, and whoever can rename or
//! replace one can hand the next agent (or `status`, `cleanup`) a map of
//! their own, or take a link away (docs/security.md, "Privileges and
//! pins").
//!
//! So the root, the directories the agent keeps in it, and every directory
//! above it must be owned by root (or the agent's own user) and writable by
//! no one else. One exception, for the directories above the root only: a
//! root-owned directory with the sticky bit (`/tmp`, and bpffs' own mount
//! point, 1777 by default), where others may add entries but not rename or
//! remove those of another owner; an entry someone else made there in the
//! root's place is refused as the root, being theirs.

use std::{
    io,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

#[derive(Debug, thiserror::Error)]
pub enum PinRootError {
    #[error("checking --bpf-root: reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "refusing --bpf-root {root}: {path} is owned by uid {uid}, not root (or this agent's uid {euid}), so that user could replace the pins; `chown root {path}` or pick another --bpf-root"
    )]
    Owner {
        root: PathBuf,
        path: PathBuf,
        uid: u32,
        euid: u32,
    },
    #[error(
        "refusing --bpf-root {root}: {path} is writable by {who} (mode {mode:04o}), so the pins below it could be replaced by an unprivileged user; `chmod go-w {path}` or pick another --bpf-root"
    )]
    Writable {
        root: PathBuf,
        path: PathBuf,
        who: &'static str,
        mode: u32,
    },
}

/// What a directory's owner and mode must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// The root or a directory the agent keeps in it: nobody else writes.
    Own,
    /// A directory above the root: a root-owned sticky directory may be
    /// writable by others.
    Above,
}

/// Checks `root` (which must exist), `kept` (the directories the agent
/// keeps below it) and every directory above it.
pub fn check(root: &Path, kept: &[PathBuf]) -> Result<(), PinRootError> {
    let euid = effective_uid();
    let read = |path: &Path| {
        std::fs::metadata(path).map_err(|source| PinRootError::Read {
            path: path.to_owned(),
            source,
        })
    };
    // The directories a path resolves through are those of its canonical
    // form: a symbolic link is as safe as the directory holding it, which
    // is checked.
    let canonical = root.canonicalize().map_err(|source| PinRootError::Read {
        path: root.to_owned(),
        source,
    })?;
    let mut dirs: Vec<(PathBuf, Place)> = kept.iter().map(|d| (d.clone(), Place::Own)).collect();
    dirs.push((canonical.clone(), Place::Own));
    dirs.extend(
        canonical
            .ancestors()
            .skip(1)
            .map(|d| (d.to_owned(), Place::Above)),
    );
    for (path, place) in dirs {
        let meta = read(&path)?;
        verdict(meta.uid(), meta.permissions().mode(), place, euid).map_err(|fault| {
            let root = root.to_owned();
            match fault {
                Fault::Owner => PinRootError::Owner {
                    root,
                    path,
                    uid: meta.uid(),
                    euid,
                },
                Fault::Writable(who) => PinRootError::Writable {
                    root,
                    path,
                    who,
                    mode: meta.permissions().mode() & 0o7777,
                },
            }
        })?;
    }
    Ok(())
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[derive(Debug, PartialEq, Eq)]
enum Fault {
    Owner,
    /// By whom.
    Writable(&'static str),
}

/// Whether a directory owned by `uid` with `mode` is safe at `place` for an
/// agent running as `euid`.
fn verdict(uid: u32, mode: u32, place: Place, euid: u32) -> Result<(), Fault> {
    const STICKY: u32 = 0o1000;
    if uid != 0 && uid != euid {
        return Err(Fault::Owner);
    }
    let who = match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (false, false) => return Ok(()),
        (true, false) => "its group",
        (false, true) => "others",
        (true, true) => "its group and others",
    };
    if place == Place::Above && uid == 0 && mode & STICKY != 0 {
        return Ok(());
    }
    Err(Fault::Writable(who))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_by_root_or_the_agent_and_written_by_no_one_else() {
        assert_eq!(verdict(0, 0o755, Place::Own, 0), Ok(()));
        assert_eq!(verdict(0, 0o700, Place::Above, 0), Ok(()));
        assert_eq!(
            verdict(1000, 0o755, Place::Own, 1000),
            Ok(()),
            "the agent's own uid"
        );
        assert_eq!(verdict(65534, 0o755, Place::Own, 0), Err(Fault::Owner));
        assert_eq!(verdict(65534, 0o755, Place::Above, 0), Err(Fault::Owner));
        assert_eq!(
            verdict(0, 0o775, Place::Own, 0),
            Err(Fault::Writable("its group"))
        );
        assert_eq!(
            verdict(0, 0o757, Place::Above, 0),
            Err(Fault::Writable("others"))
        );
    }

    #[test]
    fn a_root_owned_sticky_directory_is_fine_above_the_root_only() {
        assert_eq!(verdict(0, 0o1777, Place::Above, 0), Ok(()), "/tmp, bpffs");
        assert_eq!(
            verdict(0, 0o1777, Place::Own, 0),
            Err(Fault::Writable("its group and others")),
            "others could make the agent's directories in it first"
        );
        assert_eq!(
            verdict(1000, 0o1777, Place::Above, 0),
            Err(Fault::Owner),
            "a sticky directory of another user"
        );
    }

    #[test]
    fn the_message_names_the_path_and_the_fault() {
        let dir = std::env::temp_dir().join(format!("pin-root-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod 777");
        let err = check(&dir, &[]).expect_err("a world-writable root");
        let text = err.to_string();
        assert!(
            text.contains(&format!("{} is writable by", dir.display())) && text.contains("0777"),
            "{text}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod 755");
        check(&dir, &[]).expect("0755, made by this user");
        std::fs::remove_dir(&dir).expect("remove temp dir");
    }
}
