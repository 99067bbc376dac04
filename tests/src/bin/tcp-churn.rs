//! `tcp-churn ADDR COUNT`: opens COUNT TCP connections to ADDR
//! (`a.b.c.d:port`) as fast as the machine allows, each one a nonblocking
//! `connect()` (which sends the SYN) closed at once, on one thread per CPU.
//! Prints `<started> <failed>`: connects that went out, and those the kernel
//! refused (the first refusal on stderr). A node's churn of short
//! connections, as the socket hooks see it: one `connect()` each. A socket
//! closed before its handshake ends holds no port in `TIME_WAIT`, so any count
//! fits the ephemeral range. The socket hooks' test runs it inside a cgroup,
//! which a thread of the test process cannot join on its own.

use std::{
    net::SocketAddrV4,
    process::ExitCode,
    sync::atomic::{AtomicU64, Ordering},
    thread,
};

use nix::{
    errno::Errno,
    sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, connect, socket},
};

fn main() -> ExitCode {
    let Some(addr) = ebpf_proxy_tests::addr_arg("tcp-churn") else {
        return ExitCode::from(2);
    };
    let Some(count) = std::env::args().nth(2).and_then(|n| n.parse::<u64>().ok()) else {
        eprintln!("usage: tcp-churn a.b.c.d:port COUNT");
        return ExitCode::from(2);
    };
    let next = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let threads = thread::available_parallelism().map_or(2, std::num::NonZero::get);
    thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < count {
                    if let Err(e) = connect_once(addr)
                        && failed.fetch_add(1, Ordering::Relaxed) == 0
                    {
                        eprintln!("tcp-churn {addr}: {e}");
                    }
                }
            });
        }
    });
    let failed = failed.into_inner();
    println!("{} {failed}", count - failed);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// One nonblocking connect, closed as soon as its SYN is out.
fn connect_once(addr: SocketAddrV4) -> Result<(), Errno> {
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    match connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::from(addr),
    ) {
        Ok(()) | Err(Errno::EINPROGRESS) => Ok(()),
        Err(e) => Err(e),
    }
}
