//! Frontend lookup and backend selection.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlotKey, ClusterCidrKey, FlowAddr, NodeAddrKey,
    ServiceKey, ServiceValue, SourceRangeKey, maglev, node_addr_flags, scope, service_flags,
    slot_for, v4_mapped,
};

use crate::maps::{
    AFFINITY, BACKEND_SLOTS, BACKENDS, CLUSTER_CIDRS, LOCAL_IFACES, NODE_ADDRS, SERVICES,
    SOURCE_RANGES,
};

/// A frontend a new flow matched.
pub struct Frontend {
    /// The entry that matched: its own address, or the unspecified address
    /// of NodePorts; scope `INTERNAL` for an in-cluster client's entry.
    pub key: ServiceKey,
    pub svc: ServiceValue,
    /// The flow's destination is an address of this node (a NodePort, or an
    /// external address the node holds): replies leave from it.
    pub on_node: bool,
    /// The frontend is external and its client in-cluster (as the caller's
    /// `in_cluster` said): never sent by direct server return.
    pub inside: bool,
}

/// The frontend of a packet to `dst_be`:`dport_be` of `proto`, of either
/// family: its own (address, port), else a NodePort when the address is
/// one of this node's that NodePorts are served on (programmed once per
/// family, on its unspecified address). An in-cluster client, as
/// `in_cluster` says (asked only where it matters), gets the frontend's
/// in-cluster entry where it has one.
#[inline(always)]
pub fn lookup_frontend_of<A: FlowAddr>(
    dst_be: &A,
    dport_be: u16,
    proto: u8,
    in_cluster: impl FnOnce() -> bool,
) -> Option<Frontend> {
    let own = ServiceKey {
        addr_be: dst_be.mapped(),
        port_be: dport_be,
        proto,
        scope: scope::ANY,
    };
    let node_flags = || {
        NODE_ADDRS
            .get_ptr(NodeAddrKey {
                addr_be: dst_be.mapped(),
            })
            // SAFETY: a pointer the map lookup returned, valid for this program's run.
            .map(|p| unsafe { (*p).flags })
    };
    let frontend = if let Some(svc) = lookup(own) {
        Frontend {
            key: own,
            on_node: svc.flags & service_flags::EXTERNAL != 0 && node_flags().is_some(),
            svc,
            inside: false,
        }
    } else {
        if node_flags()? & node_addr_flags::NODEPORT == 0 {
            return None;
        }
        // Through an opaque zero: an address the compiler knows is all
        // zeros is a memset, a call to a byte loop here (docs/architecture.md,
        // "No calls on a packet's path").
        let unspecified = A::default().mapped();
        let zero = core::hint::black_box(0u32);
        let key = ServiceKey {
            addr_be: unspecified.map(|word| word | zero),
            ..own
        };
        Frontend {
            key,
            svc: lookup(key)?,
            on_node: true,
            inside: false,
        }
    };
    Some(for_client(frontend, in_cluster))
}

/// The NodePort `dport_be` of `proto`, for a destination known to serve
/// NodePorts.
#[inline(always)]
pub fn lookup_nodeport(
    dport_be: u16,
    proto: u8,
    in_cluster: impl FnOnce() -> bool,
) -> Option<Frontend> {
    // NodePorts are programmed once, on the unspecified address.
    let key = service_key(0, dport_be, proto);
    let frontend = Frontend {
        key,
        svc: lookup(key)?,
        on_node: true,
        inside: false,
    };
    Some(for_client(frontend, in_cluster))
}

/// The frontend's in-cluster entry for an in-cluster client, where it has
/// one: it exists only where it differs (externalTrafficPolicy Local); in
/// either case marked `inside`.
#[inline(always)]
fn for_client(frontend: Frontend, in_cluster: impl FnOnce() -> bool) -> Frontend {
    if frontend.svc.flags & service_flags::EXTERNAL != 0 && in_cluster() {
        let internal = ServiceKey {
            scope: scope::INTERNAL,
            ..frontend.key
        };
        if let Some(svc) = lookup(internal) {
            return Frontend {
                key: internal,
                svc,
                inside: true,
                ..frontend
            };
        }
        return Frontend {
            inside: true,
            ..frontend
        };
    }
    frontend
}

/// Whether the client `client_be` (IPv4-mapped for IPv4) is inside one
/// of the loadBalancerSourceRanges of the frontend entry it matched.
#[inline(always)]
pub fn source_allowed(frontend: &Frontend, client_be: [u32; 4]) -> bool {
    let key = Key::new(
        proxy_common::source_range_prefix(128),
        SourceRangeKey {
            frontend: frontend.key,
            client_be,
        },
    );
    SOURCE_RANGES.get(&key).is_some()
}

/// Whether the client `src_be` (IPv4-mapped for IPv4) is in the cluster
/// (`CLUSTER_CIDRS`, where IPv6 pod CIDRs are kept as they are).
#[inline(always)]
pub fn in_cluster(src_be: [u32; 4]) -> bool {
    CLUSTER_CIDRS
        .get(&Key::new(128, ClusterCidrKey { addr_be: src_be }))
        .is_some()
}

/// Whether packets arriving on `ifindex` come from this node's pods
/// (`LOCAL_IFACES`).
#[inline(always)]
pub fn local_iface(ifindex: u32) -> bool {
    LOCAL_IFACES.get_ptr(ifindex).is_some()
}

#[inline(always)]
fn service_key(addr_be: u32, port_be: u16, proto: u8) -> ServiceKey {
    ServiceKey {
        addr_be: v4_mapped(addr_be),
        port_be,
        proto,
        scope: scope::ANY,
    }
}

#[inline(always)]
fn lookup(key: ServiceKey) -> Option<ServiceValue> {
    // Copied once: the rest of this packet's decisions use this snapshot
    // (see ServiceValue on how the agent keeps that consistent).
    // SAFETY: a pointer the map lookup returned, valid for this program's run.
    SERVICES.get_ptr(key).map(|p| unsafe { *p })
}

#[inline(always)]
fn backend(id: u32) -> Option<Backend> {
    // SAFETY: a pointer the map lookup returned, valid for this program's run.
    BACKENDS.get_ptr(id).map(|p| unsafe { *p })
}

/// A new flow's ports and protocol: with its client, what a Maglev
/// frontend hashes to pick the slot.
#[derive(Clone, Copy)]
pub struct FlowPorts {
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
}

/// The backend for a new flow of `client_be` (IPv4-mapped for IPv4) to
/// the service `svc` (which has `count > 0`): its affinity backend when
/// that is still fresh and still programmed, else, for a Maglev frontend
/// and a flow whose `ports` are known, the slot of its hash in the table
/// (the same on every node), else a uniformly random slot. A socket hook
/// knows no source port yet, and its connections are the node's own,
/// never moved to another node: it passes None and draws at random.
///
/// A stuck backend counts whatever its flags say. A backend id never changes
/// its flags (a ready endpoint that turns terminating gets a new id), so an
/// entry can only name a terminating backend that was picked from a set of
/// terminating ones: kube-proxy's fallback to serving-terminating endpoints,
/// or ready-and-terminating ones (publishNotReadyAddresses), where kube-proxy
/// keeps affinity too. A backend that leaves the set loses its affinity
/// entries when the agent purges departed backends, right after the sync.
#[inline(always)]
pub fn select(
    svc: &ServiceValue,
    client_be: [u32; 4],
    ports: Option<FlowPorts>,
    now: u64,
) -> Option<(u32, Backend)> {
    let affinity = svc.flags & service_flags::AFFINITY != 0;
    let akey = AffinityKey {
        client_be,
        service_id: svc.service_id,
    };
    // SAFETY: a pointer the map lookup returned, valid for this program's run.
    if affinity && let Some(stuck) = AFFINITY.get_ptr(akey).map(|p| unsafe { *p }) {
        let window = u64::from(svc.affinity_timeout_s) * 1_000_000_000;
        if now.saturating_sub(stuck.last_used_ns) <= window
            && let Some(b) = backend(stuck.backend_id)
        {
            remember(&akey, stuck.backend_id, now);
            return Some((stuck.backend_id, b));
        }
    }
    let slot = match ports {
        Some(p) if svc.flags & service_flags::MAGLEV != 0 => {
            let hash = maglev::flow_hash(client_be, p.sport_be, p.dport_be, p.proto, svc.hash_seed);
            hash % svc.count
        }
        // SAFETY: a helper that takes no pointers and has no preconditions.
        _ => slot_for(unsafe { bpf_get_prandom_u32() }, svc.count),
    };
    let slot_key = BackendSlotKey {
        slot_set: svc.slot_set,
        slot,
    };
    let id = BACKEND_SLOTS
        .get_ptr(slot_key)
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        .map(|p| unsafe { (*p).backend_id })?;
    let b = backend(id)?;
    if affinity {
        remember(&akey, id, now);
    }
    Some((id, b))
}

/// Stamps the affinity entry: like kube-proxy's `recent --set`, every new
/// connection refreshes it, later packets of a flow do not.
#[inline(always)]
fn remember(key: &AffinityKey, backend_id: u32, now: u64) {
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    let _ = AFFINITY.insert(key, value, 0);
}
