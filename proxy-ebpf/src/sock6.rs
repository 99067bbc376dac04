//! The socket hooks of the node's IPv6 sockets: `sock`'s translation, for
//! `connect()`, `sendmsg()`, `recvmsg()` and `getpeername()` of an
//! `AF_INET6` socket.
//!
//! An IPv6 socket may also talk IPv4, to an IPv4-mapped address
//! (`::ffff:a.b.c.d`): that destination is the IPv4 frontend it names, and
//! goes to an IPv4 backend, IPv4-mapped, with the node as the same client
//! as its IPv4 sockets (one affinity entry, the same source ranges). Such a
//! socket's notes are kept in `SOCK_NOTES` by the IPv4 address, beside
//! those of IPv4 sockets; notes of IPv6 backends in `SOCK_NOTES6`. The
//! kernel runs the IPv4 `sendmsg` hook, not this one, for a datagram of an
//! IPv6 socket to an IPv4-mapped address, and `recvmsg6` for its answer.
//!
//! `127.0.0.1:<nodePort>` reached as `::ffff:127.0.0.1` is a NodePort as
//! from an IPv4 socket; `[::1]:<nodePort>` is not, as kube-proxy serves
//! localhost NodePorts on IPv4 only (the kernel has no `route_localnet`
//! for IPv6).

use core::ffi::c_void;

use aya_ebpf::programs::SockAddrContext;
use proxy_common::{
    PROTO_TCP, PROTO_UDP, SockNote, SockNote6, SockNotes6, SockNotes6Record, is_v4_mapped,
    node_config_flags, sock_counter, sock_note, sock_note_slot6, v4_mapped,
};

use crate::{
    frontend::{self, Frontend},
    maps::{SOCK_NOTES, SOCK_NOTES6, count_sock, node_addr6, node_config},
    sock::{ALLOW, Note, dump, keep, loopback, node_socket, pick, remember},
};

/// An IPv6 `connect()` of a TCP or UDP socket.
#[inline(always)]
pub fn connect6(ctx: &SockAddrContext) -> i32 {
    translate(ctx, sock_counter::TRANSLATED, sock_note::CONNECTED)
}

/// A datagram an unconnected IPv6 UDP socket sends with an address.
#[inline(always)]
pub fn sendmsg6(ctx: &SockAddrContext) -> i32 {
    translate(ctx, sock_counter::SENDMSG_TRANSLATED, sock_note::SENT)
}

/// A datagram an IPv6 UDP socket of the node receives: from a backend it
/// was sent to in a frontend's place, it shows the frontend.
#[inline(always)]
pub fn recvmsg6(ctx: &SockAddrContext) -> i32 {
    show_frontend(ctx)
}

/// `getpeername()` of an IPv6 socket `connect6` sent to a backend: the
/// frontend.
#[inline(always)]
pub fn getpeername6(ctx: &SockAddrContext) -> i32 {
    show_frontend(ctx)
}

/// Replaces the address the kernel reports, a backend this socket was sent
/// to in a frontend's place, by that frontend.
#[inline(always)]
fn show_frontend(ctx: &SockAddrContext) -> i32 {
    if !node_socket(ctx) {
        return ALLOW;
    }
    let (addr_be, port_be) = user_addr(ctx);
    if is_v4_mapped(&addr_be) {
        // SAFETY: the context's socket, valid for this run; without the
        // create flag the helper only looks (null: the socket has no notes).
        let notes = unsafe { SOCK_NOTES.get_ptr_mut(ctx) };
        if notes.is_null() {
            return ALLOW;
        }
        // SAFETY: not null, so the socket's storage, valid for this run.
        if let Some(note) = unsafe { (*notes).find(addr_be[3], port_be) }.copied() {
            set_user_addr(ctx, v4_mapped(note.frontend_be), note.frontend_port_be);
        }
    } else {
        // SAFETY: as above, for the IPv6 notes.
        let notes = unsafe { SOCK_NOTES6.get_ptr_mut(ctx) };
        if notes.is_null() {
            return ALLOW;
        }
        // SAFETY: not null, so the socket's storage, valid for this run.
        if let Some(note) = unsafe { (*notes).find(&addr_be, port_be) }.copied() {
            set_user_addr(ctx, note.frontend_be, note.frontend_port_be);
        }
    }
    ALLOW
}

/// `sock::remember` for an IPv6 backend, in `SOCK_NOTES6`.
#[inline(always)]
fn remember6(ctx: &SockAddrContext, note: SockNote6) {
    // SAFETY: the context's socket, valid for this run; the helper creates
    // zeroed storage when the socket has none.
    let notes = unsafe { SOCK_NOTES6.get_or_insert_ptr_mut(ctx, None) };
    if notes.is_null() {
        return;
    }
    // SAFETY: not null, so the socket's storage, valid for this run.
    keep(unsafe { &mut (*notes).notes }, note);
}

impl Note for SockNote6 {
    #[inline(always)]
    fn slot(&self) -> usize {
        sock_note_slot6(&self.backend_be, self.backend_port_be)
    }

    #[inline(always)]
    fn same(&self, other: &Self) -> bool {
        self.backend_be == other.backend_be
            && self.backend_port_be == other.backend_port_be
            && self.frontend_be == other.frontend_be
            && self.frontend_port_be == other.frontend_port_be
    }

    #[inline(always)]
    fn how(&self) -> u32 {
        self.how
    }

    #[inline(always)]
    fn with_how(self, how: u32) -> Self {
        SockNote6 { how, ..self }
    }
}

/// The IPv6 address (four words in network order) and port the program may
/// rewrite. Read a word at a time: the verifier allows no other width on
/// every kernel.
#[inline(always)]
fn user_addr(ctx: &SockAddrContext) -> ([u32; 4], u16) {
    // SAFETY: the kernel's context of this program, valid for its run; the
    // port sits in network order in the low 16 bits.
    unsafe {
        let sa = ctx.sock_addr;
        let ip = &raw const (*sa).user_ip6;
        (
            [
                core::ptr::read_volatile(&raw const (*ip)[0]),
                core::ptr::read_volatile(&raw const (*ip)[1]),
                core::ptr::read_volatile(&raw const (*ip)[2]),
                core::ptr::read_volatile(&raw const (*ip)[3]),
            ],
            (*sa).user_port as u16,
        )
    }
}

/// Rewrites the address: the destination in connect6 and sendmsg6, the
/// reported peer in recvmsg6 and getpeername6. A word at a time, as read.
#[inline(always)]
fn set_user_addr(ctx: &SockAddrContext, addr_be: [u32; 4], port_be: u16) {
    // SAFETY: as in `user_addr`; these hooks may rewrite the address.
    unsafe {
        let sa = ctx.sock_addr;
        let ip = &raw mut (*sa).user_ip6;
        core::ptr::write_volatile(&raw mut (*ip)[0], addr_be[0]);
        core::ptr::write_volatile(&raw mut (*ip)[1], addr_be[1]);
        core::ptr::write_volatile(&raw mut (*ip)[2], addr_be[2]);
        core::ptr::write_volatile(&raw mut (*ip)[3], addr_be[3]);
        (*sa).user_port = u32::from(port_be);
    }
}

/// The frontend an IPv6 socket of the node is addressed to, and the client
/// the node is to it: for an IPv4-mapped destination the IPv4 frontend and
/// the node's IPv4 address (as `sock::translate`), else the IPv6 frontend
/// and the node's IPv6 address.
#[inline(always)]
fn frontend_of(dst_be: &[u32; 4], dport_be: u16, proto: u8) -> Option<(Frontend, [u32; 4])> {
    if is_v4_mapped(dst_be) {
        let node = node_config();
        let localhost_nodeport =
            loopback(dst_be[3]) && node.flags & node_config_flags::LOCALHOST_NODEPORTS != 0;
        let frontend =
            frontend::lookup_frontend_of(dst_be[3], dport_be, proto, || true).or_else(|| {
                localhost_nodeport
                    .then(|| frontend::lookup_nodeport(dport_be, proto, || true))
                    .flatten()
            })?;
        Some((frontend, v4_mapped(node.snat_addr_be[3])))
    } else {
        let frontend = frontend::lookup_frontend_of6(*dst_be, dport_be, proto, || true)?;
        Some((frontend, node_addr6()))
    }
}

/// Replaces a frontend destination of the node's own IPv6 socket by a
/// backend of the same family; counts it at `counted` and notes it as `how`.
#[inline(always)]
fn translate(ctx: &SockAddrContext, counted: u32, how: u32) -> i32 {
    // SAFETY: the kernel's context of this program, valid for its run.
    let proto = unsafe { (*ctx.sock_addr).protocol };
    let proto = match proto {
        p if p == u32::from(PROTO_TCP) => PROTO_TCP,
        p if p == u32::from(PROTO_UDP) => PROTO_UDP,
        _ => return ALLOW,
    };
    if !node_socket(ctx) {
        return ALLOW;
    }
    let (dst_be, dport_be) = user_addr(ctx);
    let Some((frontend, client_be)) = frontend_of(&dst_be, dport_be, proto) else {
        return ALLOW;
    };
    let backend = match pick(&frontend, client_be) {
        Ok(backend) => backend,
        Err(verdict) => return verdict,
    };
    // The planner keeps each family's frontends to that family's
    // endpoints; a backend of the other family is a map being rewritten.
    let mapped = is_v4_mapped(&dst_be);
    if is_v4_mapped(&backend.addr_be) != mapped {
        return ALLOW;
    }
    if mapped {
        remember(
            ctx,
            SockNote {
                backend_be: backend.addr_be[3],
                frontend_be: dst_be[3],
                backend_port_be: backend.port_be,
                frontend_port_be: dport_be,
                how,
            },
        );
    } else {
        remember6(
            ctx,
            SockNote6 {
                backend_be: backend.addr_be,
                frontend_be: dst_be,
                backend_port_be: backend.port_be,
                frontend_port_be: dport_be,
                how,
            },
        );
    }
    set_user_addr(ctx, backend.addr_be, backend.port_be);
    count_sock(counted);
    ALLOW
}

/// One iteration over the UDP sockets: writes the socket's cookie and notes
/// when it holds notes in `SOCK_NOTES6`.
#[inline(always)]
pub fn dump_notes6(ctx: *mut c_void) -> i32 {
    dump(ctx, &SOCK_NOTES6, |cookie, notes: SockNotes6| {
        SockNotes6Record { cookie, notes }
    })
}
