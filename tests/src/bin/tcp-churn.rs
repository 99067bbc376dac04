//! `tcp-churn ADDR COUNT`: opens COUNT TCP connections to ADDR
//! (`a.b.c.d:port` or `[v6]:port`, from a socket of ADDR's family) as fast as the machine allows, each one a nonblocking
//! `connect()` (which sends the SYN) closed at once, on one thread per CPU.
//! Prints `<started> <failed>`: connects that went out, and those the kernel
//! refused (the first refusal on stderr). A node's churn of short
//! connections, as the socket hooks see it: one `connect()` each. A socket
//! closed before its handshake ends holds no port in `TIME_WAIT`, so any count
//! fits the ephemeral range. The socket hooks' test runs it inside a cgroup,
//! which a thread of the test process cannot join on its own.

use std::{
    net::SocketAddr,
    os::fd::AsRawFd,
    process::ExitCode,
    sync::atomic::{AtomicU64, Ordering},
    thread,
};

use nix::{
    errno::Errno,
    sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, SockaddrIn6, connect, socket},
};

fn main() -> ExitCode {
    let Some(addr) = ebpf_proxy_tests::sock_addr_arg("tcp-churn") else {
        return ExitCode::from(2);
    };
    let Some(count) = std::env::args().nth(2).and_then(|n| n.parse::<u64>().ok()) else {
        eprintln!("usage: tcp-churn a.b.c.d:port|[v6]:port COUNT");
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
fn connect_once(addr: SocketAddr) -> Result<(), Errno> {
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let sent = match addr {
        SocketAddr::V4(addr) => connect(fd.as_raw_fd(), &SockaddrIn::from(addr)),
        SocketAddr::V6(addr) => connect(fd.as_raw_fd(), &SockaddrIn6::from(addr)),
    };
    match sent {
        Ok(()) | Err(Errno::EINPROGRESS) => Ok(()),
        Err(e) => Err(e),
    }
}
