//! `tcp-peer ADDR`: connects to ADDR (`a.b.c.d:port` or `[v6]:port`) and prints what
//! `getpeername()` says the socket is connected to, then the first line the
//! server sends: `<peer> <line>`. The socket hooks' test runs it inside a
//! cgroup, which a thread of the test process cannot join on its own.

use std::{
    io::{BufRead, BufReader},
    net::{SocketAddr, TcpStream},
    process::ExitCode,
    time::Duration,
};

fn main() -> ExitCode {
    let Some(addr) = ebpf_proxy_tests::sock_addr_arg("tcp-peer") else {
        return ExitCode::from(2);
    };
    match exchange(addr) {
        Ok((peer, line)) => {
            println!("{peer} {}", line.trim());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tcp-peer {addr}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn exchange(addr: SocketAddr) -> std::io::Result<(SocketAddr, String)> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let peer = stream.peer_addr()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    Ok((peer, line))
}
