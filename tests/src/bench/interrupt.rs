//! Ctrl-C during a benchmark: the run stops at the next exchange and unwinds through
//! the `Drop`s, which remove the namespaces and stop the agents.

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use nix::libc;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

/// Set by SIGINT/SIGTERM: the run stops at the next exchange and unwinds through the
/// `Drop`s, which remove the namespaces and stop the agents.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::Relaxed) {
        // A second signal: the user wants out now, even from a step that does not look
        // at the flag (an agent starting on 10,000 Services). What is left behind
        // carries this pid, and `cargo xtask` removes it on its next start.
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

/// Routes SIGINT and SIGTERM to [`INTERRUPTED`].
pub fn install_signal_handlers() -> Result<()> {
    let handler = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(signal, &handler) }.context("install the signal handler")?;
    }
    Ok(())
}

pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}
