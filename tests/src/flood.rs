//! Floods of new flows, as a hostile or broken client sends them: TCP SYNs from
//! ever new source ports that never complete a handshake, written through a raw
//! socket so that no local socket state limits their rate.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use anyhow::{Result, bail};
use nix::libc;

use crate::frames::{self, Spec, Spec6};

/// Frames a flood sends between two calls of its pacing: a veth's queue (256
/// frames under XDP) takes a burst whole.
pub const BURST: u32 = 64;

/// Sends `count` TCP SYNs from `src` to `dst` from the calling thread's network
/// namespace, source ports cycling over 1024-65535; returns how many the kernel took.
/// After every [`BURST`], `pace(sent so far)` returns once the receiver has taken
/// them (see [`send_raw`]).
pub fn syn_flood_here(
    src: Ipv4Addr,
    dst: SocketAddrV4,
    count: u32,
    pace: impl FnMut(u32),
) -> Result<u32> {
    let to = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(dst.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    send_raw(libc::AF_INET, &to, count, pace, |sport| {
        frames::build(&Spec {
            src,
            dst: *dst.ip(),
            sport,
            dport: dst.port(),
            proto: frames::TCP,
            tcp_flags: frames::SYN,
            payload: Vec::new(),
            udp_no_csum: false,
        })
    })
}

/// [`syn_flood_here`] over IPv6: `count` SYNs from `src` to `dst`, through a raw
/// socket that takes whole IPv6 packets (`IPPROTO_RAW` implies the header is
/// the caller's, as for IPv4).
pub fn syn_flood6_here(
    src: Ipv6Addr,
    dst: SocketAddrV6,
    count: u32,
    pace: impl FnMut(u32),
) -> Result<u32> {
    let to = libc::sockaddr_in6 {
        sin6_family: libc::AF_INET6 as libc::sa_family_t,
        sin6_port: 0,
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr {
            s6_addr: dst.ip().octets(),
        },
        sin6_scope_id: 0,
    };
    send_raw(libc::AF_INET6, &to, count, pace, |sport| {
        frames::build6(&Spec6 {
            src,
            dst: *dst.ip(),
            sport,
            dport: dst.port(),
            proto: frames::TCP,
            tcp_flags: frames::SYN,
            payload: Vec::new(),
            ext: Vec::new(),
        })
    })
}

/// Sends `count` frames `frame(source port)` builds, without their Ethernet
/// header, through a raw socket of `domain` to `to` (a `sockaddr_in` or
/// `sockaddr_in6`); returns how many the kernel took. A raw socket outruns any
/// receiver, and what a full veth queue drops no datapath ever sees: so after
/// each [`BURST`] `pace` is given the frames sent so far and returns when the
/// receiver has caught up, which keeps the flood as fast as the node takes it
/// on a machine of any speed or load.
fn send_raw<A>(
    domain: libc::c_int,
    to: &A,
    count: u32,
    mut pace: impl FnMut(u32),
    frame: impl Fn(u16) -> Vec<u8>,
) -> Result<u32> {
    // SAFETY: plain system calls on a descriptor this function owns.
    let fd = unsafe { libc::socket(domain, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        bail!("raw socket: {}", std::io::Error::last_os_error());
    }
    let mut sent = 0;
    for i in 0..count {
        let frame = frame(1024 + (i % 64_512) as u16);
        let packet = &frame[14..];
        // SAFETY: `packet` and `to` outlive the call; the lengths are theirs.
        let n = unsafe {
            libc::sendto(
                fd,
                packet.as_ptr().cast(),
                packet.len(),
                0,
                std::ptr::from_ref(to).cast(),
                size_of::<A>() as libc::socklen_t,
            )
        };
        if n == packet.len() as isize {
            sent += 1;
        }
        if i % BURST == BURST - 1 {
            pace(i + 1);
        }
    }
    // SAFETY: closes the descriptor opened above, once.
    unsafe { libc::close(fd) };
    Ok(sent)
}
