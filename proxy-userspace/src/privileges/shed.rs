//! Giving up, on every thread, the capabilities the running agent no longer
//! needs once its programs are loaded and attached (docs/security.md,
//! "Privileges and pins", says which remain and why).
//!
//! Capabilities belong to threads, not to the process: `capset` changes the
//! calling thread's alone, and by the time start-up is done the runtime's
//! workers, its blocking pool and the agent's own threads all hold the
//! start-up set. So the calling thread sets its own, and every other thread
//! is sent a signal whose handler makes the same `capset` call (as libcap's
//! psx does); each thread's sets are then read back from
//! `/proc/self/task/*/status` until every thread, including any started
//! meanwhile by a thread not yet reached, holds exactly the new sets.
//!
//! Each thread also sets `no_new_privs`: the agent runs as uid 0, and
//! without it anything it executes would get its bounding set back; with
//! it an executed program gets at most what the agent kept (the netfilter
//! tools the takeover runs need just that).

use std::{
    collections::HashSet,
    io,
    sync::{
        Once,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use caps::Capability;

#[derive(Debug, thiserror::Error)]
pub enum ShedError {
    #[error("reading this thread's capabilities: {0}")]
    Read(#[source] io::Error),
    #[error("setting this thread's capabilities: {0}")]
    Set(#[source] io::Error),
    #[error("installing the handler that sets the other threads' capabilities: {0}")]
    Handler(#[source] io::Error),
    #[error("threads {tids:?} still hold more than the capabilities kept after {waited:?}")]
    Stragglers { tids: Vec<i32>, waited: Duration },
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The sets every thread is to hold, for the signal handler: effective,
/// permitted and inheritable, low word then high word.
static TARGET: [AtomicU32; 6] = [const { AtomicU32::new(0) }; 6];
/// Handler runs that failed; a failed thread is signalled again until the
/// deadline.
static FAILURES: AtomicUsize = AtomicUsize::new(0);

/// How long the other threads have to run the handler.
const DEADLINE: Duration = Duration::from_secs(5);

fn target() -> [CapData; 2] {
    let word = |i: usize| TARGET[i].load(Ordering::SeqCst);
    [
        CapData {
            effective: word(0),
            permitted: word(2),
            inheritable: word(4),
        },
        CapData {
            effective: word(1),
            permitted: word(3),
            inheritable: word(5),
        },
    ]
}

fn set_target(data: [CapData; 2]) {
    for (i, word) in [
        data[0].effective,
        data[1].effective,
        data[0].permitted,
        data[1].permitted,
        data[0].inheritable,
        data[1].inheritable,
    ]
    .into_iter()
    .enumerate()
    {
        TARGET[i].store(word, Ordering::SeqCst);
    }
}

fn capget() -> io::Result<[CapData; 2]> {
    let mut header = CapHeader {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: a version 3 header and the two sets it reads into.
    let r = unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) };
    if r == 0 {
        Ok(data)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's sets to `data`, and `no_new_privs`; async-signal
/// safe (two system calls). Returns whether both took.
fn apply(data: &[CapData; 2]) -> bool {
    let mut header = CapHeader {
        version: VERSION_3,
        pid: 0,
    };
    // SAFETY: a version 3 header and the two sets it reads.
    let set = unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) };
    // SAFETY: PR_SET_NO_NEW_PRIVS takes 1 and three zeros.
    let nnp = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    set == 0 && nnp == 0
}

extern "C" fn on_signal(_: libc::c_int) {
    // SAFETY: this thread's errno, saved and restored around the calls.
    let errno = unsafe { *libc::__errno_location() };
    if !apply(&target()) {
        FAILURES.fetch_add(1, Ordering::SeqCst);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The signal the handler runs on: the first real-time one the C library
/// leaves to programs, which nothing else in the agent uses.
fn signal() -> libc::c_int {
    libc::SIGRTMIN()
}

fn install_handler() -> io::Result<()> {
    static INSTALL: Once = Once::new();
    let mut result = Ok(());
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid one to fill in.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
        // Interrupted system calls resume: the threads reached are in the
        // middle of their work.
        action.sa_flags = libc::SA_RESTART;
        // SAFETY: the action's mask is ours to empty; the handler is
        // async-signal safe.
        let r = unsafe {
            libc::sigemptyset(&raw mut action.sa_mask);
            libc::sigaction(signal(), &raw const action, std::ptr::null_mut())
        };
        if r != 0 {
            result = Err(io::Error::last_os_error());
        }
    });
    result
}

/// The bits of `caps`.
fn mask<S: std::hash::BuildHasher>(caps: &HashSet<Capability, S>) -> u64 {
    caps.iter().fold(0, |m, c| m | c.bitmask())
}

/// Leaves every thread of the process with the capabilities of `keep` it
/// holds now, and no others, in its effective, permitted and inheritable
/// sets (the ambient set follows, as the kernel keeps it within both), and
/// `no_new_privs`. Returns the effective set kept.
pub fn keep_only<S: std::hash::BuildHasher>(
    keep: &HashSet<Capability, S>,
) -> Result<u64, ShedError> {
    let keep = mask(keep);
    let (lo, hi) = (keep as u32, (keep >> 32) as u32);
    let mut data = capget().map_err(ShedError::Read)?;
    for (word, m) in data.iter_mut().zip([lo, hi]) {
        word.effective &= m;
        word.permitted &= m;
        word.inheritable &= m;
    }
    set_target(data);
    install_handler().map_err(ShedError::Handler)?;
    if !apply(&data) {
        return Err(ShedError::Set(io::Error::last_os_error()));
    }
    let want = Sets::of(&data);
    let me = gettid();
    let started = Instant::now();
    loop {
        let pending: Vec<i32> = threads()
            .into_iter()
            .filter(|&tid| tid != me && Sets::of_thread(tid).is_some_and(|s| s != want))
            .collect();
        if pending.is_empty() {
            return Ok(want.effective);
        }
        if started.elapsed() > DEADLINE {
            return Err(ShedError::Stragglers {
                tids: pending,
                waited: started.elapsed(),
            });
        }
        for tid in pending {
            // SAFETY: a signal to a thread of this process, whose handler
            // is installed; a thread that has exited meanwhile is ESRCH.
            unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, signal()) };
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// This process's threads now.
fn threads() -> Vec<i32> {
    std::fs::read_dir("/proc/self/task")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A thread's sets as `/proc` shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
    pub no_new_privs: bool,
}

impl Sets {
    fn of(data: &[CapData; 2]) -> Sets {
        let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
        Sets {
            effective: join(data[0].effective, data[1].effective),
            permitted: join(data[0].permitted, data[1].permitted),
            inheritable: join(data[0].inheritable, data[1].inheritable),
            no_new_privs: true,
        }
    }

    /// A thread's sets; None once it has exited.
    fn of_thread(tid: i32) -> Option<Sets> {
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
        Sets::parse(&status)
    }

    /// The sets a `/proc/…/status` shows.
    pub fn parse(status: &str) -> Option<Sets> {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        let hex = |name: &str| field(name).and_then(|v| u64::from_str_radix(v, 16).ok());
        Some(Sets {
            effective: hex("CapEff:")?,
            permitted: hex("CapPrm:")?,
            inheritable: hex("CapInh:")?,
            no_new_privs: field("NoNewPrivs:")? == "1",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_status_is_read() {
        let status = "Name:\tebpf-proxy\nCapInh:\t0000000000000000\nCapPrm:\t0000008000001000\nCapEff:\t0000008000001000\nCapBnd:\t000001ffffffffff\nNoNewPrivs:\t1\n";
        assert_eq!(
            Sets::parse(status),
            Some(Sets {
                effective: (1 << 39) | (1 << 12),
                permitted: (1 << 39) | (1 << 12),
                inheritable: 0,
                no_new_privs: true,
            })
        );
        assert_eq!(Sets::parse("CapEff:\t0\n"), None, "fields missing");
    }

    #[test]
    fn the_two_words_are_one_set() {
        let data = [
            CapData {
                effective: 1 << 12,
                permitted: 1 << 12,
                inheritable: 0,
            },
            CapData {
                effective: 1 << 7,
                permitted: 1 << 7,
                inheritable: 0,
            },
        ];
        let sets = Sets::of(&data);
        assert_eq!(sets.effective, (1 << 39) | (1 << 12), "CAP_BPF is bit 39");
        let keep: HashSet<Capability> = [Capability::CAP_BPF, Capability::CAP_NET_ADMIN].into();
        assert_eq!(mask(&keep), sets.effective);
    }

    // Shedding itself changes the test process for good: it is proven on the
    // agent in tests/tests/capabilities.rs.
}
