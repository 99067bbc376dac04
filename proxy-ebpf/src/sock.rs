//! Connections that start on the node itself: host-network pods, the
//! kubelet, node agents. Their packets leave through the stack's output path
//! and never cross tc ingress, so the frontend is replaced by a backend at
//! `connect()` instead (and at each `sendmsg()` of an unconnected UDP
//! socket), as kube-proxy's `OUTPUT` chain DNATs them. A connected socket
//! keeps its backend for its whole life, so no conntrack entry is needed,
//! and the packets carry the backend's address from the first one. Written
//! once over the family (`SockFamily`): the `AF_INET` hooks and the
//! `AF_INET6` ones run the same code.
//!
//! A connection to a loopback address and a NodePort is that NodePort's
//! when the agent says so (`LOCALHOST_NODEPORTS`), as kube-proxy's iptables
//! mode serves `127.0.0.1:<nodePort>`. It is read here only: a packet that
//! arrives addressed to a loopback address is never translated.
//!
//! An IPv6 socket may also talk IPv4, to an IPv4-mapped address
//! (`::ffff:a.b.c.d`): that destination is the IPv4 frontend it names, and
//! goes to an IPv4 backend, IPv4-mapped, with the node as the same client
//! as its IPv4 sockets (one affinity entry, the same source ranges).
//! `127.0.0.1:<nodePort>` reached as `::ffff:127.0.0.1` is a NodePort as
//! from an IPv4 socket; `[::1]:<nodePort>` is not, as kube-proxy serves
//! localhost NodePorts on IPv4 only (the kernel has no `route_localnet` for
//! IPv6). The kernel runs the IPv4 `sendmsg` hook, not the IPv6 one, for a
//! datagram of an IPv6 socket to an IPv4-mapped address, and the IPv6
//! `recvmsg` hook for its answer.
//!
//! What the hooks remember about a socket (which backend it was sent to in
//! which frontend's place) lives in the socket's own storage (`SOCK_NOTES`,
//! and `SOCK_NOTES6` for IPv6 backends; `BPF_MAP_TYPE_SK_STORAGE`): the
//! kernel frees it with the socket, so the node's TCP churn can neither
//! evict a long-lived UDP socket's notes nor leave its own behind. An IPv6
//! socket sent to an IPv4-mapped backend is noted in `SOCK_NOTES`, by the
//! IPv4 address, beside the notes of IPv4 sockets.
//!
//! Sockets of the node's own network namespace, and with `--socket-lb-pods`
//! (`node_config_flags::SOCKET_LB_PODS`) the TCP `connect()`s of pods (every
//! other namespace: pods' sockets sit in cgroups below the same root) to
//! ClusterIPs without session affinity. A pod's other sockets, and every
//! pod socket without that flag, are translated at tc with the client
//! address kept. A pod's datagrams stay tc's because the agent closes only
//! its own namespace's UDP sockets whose backend leaves; a pod's TCP
//! connection to a departed backend ends as it would under kube-proxy.

use core::ffi::c_void;

use aya_ebpf::{
    EbpfContext,
    bindings::seq_file,
    btf_maps::SkStorage,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_seq_write, bpf_sk_storage_get},
    programs::SockAddrContext,
};
use proxy_common::{
    Backend, FlowAddr, PROTO_TCP, PROTO_UDP, SockAddr, SockNoteOf, SockNotesOf, SockNotesRecordOf,
    is_v4_mapped, node_config_flags, service_flags, sock_counter, sock_note, v4_mapped,
};

use crate::{
    conntrack,
    family::{Family, V4, V6},
    frontend::{self, Frontend},
    maps::{HOST_NETNS, SOCK_NOTES, SOCK_NOTES6, count_sock, node_addr6, node_config, node_flags},
    service_counters,
};

/// `connect()` goes ahead (with its destination as this left it).
pub const ALLOW: i32 = 1;
/// `connect()` fails (EPERM unless the program set another error).
pub const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// What differs between the families' socket hooks: the context's address
/// fields, the frontend a destination names, and where a backend is noted.
pub trait SockFamily: Family<Addr: SockAddr> {
    /// The notes of this family's backends.
    fn notes() -> &'static SkStorage<SockNotesOf<Self::Addr>>;

    /// The address and port (both in network order) the program may
    /// rewrite: the destination in `connect` and `sendmsg`, the reported
    /// peer in `recvmsg` and `getpeername`.
    fn user_addr(ctx: &SockAddrContext) -> (Self::Addr, u16);

    /// Rewrites what `user_addr` reads.
    fn set_user_addr(ctx: &SockAddrContext, addr_be: &Self::Addr, port_be: u16);

    /// The frontend `dst_be:dport_be` names, and the client the node is to
    /// it (IPv4-mapped for IPv4).
    fn frontend_of(dst_be: &Self::Addr, dport_be: u16, proto: u8) -> Option<(Frontend, [u32; 4])>;

    /// `backend`'s address as the socket is to see it, or None when it is
    /// not of the destination's family (the planner keeps each family's
    /// frontends to that family's endpoints: a backend of the other family
    /// is a map being rewritten).
    fn backend_addr(dst_be: &Self::Addr, backend: &Backend) -> Option<Self::Addr>;

    /// Notes that the socket was sent to `backend_be:backend_port_be` in
    /// the place of `frontend_be:frontend_port_be`, as `how`.
    fn note(
        ctx: &SockAddrContext,
        backend_be: &Self::Addr,
        backend_port_be: u16,
        frontend_be: &Self::Addr,
        frontend_port_be: u16,
        how: u32,
    );

    /// The frontend the socket was sent to backend `addr_be:port_be` in
    /// the place of, if it was.
    fn noted_frontend(
        ctx: &SockAddrContext,
        addr_be: &Self::Addr,
        port_be: u16,
    ) -> Option<(Self::Addr, u16)>;
}

impl SockFamily for V4 {
    #[inline(always)]
    fn notes() -> &'static SkStorage<SockNotesOf<u32>> {
        &SOCK_NOTES
    }

    #[inline(always)]
    fn user_addr(ctx: &SockAddrContext) -> (u32, u16) {
        // SAFETY: the kernel's context of this program, valid for its run;
        // the port sits in network order in the low 16 bits.
        unsafe { ((*ctx.sock_addr).user_ip4, (*ctx.sock_addr).user_port as u16) }
    }

    #[inline(always)]
    fn set_user_addr(ctx: &SockAddrContext, addr_be: &u32, port_be: u16) {
        // SAFETY: as in `user_addr`; these hooks may rewrite the address.
        unsafe {
            (*ctx.sock_addr).user_ip4 = *addr_be;
            (*ctx.sock_addr).user_port = u32::from(port_be);
        }
    }

    /// The node is its own client by its address (`snat_addr_be`); a
    /// loopback destination is a NodePort where the agent says so.
    #[inline(always)]
    fn frontend_of(dst_be: &u32, dport_be: u16, proto: u8) -> Option<(Frontend, [u32; 4])> {
        let node = node_config();
        let localhost_nodeport =
            loopback(*dst_be) && node.flags & node_config_flags::LOCALHOST_NODEPORTS != 0;
        let frontend =
            frontend::lookup_frontend_of(dst_be, dport_be, proto, || true).or_else(|| {
                localhost_nodeport
                    .then(|| frontend::lookup_nodeport(dport_be, proto, || true))
                    .flatten()
            })?;
        Some((frontend, v4_mapped(node.snat_addr_be[3])))
    }

    #[inline(always)]
    fn backend_addr(_dst_be: &u32, backend: &Backend) -> Option<u32> {
        is_v4_mapped(&backend.addr_be).then_some(backend.addr_be[3])
    }

    #[inline(always)]
    fn note(
        ctx: &SockAddrContext,
        backend_be: &u32,
        backend_port_be: u16,
        frontend_be: &u32,
        frontend_port_be: u16,
        how: u32,
    ) {
        remember(
            ctx,
            &SOCK_NOTES,
            SockNoteOf {
                backend_be: *backend_be,
                frontend_be: *frontend_be,
                backend_port_be,
                frontend_port_be,
                how,
            },
        );
    }

    #[inline(always)]
    fn noted_frontend(ctx: &SockAddrContext, addr_be: &u32, port_be: u16) -> Option<(u32, u16)> {
        noted(ctx, &SOCK_NOTES, addr_be, port_be)
    }
}

/// An IPv4-mapped address goes the IPv4 way, its notes kept in
/// `SOCK_NOTES` by the IPv4 address (see the module's comment).
impl SockFamily for V6 {
    #[inline(always)]
    fn notes() -> &'static SkStorage<SockNotesOf<[u32; 4]>> {
        &SOCK_NOTES6
    }

    /// Read a word at a time: the verifier allows no other width on every
    /// kernel.
    #[inline(always)]
    fn user_addr(ctx: &SockAddrContext) -> ([u32; 4], u16) {
        // SAFETY: the kernel's context of this program, valid for its run;
        // the port sits in network order in the low 16 bits.
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

    /// A word at a time, as read.
    #[inline(always)]
    fn set_user_addr(ctx: &SockAddrContext, addr_be: &[u32; 4], port_be: u16) {
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

    #[inline(always)]
    fn frontend_of(dst_be: &[u32; 4], dport_be: u16, proto: u8) -> Option<(Frontend, [u32; 4])> {
        if is_v4_mapped(dst_be) {
            return V4::frontend_of(&dst_be[3], dport_be, proto);
        }
        let frontend = frontend::lookup_frontend_of(dst_be, dport_be, proto, || true)?;
        Some((frontend, node_addr6()))
    }

    /// IPv4-mapped to an IPv4-mapped destination, IPv6 to an IPv6 one.
    #[inline(always)]
    fn backend_addr(dst_be: &[u32; 4], backend: &Backend) -> Option<[u32; 4]> {
        (is_v4_mapped(&backend.addr_be) == is_v4_mapped(dst_be)).then_some(backend.addr_be)
    }

    #[inline(always)]
    fn note(
        ctx: &SockAddrContext,
        backend_be: &[u32; 4],
        backend_port_be: u16,
        frontend_be: &[u32; 4],
        frontend_port_be: u16,
        how: u32,
    ) {
        if is_v4_mapped(backend_be) {
            V4::note(
                ctx,
                &backend_be[3],
                backend_port_be,
                &frontend_be[3],
                frontend_port_be,
                how,
            );
        } else {
            remember(
                ctx,
                &SOCK_NOTES6,
                SockNoteOf {
                    backend_be: *backend_be,
                    frontend_be: *frontend_be,
                    backend_port_be,
                    frontend_port_be,
                    how,
                },
            );
        }
    }

    #[inline(always)]
    fn noted_frontend(
        ctx: &SockAddrContext,
        addr_be: &[u32; 4],
        port_be: u16,
    ) -> Option<([u32; 4], u16)> {
        if is_v4_mapped(addr_be) {
            return V4::noted_frontend(ctx, &addr_be[3], port_be)
                .map(|(frontend_be, frontend_port_be)| (v4_mapped(frontend_be), frontend_port_be));
        }
        noted(ctx, &SOCK_NOTES6, addr_be, port_be)
    }
}

/// A `connect()` of a TCP or UDP socket.
#[inline(always)]
pub fn connect<F: SockFamily>(ctx: &SockAddrContext) -> i32 {
    translate::<F>(ctx, sock_counter::TRANSLATED, sock_note::CONNECTED)
}

/// A datagram an unconnected UDP socket sends with an address: each one is
/// balanced anew, as each DNS query of a resolver that does not connect.
#[inline(always)]
pub fn sendmsg<F: SockFamily>(ctx: &SockAddrContext) -> i32 {
    translate::<F>(ctx, sock_counter::SENDMSG_TRANSLATED, sock_note::SENT)
}

/// A datagram a UDP socket of the node receives: from a backend it was
/// sent to in a frontend's place, it shows the frontend as its source, so
/// that a resolver that checks whom it asked takes the answer.
#[inline(always)]
pub fn recvmsg<F: SockFamily>(ctx: &SockAddrContext) -> i32 {
    show_frontend::<F>(ctx, false)
}

/// `getpeername()` of a socket of the node that `connect` sent to a
/// backend: the frontend, as a connection DNATed by kube-proxy shows.
#[inline(always)]
pub fn getpeername<F: SockFamily>(ctx: &SockAddrContext) -> i32 {
    show_frontend::<F>(ctx, true)
}

/// Replaces the address the kernel reports, a backend this socket was
/// sent to in a frontend's place, by that frontend. Pods' sockets only where
/// `pods` says (`getpeername`): the hooks never send a pod's datagrams, and
/// a look into every pod datagram's socket would cost each its storage read.
#[inline(always)]
fn show_frontend<F: SockFamily>(ctx: &SockAddrContext, pods: bool) -> i32 {
    match owner(ctx) {
        Owner::Node => {}
        Owner::Pod if pods => {}
        Owner::Pod | Owner::Other => return ALLOW,
    }
    let (addr_be, port_be) = F::user_addr(ctx);
    if let Some((frontend_be, frontend_port_be)) = F::noted_frontend(ctx, &addr_be, port_be) {
        F::set_user_addr(ctx, &frontend_be, frontend_port_be);
    }
    ALLOW
}

/// The frontend of the note for backend `addr_be:port_be` in the socket's
/// storage of `notes`, if it has one.
#[inline(always)]
fn noted<A: SockAddr>(
    ctx: &SockAddrContext,
    notes: &SkStorage<SockNotesOf<A>>,
    addr_be: &A,
    port_be: u16,
) -> Option<(A, u16)> {
    // SAFETY: the context's socket, valid for this run; without the create
    // flag the helper only looks (null: the socket has no notes).
    let notes = unsafe { notes.get_ptr_mut(ctx) };
    if notes.is_null() {
        return None;
    }
    // SAFETY: not null, so the socket's storage, valid for this run.
    unsafe { (*notes).find(addr_be, port_be) }.map(|note| (note.frontend_be, note.frontend_port_be))
}

/// Notes in the socket's own storage of `notes` (created on its first
/// note) that the hooks sent it to `note`'s backend in its frontend's
/// place. The kernel refuses storage only when the socket's option memory
/// is used up: the socket is still translated, and only its answers and
/// peer then show the backend, which is why a failure here is not worth a
/// refusal.
#[inline(always)]
fn remember<A: SockAddr>(
    ctx: &SockAddrContext,
    notes: &SkStorage<SockNotesOf<A>>,
    note: SockNoteOf<A>,
) {
    // SAFETY: the context's socket, valid for this run; the helper creates
    // zeroed storage when the socket has none.
    let notes = unsafe { notes.get_or_insert_ptr_mut(ctx, None) };
    if notes.is_null() {
        return;
    }
    // SAFETY: not null, so the socket's storage, valid for this run.
    keep(unsafe { &mut (*notes).notes }, note);
}

/// Keeps `note` in its slot of a socket's notes: the ways the hooks sent
/// the socket to the same backend add up, and a note of another backend
/// takes the slot over.
#[inline(always)]
fn keep<A: SockAddr>(notes: &mut [SockNoteOf<A>], note: SockNoteOf<A>) {
    let Some(kept) = notes.get_mut(note.backend_be.note_slot(note.backend_port_be)) else {
        return;
    };
    let same = kept.backend_be.same(&note.backend_be)
        && kept.backend_port_be == note.backend_port_be
        && kept.frontend_be.same(&note.frontend_be)
        && kept.frontend_port_be == note.frontend_port_be;
    let how = if same { kept.how | note.how } else { note.how };
    *kept = SockNoteOf { how, ..note };
}

/// Whose socket a hook sees, as far as the hooks go (see the module doc).
enum Owner {
    /// The node's network namespace.
    Node,
    /// Another namespace, a pod's, with `SOCKET_LB_PODS` set and not
    /// `MASQUERADE_ALL` (every flow masqueraded, which only tc can do).
    Pod,
    /// Any socket before the agent has said which namespace is the node's,
    /// and a pod's otherwise.
    Other,
}

#[inline(always)]
fn owner(ctx: &SockAddrContext) -> Owner {
    let host = HOST_NETNS.get(0).copied().unwrap_or(0);
    if host == 0 {
        return Owner::Other;
    }
    // SAFETY: a sock_addr context is a valid argument of this helper.
    if unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } == host {
        Owner::Node
    } else if node_flags() & (node_config_flags::SOCKET_LB_PODS | node_config_flags::MASQUERADE_ALL)
        == node_config_flags::SOCKET_LB_PODS
    {
        Owner::Pod
    } else {
        Owner::Other
    }
}

/// The ClusterIP a pod's TCP connection to `dst_be:dport_be` may be sent
/// to a backend of at `connect()`: one without session affinity (the hook
/// has no client address to keep it by). An ExternalIP, LoadBalancer IP or
/// NodePort stays tc's, as does everything else a pod sends.
#[inline(always)]
fn pod_frontend<A: FlowAddr>(dst_be: &A, dport_be: u16) -> Option<Frontend> {
    let frontend = frontend::lookup_frontend_of(dst_be, dport_be, PROTO_TCP, || true)?;
    let tc_only = service_flags::EXTERNAL | service_flags::AFFINITY;
    (frontend.svc.flags & tc_only == 0).then_some(frontend)
}

/// Whether `addr_be` is in `127.0.0.0/8`.
#[inline(always)]
fn loopback(addr_be: u32) -> bool {
    u32::from_be(addr_be) >> 24 == 127
}

/// Replaces a frontend destination of the node's own socket by a backend;
/// counts it at `counted` and notes it as `how` (`sock_note`).
#[inline(always)]
fn translate<F: SockFamily>(ctx: &SockAddrContext, counted: u32, how: u32) -> i32 {
    // SAFETY: the kernel's context of this program, valid for its run.
    let proto = unsafe { (*ctx.sock_addr).protocol };
    let proto = match proto {
        p if p == u32::from(PROTO_TCP) => PROTO_TCP,
        p if p == u32::from(PROTO_UDP) => PROTO_UDP,
        _ => return ALLOW,
    };
    let (dst_be, dport_be) = F::user_addr(ctx);
    let found = match owner(ctx) {
        // The node is its own client: in the cluster, as kube-proxy sends
        // locally started connections to every endpoint (`--src-type
        // LOCAL`), and one client to session affinity and source ranges, by
        // the node's address.
        Owner::Node => F::frontend_of(&dst_be, dport_be, proto),
        // A pod's frontend asks nothing of its client (`pod_frontend`).
        Owner::Pod if proto == PROTO_TCP && how == sock_note::CONNECTED => {
            pod_frontend(&dst_be, dport_be).map(|frontend| (frontend, [0; 4]))
        }
        Owner::Pod | Owner::Other => None,
    };
    let Some((frontend, client_be)) = found else {
        return ALLOW;
    };
    let backend = match pick(&frontend, client_be) {
        Ok(backend) => backend,
        Err(verdict) => return verdict,
    };
    let Some(backend_be) = F::backend_addr(&dst_be, &backend) else {
        return ALLOW;
    };
    // Answers come from the backend and the socket's peer is the backend;
    // `recvmsg` and `getpeername` show the frontend.
    F::note(ctx, &backend_be, backend.port_be, &dst_be, dport_be, how);
    F::set_user_addr(ctx, &backend_be, backend.port_be);
    count_sock(counted);
    if how == sock_note::CONNECTED {
        service_counters::connected(frontend.svc.service_id);
    }
    ALLOW
}

/// The backend a connection of the node (`client_be`, IPv4-mapped for
/// IPv4) to `frontend` goes to, or the hook's verdict without one: a
/// client outside the source ranges goes ahead untranslated, as does one
/// to a frontend without endpoints that drops; one that rejects is refused,
/// counted.
#[inline(always)]
fn pick(frontend: &Frontend, client_be: [u32; 4]) -> Result<Backend, i32> {
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0
        && !frontend::source_allowed(frontend, client_be)
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
        service_counters::rejected(svc.service_id);
        // SAFETY: a plain helper call; cgroup programs may set the error.
        unsafe { aya_ebpf::helpers::bpf_set_retval(-ECONNREFUSED) };
        return Err(REFUSE);
    }
    match frontend::select(svc, client_be, None, conntrack::now_ns()) {
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
/// when it holds notes of this family's backends.
#[inline(always)]
pub fn dump_notes<F: SockFamily>(ctx: *mut c_void) -> i32 {
    dump(ctx, F::notes(), |cookie, notes: SockNotesOf<F::Addr>| {
        SockNotesRecordOf { cookie, notes }
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
fn dump<V: Copy, R>(
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
