//! Connections that start on the node itself: host-network pods, the
//! kubelet, node agents. Their packets leave through the stack's output path
//! and never cross tc ingress, so the frontend is replaced by a backend at
//! `connect()` instead, as kube-proxy's `OUTPUT` chain DNATs them. A
//! connected socket keeps its backend for its whole life, so no conntrack
//! entry is needed, and the packets carry the backend's address from the
//! first one.
//!
//! Only sockets of the node's own network namespace: pods' sockets sit in
//! cgroups below the same root, but their packets are translated at tc, with
//! the client address kept.

use aya_ebpf::{EbpfContext, helpers::bpf_get_netns_cookie, programs::SockAddrContext};
use proxy_common::{PROTO_TCP, PROTO_UDP, is_v4_mapped, service_flags, sock_counter};

use crate::{
    conntrack, lb,
    maps::{HOST_NETNS, count_sock, node_config},
};

/// `connect()` goes ahead (with its destination as this left it).
pub const ALLOW: i32 = 1;
/// `connect()` fails (EPERM unless the program set another error).
pub const REFUSE: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// An IPv4 `connect()` of a TCP or UDP socket.
#[inline(always)]
pub fn connect4(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: the kernel's context of this program, valid for its run.
    let (proto, dst_be, dport_be) = unsafe {
        (
            (*sa).protocol,
            (*sa).user_ip4,
            // The port in network order, in the low 16 bits.
            (*sa).user_port as u16,
        )
    };
    let proto = match proto {
        p if p == PROTO_TCP as u32 => PROTO_TCP,
        p if p == PROTO_UDP as u32 => PROTO_UDP,
        _ => return ALLOW,
    };
    let host = HOST_NETNS.get(0).copied().unwrap_or(0);
    // SAFETY: a sock_addr context is a valid argument of this helper.
    if host == 0 || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } != host {
        return ALLOW;
    }
    // The node is its own client: in the cluster, as kube-proxy sends locally
    // started connections to every endpoint (`--src-type LOCAL`), and one
    // client to session affinity and source ranges, by the node's address.
    let Some(frontend) = lb::lookup_frontend_of(dst_be, dport_be, proto, || true) else {
        return ALLOW;
    };
    let node_be = node_config().snat_addr_be[3];
    let svc = &frontend.svc;
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !lb::source_allowed_for(&frontend, node_be)
    {
        return ALLOW;
    }
    if svc.count == 0 {
        if svc.flags & service_flags::NO_EP_DROP != 0 {
            // Left as it is: nothing answers the frontend's address, as
            // nothing answers kube-proxy's dropped packets.
            return ALLOW;
        }
        count_sock(sock_counter::REFUSED);
        // SAFETY: a plain helper call; cgroup programs may set the error.
        unsafe { aya_ebpf::helpers::bpf_set_retval(-ECONNREFUSED) };
        return REFUSE;
    }
    let Some((_, backend)) = lb::select(svc, node_be, conntrack::now_ns()) else {
        return ALLOW;
    };
    if !is_v4_mapped(&backend.addr_be) {
        return ALLOW;
    }
    // SAFETY: as above; connect4 may rewrite the destination.
    unsafe {
        (*sa).user_ip4 = backend.addr_be[3];
        (*sa).user_port = backend.port_be as u32;
    }
    count_sock(sock_counter::TRANSLATED);
    ALLOW
}
