//! `ebpf-proxy cleanup --handoff`: the datapath's flows written into
//! netfilter's conntrack with their NAT, then the datapath removed, so that
//! kube-proxy started next keeps each flow on its backend (docs/operations.md,
//! "Handing back to kube-proxy").
//!
//! A flow becomes the entry netfilter would have made had it translated it:
//! original direction client to frontend, reply backend to the client (or
//! to the address it was SNATed to). Netfilter already tracks the
//! datapath's translated packets under other tuples (client to backend, for
//! a flow DNATed at tc before netfilter sees it), whose reply direction is
//! the same as the new entry's: those entries go first, or the new one
//! would clash with them. The flows are written twice, before the datapath
//! detaches and after, for those whose packets made netfilter a clashing
//! entry meanwhile.

use std::{collections::BTreeMap, net::SocketAddr};

use proxy_common::{PROTO_SCTP, PROTO_TCP, ct_flags};

use super::{
    conntrack::{
        self, ConntrackError, Entry, SCTP_CONNTRACK_CLOSED, SCTP_CONNTRACK_ESTABLISHED, SctpInfo,
        Tuple,
    },
    rules::{self, RulesError},
};
use crate::{
    datapath::{Maps, PinLayout, maps::MapsError},
    status::flows::{self, Flow},
};

/// Idle timeouts of the handed-back entries: netfilter's defaults for an
/// established TCP connection as kube-proxy sets it (`conntrack.
/// tcpEstablishedTimeout`, 24 h), for a half-closed one (its close-wait,
/// 1 h in kube-proxy), for one closed both ways (`TIME_WAIT`, 120 s) or
/// reset (`CLOSE`, 10 s), and for a UDP flow that saw replies
/// (`nf_conntrack_udp_timeout_stream`, 120 s).
const TCP_ESTABLISHED_S: u32 = 24 * 3600;
const TCP_CLOSE_WAIT_S: u32 = 3600;
const TCP_TIME_WAIT_S: u32 = 120;
const TCP_CLOSE_S: u32 = 10;
const UDP_S: u32 = 120;
/// An SCTP association's, established (`nf_conntrack_sctp_timeout_
/// established`, 210 s: its heartbeats come every 30 s) or ended.
const SCTP_ESTABLISHED_S: u32 = 210;
const SCTP_CLOSED_S: u32 = 10;
/// `TCP_CONNTRACK_ESTABLISHED`, `_CLOSE_WAIT`, `_TIME_WAIT`, `_CLOSE`
/// (`include/uapi/linux/netfilter/nf_conntrack_tcp.h`).
const TCP_STATE_ESTABLISHED: u8 = 3;
const TCP_STATE_CLOSE_WAIT: u8 = 5;
const TCP_STATE_TIME_WAIT: u8 = 7;
const TCP_STATE_CLOSE: u8 = 8;
/// `IPS_SEEN_REPLY | IPS_ASSURED`: netfilter's NAT bits follow from the
/// tuples.
const STATUS: u32 = (1 << 1) | (1 << 2);

#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("reading the datapath's flows: {0}")]
    Maps(#[from] MapsError),
    #[error("keeping netfilter's NAT running for the handed-back flows: {0}")]
    Nat(#[from] RulesError),
    #[error("removing the datapath: {0}")]
    Cleanup(#[from] std::io::Error),
}

/// What a hand-back did.
#[derive(Debug, Default)]
pub struct HandedBack {
    /// Flows written into netfilter's conntrack.
    pub flows: usize,
    /// TCP flows never answered (a handshake under way): left for the
    /// client's retransmitted SYN to start afresh.
    pub unanswered: usize,
    /// Flows netfilter refused, each with why.
    pub failed: Vec<(Flow, String)>,
    /// Pins removed.
    pub pins: usize,
}

/// Hands the flows of the datapath pinned at `pins` to netfilter and
/// removes the datapath. Nothing pinned: nothing to do.
pub fn hand_back(pins: &PinLayout) -> Result<HandedBack, HandoffError> {
    let mut done = HandedBack::default();
    if !pins.maps_dir().exists() {
        return Ok(done);
    }
    let maps = Maps::open_pinned(pins)?;
    let all = flows::read(&maps)?;
    drop(maps);
    let (entries, unanswered): (Vec<_>, Vec<_>) = all.iter().partition(|flow| handed(flow));
    done.unanswered = unanswered.len();
    // Before any entry is written: without a nat chain netfilter would not
    // translate them until kube-proxy's rules are back.
    rules::keep_nat_alive()?;
    let mut failed: BTreeMap<usize, ConntrackError> = (0..entries.len())
        .filter_map(|i| write(entries[i]).err().map(|e| (i, e)))
        .collect();
    done.pins = crate::datapath::cleanup(pins)?.len();
    // Packets translated until the detach may have given netfilter entries
    // the first pass removed: the flows that failed, written again.
    failed = failed
        .into_keys()
        .filter_map(|i| write(entries[i]).err().map(|e| (i, e)))
        .collect();
    done.flows = entries.len() - failed.len();
    done.failed = failed
        .into_iter()
        .map(|(i, e)| (*entries[i], e.to_string()))
        .collect();
    Ok(done)
}

/// Whether `flow` is handed to netfilter: not a TCP connection or SCTP
/// association its backend never answered, nor an association whose
/// verification tags are not both known (netfilter would call its packets
/// invalid, and kube-proxy drops those).
fn handed(flow: &Flow) -> bool {
    match flow.proto {
        PROTO_TCP => flow.flags & ct_flags::SEEN_REPLY != 0,
        PROTO_SCTP => flow.flags & ct_flags::SEEN_REPLY != 0 && !flow.vtags_be.contains(&0),
        _ => true,
    }
}

/// Writes the flow's entry, removing what would clash with it first.
fn write(flow: &Flow) -> Result<(), ConntrackError> {
    for orig in clashing(flow) {
        // Absent is the common case; a failure that matters shows in the
        // create.
        let _ = conntrack::delete(&orig);
    }
    conntrack::create(&entry_of(flow))
}

/// The netfilter state, and its timeout, of a TCP flow with `flags`
/// (`ct_flags`), as the datapath's own timeouts read them.
fn tcp_state_of(flags: u8) -> (u32, u8) {
    if flags & ct_flags::FIN_BOTH == ct_flags::FIN_BOTH {
        (TCP_TIME_WAIT_S, TCP_STATE_TIME_WAIT)
    } else if flags & ct_flags::CLOSING != 0 {
        (TCP_CLOSE_S, TCP_STATE_CLOSE)
    } else if flags & ct_flags::FIN_BOTH != 0 {
        (TCP_CLOSE_WAIT_S, TCP_STATE_CLOSE_WAIT)
    } else {
        (TCP_ESTABLISHED_S, TCP_STATE_ESTABLISHED)
    }
}

/// The entry netfilter would hold for `flow` had it translated it.
pub fn entry_of(flow: &Flow) -> Entry {
    let seen_by_backend = flow.source.unwrap_or(flow.client);
    let (timeout_s, tcp_state) = if flow.proto == PROTO_TCP {
        let (timeout_s, state) = tcp_state_of(flow.flags);
        (timeout_s, Some(state))
    } else {
        (UDP_S, None)
    };
    let closed = flow.flags & ct_flags::CLOSING != 0;
    let (timeout_s, sctp) = if flow.proto == PROTO_SCTP {
        let (timeout_s, state) = if closed {
            (SCTP_CLOSED_S, SCTP_CONNTRACK_CLOSED)
        } else {
            (SCTP_ESTABLISHED_S, SCTP_CONNTRACK_ESTABLISHED)
        };
        let info = SctpInfo {
            state,
            vtags_be: flow.vtags_be,
        };
        (timeout_s, Some(info))
    } else {
        (timeout_s, None)
    };
    Entry {
        orig: tuple(flow.proto, flow.client, flow.frontend),
        reply: tuple(flow.proto, flow.backend, seen_by_backend),
        status: STATUS,
        timeout_s,
        tcp_state,
        sctp,
        mark: 0,
    }
}

/// Original directions of entries netfilter may hold for the flow's
/// packets as the datapath sent them, and of an untranslated entry of its
/// own tuple: each would clash with the handed-back entry.
fn clashing(flow: &Flow) -> Vec<Tuple> {
    let seen_by_backend = flow.source.unwrap_or(flow.client);
    vec![
        tuple(flow.proto, seen_by_backend, flow.backend),
        tuple(flow.proto, flow.client, flow.backend),
        tuple(flow.proto, flow.client, flow.frontend),
    ]
}

fn tuple(proto: u8, src: SocketAddr, dst: SocketAddr) -> Tuple {
    Tuple {
        proto,
        src: src.ip(),
        dst: dst.ip(),
        sport: src.port(),
        dport: dst.port(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sctp_flow(flags: u8, vtags_be: [u32; 2]) -> Flow {
        Flow {
            proto: PROTO_SCTP,
            client: "10.0.0.2:40000".parse().unwrap(),
            frontend: "10.96.0.30:3868".parse().unwrap(),
            backend: "10.244.1.5:3869".parse().unwrap(),
            source: None,
            flags,
            vtags_be,
        }
    }

    /// An association is handed over with both its tags, as netfilter's
    /// established (or, ended, closed) state; one whose tags are not both
    /// known, or never answered, is not.
    #[test]
    fn sctp_associations_are_handed_over_with_their_tags() {
        let answered = ct_flags::SEEN_REPLY | ct_flags::ASSURED;
        let flow = sctp_flow(answered, [7, 9]);
        assert!(handed(&flow), "{flow}");
        let entry = entry_of(&flow);
        assert_eq!(
            entry.sctp,
            Some(SctpInfo {
                state: SCTP_CONNTRACK_ESTABLISHED,
                vtags_be: [7, 9]
            })
        );
        assert_eq!(entry.timeout_s, SCTP_ESTABLISHED_S);
        assert_eq!(entry.tcp_state, None);
        let ended = entry_of(&sctp_flow(answered | ct_flags::CLOSING, [7, 9]));
        assert_eq!(ended.sctp.map(|s| s.state), Some(SCTP_CONNTRACK_CLOSED));
        assert_eq!(ended.timeout_s, SCTP_CLOSED_S);
        assert!(!handed(&sctp_flow(answered, [7, 0])), "reply tag unknown");
        assert!(!handed(&sctp_flow(0, [0, 9])), "never answered");
    }
}
