//! A cgroup v2 directory of one test's own, for the agent's `connect()` hook
//! (`--cgroup-root`), and processes started inside it: "the node's own
//! sockets" without touching the host's root cgroup, whose hook would see
//! every other test's sockets too.

use std::{
    ffi::{CString, OsStr},
    io,
    os::unix::{ffi::OsStringExt, process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, anyhow};
use nix::libc;

use crate::netns::NetNs;

/// Removed on drop (once the processes started in it have exited).
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup v2 mount>/ebpf-proxy-<stem>`.
    pub fn create(stem: &str) -> Result<TestCgroup> {
        let path = v2_mount()?.join(format!("ebpf-proxy-{stem}"));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TestCgroup { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `program` in `ns`, as a process of this cgroup from its first
    /// instruction: the child moves itself in before it execs.
    pub fn command_in(&self, ns: &NetNs, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = ns.command(program);
        let procs = CString::new(self.path.join("cgroup.procs").into_os_string().into_vec())
            .expect("a cgroup path has no NUL");
        // SAFETY: between fork and exec only open, write and close, which
        // are async-signal-safe; nothing allocates there.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" moves the writing process.
                let written = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                let error = io::Error::last_os_error();
                libc::close(fd);
                if written != 2 {
                    return Err(error);
                }
                Ok(())
            });
        }
        cmd
    }

    /// Moves this whole process (every thread) into the cgroup until the
    /// guard drops, then back to the cgroup it was in: the sockets it
    /// creates meanwhile are this cgroup's, and run the hooks attached here.
    pub fn enter(&self) -> Result<Entered> {
        let home = own_cgroup()?;
        move_here(&self.path)?;
        Ok(Entered { home })
    }
}

/// While it lives, this process is in a [`TestCgroup`] ([`TestCgroup::enter`]).
#[derive(Debug)]
pub struct Entered {
    home: PathBuf,
}

impl Drop for Entered {
    fn drop(&mut self) {
        if let Err(e) = move_here(&self.home) {
            eprintln!("warning: {e:#}");
        }
    }
}

/// Moves this process into the cgroup at `dir` ("0" is the writer's process).
fn move_here(dir: &Path) -> Result<()> {
    let procs = dir.join("cgroup.procs");
    std::fs::write(&procs, "0\n").with_context(|| format!("moving into {}", procs.display()))
}

/// The cgroup v2 hierarchy where the agent looks by default: a unified
/// host's mount, or a hybrid host's `unified` directory.
fn v2_mount() -> Result<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .find(|p| {
            nix::sys::statfs::statfs(*p)
                .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        })
        .map(PathBuf::from)
        .ok_or_else(|| anyhow!("no cgroup v2 hierarchy at /sys/fs/cgroup(/unified)"))
}

/// The cgroup v2 directory this process is in (`0::<path>` of
/// `/proc/self/cgroup`): a hook attached there sees the sockets of every
/// thread of it, whichever namespace the thread has entered.
pub fn own_cgroup() -> Result<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").context("reading /proc/self/cgroup")?;
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| anyhow!("/proc/self/cgroup has no cgroup v2 line: {text:?}"))?;
    let dir = v2_mount()?.join(path.trim_start_matches('/'));
    if !dir.is_dir() {
        return Err(anyhow!(
            "this process's cgroup {} is not there",
            dir.display()
        ));
    }
    Ok(dir)
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.path);
    }
}
