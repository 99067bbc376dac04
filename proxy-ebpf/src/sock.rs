//! Connections that start on the node itself: host-network pods, the
//! kubelet, node agents. Their packets leave through the stack's output path
//! and never cross tc ingress, so the frontend is replaced by a backend at
//! `connect()` instead (and at each `sendmsg()` of an unconnected UDP
//! socket), as kube-proxy's `OUTPUT` chain DNATs them. A connected socket
//! keeps its backend for its whole life, so no conntrack entry is needed,
//! and the packets carry the backend's address from the first one.
//!
//! A connection to a loopback address and a NodePort is that NodePort's
//! when the agent says so (`LOCALHOST_NODEPORTS`), as kube-proxy's iptables
//! mode serves `127.0.0.1:<nodePort>`. It is read here only: a packet that
//! arrives addressed to a loopback address is never translated.
//!
//! What the hooks remember about a socket (which backend it was sent to in
//! which frontend's place) lives in the socket's own storage (`SOCK_NOTES`,
//! `BPF_MAP_TYPE_SK_STORAGE`): the kernel frees it with the socket, so the
//! node's TCP churn can neither evict a long-lived UDP socket's notes nor
//! leave its own behind.
//!
//! Only sockets of the node's own network namespace: pods' sockets sit in
//! cgroups below the same root, but their packets are translated at tc, with
//! the client address kept.

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext,
    bindings::seq_file,
    btf_maps::SkStorage,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_seq_write, bpf_sk_storage_get},
    programs::SockAddrContext,
};
use proxy_common::{
    Backend, PROTO_TCP, PROTO_UDP, SockNote, SockNotes, SockNotesRecord, is_v4_mapped,
    node_config_flags, service_flags, sock_counter, sock_note, sock_note_slot, v4_mapped,
};

use crate::{
    conntrack,
    frontend::{self, Frontend},
    maps::{HOST_NETNS, SOCK_NOTES, count_sock, node_config},
};

/// `connect()` goes ahead (with its destination as this left it).
pub const ALLOW: i32 = 1;
/// `connect()` fails (EPERM unless the program set another error).
pub const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// An IPv4 `connect()` of a TCP or UDP socket.
#[inline(always)]
pub fn connect4(ctx: &SockAddrContext) -> i32 {
    translate(ctx, sock_counter::TRANSLATED, sock_note::CONNECTED)
}

/// A datagram an unconnected UDP socket sends with an address: each one is
/// balanced anew, as each DNS query of a resolver that does not connect.
#[inline(always)]
pub fn sendmsg4(ctx: &SockAddrContext) -> i32 {
    translate(ctx, sock_counter::SENDMSG_TRANSLATED, sock_note::SENT)
}

/// A datagram a UDP socket of the node receives: from a backend it was
/// sent to in a frontend's place, it shows the frontend as its source, so
/// that a resolver that checks whom it asked takes the answer.
#[inline(always)]
pub fn recvmsg4(ctx: &SockAddrContext) -> i32 {
    show_frontend(ctx)
}

/// `getpeername()` of a socket of the node that `connect4` sent to a
/// backend: the frontend, as a connection DNATed by kube-proxy shows.
#[inline(always)]
pub fn getpeername4(ctx: &SockAddrContext) -> i32 {
    show_frontend(ctx)
}

/// Replaces the address the kernel reports, a backend this socket was
/// sent to in a frontend's place (a note in its `SOCK_NOTES`), by that
/// frontend.
#[inline(always)]
fn show_frontend(ctx: &SockAddrContext) -> i32 {
    if !node_socket(ctx) {
        return ALLOW;
    }
    let (addr_be, port_be) = user_addr(ctx);
    // SAFETY: the context's socket, valid for this run; without the create
    // flag the helper only looks (null: the socket has no notes).
    let notes = unsafe { SOCK_NOTES.get_ptr_mut(ctx) };
    if notes.is_null() {
        return ALLOW;
    }
    // SAFETY: not null, so the socket's storage, valid for this run.
    if let Some(note) = unsafe { (*notes).find(addr_be, port_be) }.copied() {
        set_user_addr(ctx, note.frontend_be, note.frontend_port_be);
    }
    ALLOW
}

/// Notes in the socket's own storage (created on its first note) that the
/// hooks sent it to `note`'s backend in its frontend's place. The kernel
/// refuses storage only when the socket's option memory is used up: the
/// socket is still translated, and only its answers and peer then show the
/// backend, which is why a failure here is not worth a refusal.
#[inline(always)]
pub(crate) fn remember(ctx: &SockAddrContext, note: SockNote) {
    // SAFETY: the context's socket, valid for this run; the helper creates
    // zeroed storage when the socket has none.
    let notes = unsafe { SOCK_NOTES.get_or_insert_ptr_mut(ctx, None) };
    if notes.is_null() {
        return;
    }
    // SAFETY: not null, so the socket's storage, valid for this run.
    keep(unsafe { &mut (*notes).notes }, note);
}

/// A note of either family (`SockNote`, `SockNote6`), for `keep`.
pub(crate) trait Note: Copy {
    /// Its slot (`sock_note_slot`), below `SOCK_NOTE_SLOTS`.
    fn slot(&self) -> usize;
    /// Whether it names the same backend in the same frontend's place.
    fn same(&self, other: &Self) -> bool;
    fn how(&self) -> u32;
    fn with_how(self, how: u32) -> Self;
}

impl Note for SockNote {
    #[inline(always)]
    fn slot(&self) -> usize {
        sock_note_slot(self.backend_be, self.backend_port_be)
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
        SockNote { how, ..self }
    }
}

/// Keeps `note` in its slot of a socket's notes: the ways the hooks sent
/// the socket to the same backend add up, and a note of another backend
/// takes the slot over.
#[inline(always)]
pub(crate) fn keep<N: Note>(notes: &mut [N], note: N) {
    let Some(kept) = notes.get_mut(note.slot()) else {
        return;
    };
    let how = if kept.same(&note) {
        kept.how() | note.how()
    } else {
        note.how()
    };
    *kept = note.with_how(how);
}

/// The address and port (both in network order) the program may rewrite.
#[inline(always)]
fn user_addr(ctx: &SockAddrContext) -> (u32, u16) {
    // SAFETY: the kernel's context of this program, valid for its run; the
    // port sits in network order in the low 16 bits.
    unsafe { ((*ctx.sock_addr).user_ip4, (*ctx.sock_addr).user_port as u16) }
}

/// Rewrites the address: the destination in connect4 and sendmsg4, the
/// reported peer in recvmsg4 and getpeername4.
#[inline(always)]
fn set_user_addr(ctx: &SockAddrContext, addr_be: u32, port_be: u16) {
    // SAFETY: as in `user_addr`; these hooks may rewrite the address.
    unsafe {
        (*ctx.sock_addr).user_ip4 = addr_be;
        (*ctx.sock_addr).user_port = u32::from(port_be);
    }
}

/// Whether the socket is in the node's network namespace (never, until the
/// agent has said which that is).
#[inline(always)]
pub(crate) fn node_socket(ctx: &SockAddrContext) -> bool {
    let host = HOST_NETNS.get(0).copied().unwrap_or(0);
    // SAFETY: a sock_addr context is a valid argument of this helper.
    host != 0 && unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } == host
}

/// Whether `addr_be` is in `127.0.0.0/8`.
#[inline(always)]
pub(crate) fn loopback(addr_be: u32) -> bool {
    u32::from_be(addr_be) >> 24 == 127
}

/// Replaces a frontend destination of the node's own socket by a backend;
/// counts it at `counted` and notes it as `how` (`sock_note`).
#[inline(always)]
fn translate(ctx: &SockAddrContext, counted: u32, how: u32) -> i32 {
    // SAFETY: the kernel's context of this program, valid for its run.
    let proto = unsafe { (*ctx.sock_addr).protocol };
    let (dst_be, dport_be) = user_addr(ctx);
    let proto = match proto {
        p if p == u32::from(PROTO_TCP) => PROTO_TCP,
        p if p == u32::from(PROTO_UDP) => PROTO_UDP,
        _ => return ALLOW,
    };
    if !node_socket(ctx) {
        return ALLOW;
    }
    // The node is its own client: in the cluster, as kube-proxy sends locally
    // started connections to every endpoint (`--src-type LOCAL`), and one
    // client to session affinity and source ranges, by the node's address.
    let node = node_config();
    let localhost_nodeport =
        loopback(dst_be) && node.flags & node_config_flags::LOCALHOST_NODEPORTS != 0;
    let frontend = frontend::lookup_frontend_of(dst_be, dport_be, proto, || true).or_else(|| {
        localhost_nodeport
            .then(|| frontend::lookup_nodeport(dport_be, proto, || true))
            .flatten()
    });
    let Some(frontend) = frontend else {
        return ALLOW;
    };
    let backend = match pick(&frontend, v4_mapped(node.snat_addr_be[3])) {
        Ok(backend) => backend,
        Err(verdict) => return verdict,
    };
    if !is_v4_mapped(&backend.addr_be) {
        return ALLOW;
    }
    // Answers come from the backend and the socket's peer is the backend;
    // `recvmsg4` and `getpeername4` show the frontend.
    remember(
        ctx,
        SockNote {
            backend_be: backend.addr_be[3],
            frontend_be: dst_be,
            backend_port_be: backend.port_be,
            frontend_port_be: dport_be,
            how,
        },
    );
    set_user_addr(ctx, backend.addr_be[3], backend.port_be);
    count_sock(counted);
    ALLOW
}

/// The backend a connection of the node (`client_be`, IPv4-mapped for
/// IPv4) to `frontend` goes to, or the hook's verdict without one: a
/// client outside the source ranges goes ahead untranslated, as does one
/// to a frontend without endpoints that drops; one that rejects is refused,
/// counted.
#[inline(always)]
pub(crate) fn pick(frontend: &Frontend, client_be: [u32; 4]) -> Result<Backend, i32> {
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0
        && !frontend::source_allowed_for6(frontend, client_be)
    {
        return Err(ALLOW);
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            // Left as it is: nothing answers the frontend's address, as
            // nothing answers kube-proxy's dropped packets.
            return Err(ALLOW);
        }
        count_sock(sock_counter::REFUSED);
        // SAFETY: a plain helper call; cgroup programs may set the error.
        unsafe { aya_ebpf::helpers::bpf_set_retval(-ECONNREFUSED) };
        return Err(REFUSE);
    }
    match frontend::select_for(svc, client_be, conntrack::now_ns()) {
        Some((_, backend)) => Ok(backend),
        None => Err(ALLOW),
    }
}

/// `struct bpf_iter_meta` (include/linux/bpf.h): the head of every
/// iterator context.
#[repr(C)]
struct IterMeta {
    seq: *mut seq_file,
    session_id: u64,
    seq_num: u64,
}

/// `struct bpf_iter__udp` (`net/ipv4/udp.c`): one UDP socket of the reader's
/// network namespace, IPv6 ones included (one table holds both); `udp_sk`
/// is null in the last call, after the last socket.
#[repr(C)]
struct UdpIter {
    meta: *const IterMeta,
    udp_sk: *mut c_void,
}

/// One iteration over the UDP sockets: writes the socket's cookie and notes
/// when it holds notes in `SOCK_NOTES`.
#[inline(always)]
pub fn dump_notes(ctx: *mut c_void) -> i32 {
    dump(ctx, &SOCK_NOTES, |cookie, notes: SockNotes| {
        SockNotesRecord { cookie, notes }
    })
}

/// One iteration over the UDP sockets: when the socket holds a value (`V`)
/// in `notes`, a socket-local storage map, writes the record `record` makes
/// of the socket's cookie and that value.
///
/// Over the sockets rather than over the map (`iter/bpf_sk_storage_map`):
/// kernels that refuse iterators over a map's elements at load (`EPERM`,
/// seen on 6.18) still load one over the UDP table, and the sockets the
/// agent closes are UDP sockets of its own namespace.
#[inline(always)]
pub(crate) fn dump<V: Copy, R>(
    ctx: *mut c_void,
    notes: &SkStorage<V>,
    record: impl FnOnce(u64, V) -> R,
) -> i32 {
    // SAFETY: the context of an iterator over the UDP table, laid out as
    // `UdpIter`, valid for this run.
    let iter = unsafe { &*(ctx as *const UdpIter) };
    let sk = iter.udp_sk;
    if sk.is_null() {
        return 0;
    }
    // SAFETY: a socket the kernel holds for this run; no value is created
    // (flags 0), an existing one only read.
    let value = unsafe {
        bpf_sk_storage_get(
            core::ptr::from_ref(notes).cast_mut().cast(),
            sk,
            core::ptr::null_mut(),
            0,
        )
    }
    .cast::<V>();
    if value.is_null() {
        return 0;
    }
    let record = record(
        // SAFETY: a socket the kernel holds for this run.
        unsafe { bpf_get_socket_cookie(sk) },
        // SAFETY: not null, so the socket's value of this map.
        unsafe { *value },
    );
    // SAFETY: the iterator's own output, valid for this run; the record is
    // on this program's stack.
    unsafe {
        bpf_seq_write(
            (*iter.meta).seq,
            (&raw const record).cast(),
            size_of::<R>() as u32,
        )
    };
    0
}
