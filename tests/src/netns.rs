//! Named network namespaces (`ip netns add`) and running code inside them.
//!
//! Code enters a namespace with `setns(CLONE_NEWNET)` on a thread of its own, never on
//! the caller's thread: the test harness and the demo run many things at once, and a
//! thread that switched namespaces must not be reused for anything else. Sockets keep
//! the namespace they were created in, so a socket made on such a thread can be used
//! from any thread afterwards.
//!
//! Processes go in with `nsenter --net=...`, never `ip netns exec`: the latter also
//! unshares the mount namespace and remounts /sys, which hides the host's bpffs at
//! /sys/fs/bpf (docs/architecture.md, "Test topologies").

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicU32, Ordering},
        mpsc,
    },
    thread::{self, JoinHandle},
};

use anyhow::{Context, Result, anyhow};
use nix::sched::{CloneFlags, setns};

use crate::run_cmd;

/// Every name this harness gives a namespace (and other per-run things such as bpffs
/// directories) starts with this, followed by the creating process's pid.
pub const NAME_PREFIX: &str = "ebpf-";

const NETNS_DIR: &str = "/run/netns";

/// A fresh `ebpf-<pid>-<n>` stem, unique on this machine while this process lives.
/// The pid lets [`remove_stale`] tell leftovers of dead processes from live ones.
pub fn unique_stem() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{NAME_PREFIX}{}-{n}", std::process::id())
}

/// The pid encoded in a name made from [`unique_stem`], if any.
pub fn owner_pid(name: &str) -> Option<u32> {
    name.strip_prefix(NAME_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// True when a process with this pid exists.
pub fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Deletes namespaces left by harness processes that are gone (killed before their
/// `Drop`s ran). Returns the names it removed.
pub fn remove_stale() -> Result<Vec<String>> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(NETNS_DIR) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e).context(NETNS_DIR),
    };
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(pid) = owner_pid(&name)
            && !pid_alive(pid)
        {
            run_cmd(Command::new("ip").args(["netns", "del", &name]))?;
            removed.push(name);
        }
    }
    Ok(removed)
}

/// Moves the calling thread into the network namespace at `path`.
pub fn enter(path: &Path) -> Result<()> {
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    setns(&file, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("setns(CLONE_NEWNET) into {}", path.display()))
}

/// Runs `f` on a new thread inside the namespace at `path` and returns its result. A
/// panic in `f` is resumed on the caller's thread.
pub fn run_in<T, F>(path: &Path, f: F) -> Result<T>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    thread::scope(|scope| {
        let handle = scope.spawn(|| -> Result<T> {
            enter(path)?;
            Ok(f())
        });
        match handle.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// A `Command` that runs `program` in the network namespace at `path` through
/// `nsenter --net`, which leaves the mount namespace (and /sys/fs/bpf) alone.
pub fn command_in(path: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", path.display()))
        .arg("--")
        .arg(program);
    cmd
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates the namespace `name` with its loopback up.
    pub fn create(name: &str) -> Result<NetNs> {
        run_cmd(Command::new("ip").args(["netns", "add", name]))?;
        // From here on Drop deletes it, also if the next step fails.
        let ns = NetNs {
            name: name.to_owned(),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, what `nsenter --net=` and `setns` take.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// Runs `f` on a new thread inside this namespace and returns its result. A panic in
    /// `f` is resumed on the caller's thread.
    pub fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send,
        F: FnOnce() -> T + Send,
    {
        run_in(&self.path(), f)
    }

    /// Starts `f` on a named thread inside this namespace. Returns once the thread is in
    /// the namespace, so a failure to enter it is reported here and `f` never runs
    /// in the wrong one.
    pub fn spawn<T, F>(&self, thread_name: &str, f: F) -> Result<NsThread<T>>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let path = self.path();
        let (entered_tx, entered_rx) = mpsc::channel();
        let handle = thread::Builder::new()
            .name(thread_name.to_owned())
            .spawn(move || {
                let entered = enter(&path);
                let ok = entered.is_ok();
                // The receiver waits for exactly this message.
                let _ = entered_tx.send(entered);
                ok.then(f)
            })
            .context("spawn thread")?;
        match entered_rx.recv() {
            Ok(Ok(())) => Ok(NsThread(handle)),
            Ok(Err(e)) => {
                let _ = handle.join();
                Err(e)
            }
            Err(_) => Err(anyhow!(
                "thread {thread_name} died before entering {}",
                self.name
            )),
        }
    }

    /// A `Command` that runs `program` in this namespace (network namespace only; the
    /// mount namespace and with it /sys/fs/bpf stay the host's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        command_in(&self.path(), program)
    }

    /// `ip -n <name> args...`
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run_cmd(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Sets a sysctl of this namespace, `key` in dotted form (`net.ipv4.ip_forward`).
    /// /proc/sys/net is resolved against the writing thread's namespace, so the write
    /// happens on a thread inside it.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        self.run(|| std::fs::write(&path, value))?
            .with_context(|| format!("sysctl {key}={value} in netns {}", self.name))
    }
}

/// A thread started by [`NetNs::spawn`], known to have entered its namespace.
#[derive(Debug)]
pub struct NsThread<T>(JoinHandle<Option<T>>);

impl<T> NsThread<T> {
    /// Waits for the thread; `Err` carries its panic.
    pub fn join(self) -> thread::Result<T> {
        self.0
            .join()
            .map(|v| v.expect("NsThread exists only for threads that entered their namespace"))
    }

    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace also destroys every veth with an end in it.
        if let Err(e) = run_cmd(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("warning: cannot delete netns {}: {e:#}", self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stems_are_unique_and_carry_the_pid() {
        let a = unique_stem();
        let b = unique_stem();
        assert_ne!(a, b);
        assert_eq!(owner_pid(&a), Some(std::process::id()));
        assert_eq!(owner_pid(&format!("{b}-client")), Some(std::process::id()));
        assert_eq!(owner_pid("other-123-4"), None);
        assert_eq!(owner_pid("ebpf-proxy"), None);
    }
}
