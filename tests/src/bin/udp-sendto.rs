//! `udp-sendto ADDR [--hold]`: sends one datagram to ADDR (`a.b.c.d:port` or `[v6]:port`)
//! from an unconnected UDP socket, as musl's resolver does, and prints the
//! first answer and whom it came from: `<answer> from <source>`. With
//! `--hold` it prints `sent` once the datagram is out and reads the answer
//! only after a line on stdin, so that a test can do something between the
//! send and the receive (the socket hooks show the answer's source at the
//! receive). The socket hooks' test runs it inside a cgroup, which a thread
//! of the test process cannot join on its own.

use std::{
    io::{BufRead, Write},
    net::{SocketAddr, UdpSocket},
    process::ExitCode,
    time::Duration,
};

fn main() -> ExitCode {
    let Some(addr) = ebpf_proxy_tests::sock_addr_arg("udp-sendto") else {
        return ExitCode::from(2);
    };
    let hold = std::env::args().nth(2).is_some_and(|a| a == "--hold");
    match exchange(addr, hold) {
        Ok((answer, from)) => {
            println!("{} from {from}", answer.trim());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("udp-sendto {addr}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn exchange(addr: SocketAddr, hold: bool) -> std::io::Result<(String, SocketAddr)> {
    let socket = UdpSocket::bind(ebpf_proxy_tests::any_addr_for(addr))?;
    socket.set_read_timeout(Some(Duration::from_secs(2)))?;
    socket.send_to(b"hi\n", addr)?;
    if hold {
        let mut out = std::io::stdout().lock();
        writeln!(out, "sent")?;
        out.flush()?;
        std::io::stdin().lock().read_line(&mut String::new())?;
    }
    let mut buf = [0u8; 512];
    let (n, from) = socket.recv_from(&mut buf)?;
    Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from))
}
