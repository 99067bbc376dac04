//! `udp-connected ADDR`: one UDP socket connected to ADDR (`a.b.c.d:port` or `[v6]:port`)
//! for the process's whole life, as a long-lived client keeps it. Each line
//! read from stdin is sent as a datagram and answered on stdout by one line:
//! the first answer (trimmed), or `error: <what>` when the send or the
//! receive fails (within 1 s). The line `peer` is not sent: it is answered
//! with what `getpeername()` says. The socket hooks' test runs it inside a
//! cgroup, which a thread of the test process cannot join on its own.

use std::{
    io::{BufRead, Write},
    net::{SocketAddr, UdpSocket},
    process::ExitCode,
    time::Duration,
};

fn main() -> ExitCode {
    let Some(addr) = ebpf_proxy_tests::sock_addr_arg("udp-connected") else {
        return ExitCode::from(2);
    };
    let socket = match connect(addr) {
        Ok(socket) => socket,
        Err(e) => {
            eprintln!("udp-connected {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let answer = if line == "peer" {
            socket.peer_addr().map(|a| a.to_string())
        } else {
            exchange(&socket, line.as_bytes())
        }
        .unwrap_or_else(|e| format!("error: {e}"));
        if writeln!(out, "{answer}")
            .and_then(|()| out.flush())
            .is_err()
        {
            break;
        }
    }
    ExitCode::SUCCESS
}

fn connect(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let socket = UdpSocket::bind(ebpf_proxy_tests::any_addr_for(addr))?;
    socket.set_read_timeout(Some(Duration::from_secs(1)))?;
    socket.connect(addr)?;
    Ok(socket)
}

fn exchange(socket: &UdpSocket, datagram: &[u8]) -> std::io::Result<String> {
    socket.send(datagram)?;
    let mut buf = [0u8; 512];
    let n = socket.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim().to_owned())
}
