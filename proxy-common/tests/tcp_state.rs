//! TCP state per direction, as the datapath and the reaper share it: what a
//! FIN or RST does to a flow's flags, which ones fall outside the window,
//! and how long each state lives.

use proptest::prelude::*;
use proxy_common::{
    CtTimeouts, PROTO_TCP, PROTO_UDP, TCP_MAX_WINDOW, ct_dir, ct_flags, idle_timeout_ns,
    tcp_ack_after, tcp_close_step, tcp_in_window,
};

const ESTABLISHED: u8 = ct_flags::SEEN_REPLY | ct_flags::ASSURED;

fn timeout(flags: u8) -> u64 {
    idle_timeout_ns(flags, PROTO_TCP, &CtTimeouts::DEFAULT)
}

#[test]
fn a_fin_closes_its_own_direction_only() {
    let after = tcp_close_step(ESTABLISHED, ct_dir::FORWARD, true, false, 1000, 1000)
        .expect("a FIN at the acknowledged point is inside the window");
    assert_eq!(
        after,
        ESTABLISHED | ct_flags::FIN_FORWARD,
        "the client's FIN half-closes the flow"
    );
    assert_eq!(
        timeout(after),
        CtTimeouts::DEFAULT.tcp_close_wait_ns,
        "a half-closed flow lives for close-wait (kube-proxy's 1 h), not a closing grace"
    );
    let both = tcp_close_step(after, ct_dir::REPLY, true, false, 7000, 7000).expect("in window");
    assert_eq!(
        both,
        ESTABLISHED | ct_flags::FIN_BOTH | ct_flags::CLOSING,
        "the second FIN closes the flow"
    );
    assert_eq!(timeout(both), CtTimeouts::DEFAULT.tcp_time_wait_ns);
}

#[test]
fn a_fin_repeated_from_the_same_side_does_not_close_the_flow() {
    let once = tcp_close_step(ESTABLISHED, ct_dir::REPLY, true, false, 10, 10).unwrap();
    let twice = tcp_close_step(once, ct_dir::REPLY, true, false, 10, 10).unwrap();
    assert_eq!(twice, ESTABLISHED | ct_flags::FIN_REPLY);
    assert_eq!(twice & ct_flags::CLOSING, 0);
}

#[test]
fn an_rst_inside_the_window_closes_the_flow_for_netfilters_close_timeout() {
    let after = tcp_close_step(ESTABLISHED, ct_dir::FORWARD, false, true, 5000, 4000).unwrap();
    assert_eq!(after, ESTABLISHED | ct_flags::CLOSING);
    assert_eq!(timeout(after), CtTimeouts::DEFAULT.tcp_close_ns);
}

#[test]
fn out_of_window_fins_and_rsts_change_nothing() {
    for (seq, max_ack, what) in [
        (999, 1000, "one byte before what the receiver acknowledged"),
        (1000u32.wrapping_sub(1 << 20), 1000, "a megabyte before it"),
        (1000 + TCP_MAX_WINDOW + 1, 1000, "past any window"),
        (0x8000_0000, 1, "half the sequence space away"),
    ] {
        for (fin, rst) in [(true, false), (false, true), (true, true)] {
            assert_eq!(
                tcp_close_step(ESTABLISHED, ct_dir::FORWARD, fin, rst, seq, max_ack),
                None,
                "fin {fin} rst {rst}, {what}: taken as inside the window"
            );
        }
    }
}

#[test]
fn an_unknown_acknowledgment_takes_any_segment_as_inside() {
    // A backend's RST to the client's SYN: the client never acknowledged
    // anything yet.
    assert!(tcp_in_window(0, 0));
    assert!(tcp_in_window(0xdead_beef, 0));
}

#[test]
fn the_highest_acknowledgment_wraps_with_the_sequence_space() {
    assert_eq!(tcp_ack_after(0, 5), 5, "the first one");
    assert_eq!(tcp_ack_after(5, 9), 9);
    assert_eq!(
        tcp_ack_after(9, 5),
        9,
        "an older ACK (reordered) does not lower it"
    );
    assert_eq!(tcp_ack_after(u32::MAX - 2, 3), 3, "past the wrap");
    assert_eq!(tcp_ack_after(3, u32::MAX - 2), 3, "before the wrap");
}

#[test]
fn timeouts_follow_netfilters_states() {
    let t = CtTimeouts::DEFAULT;
    for (flags, want, state) in [
        (0, t.tcp_syn_ns, "SYN_SENT"),
        (ct_flags::SEEN_REPLY, t.tcp_syn_ns, "SYN_RECV"),
        (ESTABLISHED, t.tcp_established_ns, "ESTABLISHED"),
        (
            ESTABLISHED | ct_flags::FIN_FORWARD,
            t.tcp_close_wait_ns,
            "CLOSE_WAIT",
        ),
        (
            ESTABLISHED | ct_flags::FIN_REPLY,
            t.tcp_close_wait_ns,
            "CLOSE_WAIT",
        ),
        (
            ESTABLISHED | ct_flags::FIN_BOTH,
            t.tcp_time_wait_ns,
            "TIME_WAIT",
        ),
        (
            ESTABLISHED | ct_flags::FIN_BOTH | ct_flags::CLOSING,
            t.tcp_time_wait_ns,
            "TIME_WAIT",
        ),
        (ESTABLISHED | ct_flags::CLOSING, t.tcp_close_ns, "CLOSE"),
        (
            ESTABLISHED | ct_flags::FIN_FORWARD | ct_flags::CLOSING,
            t.tcp_close_ns,
            "CLOSE",
        ),
    ] {
        assert_eq!(timeout(flags), want, "flags {flags:#04x} ({state})");
    }
    assert_eq!(
        idle_timeout_ns(ct_flags::FIN_BOTH, PROTO_UDP, &t),
        t.udp_ns,
        "UDP has no TCP states"
    );
}

proptest! {
    /// Whatever arrives, a FIN or RST never clears a flag: the flow only
    /// ever moves towards closed.
    #[test]
    fn flags_only_grow(flags: u8, fwd: bool, fin: bool, rst: bool, seq: u32, ack: u32) {
        let dir = if fwd { ct_dir::FORWARD } else { ct_dir::REPLY };
        if let Some(after) = tcp_close_step(flags, dir, fin, rst, seq, ack) {
            prop_assert_eq!(after & flags, flags);
        }
    }

    /// A segment at or just past what its receiver acknowledged (any real
    /// FIN or RST: its sender's next sequence number) is inside the window.
    #[test]
    fn real_closes_are_inside(ack in 1u32.., ahead in 0u32..=TCP_MAX_WINDOW) {
        prop_assert!(tcp_in_window(ack.wrapping_add(ahead), ack));
    }

    /// Anything before what the receiver acknowledged is outside.
    #[test]
    fn stale_segments_are_outside(ack in 1u32.., behind in 1u32..(1 << 31)) {
        prop_assert!(!tcp_in_window(ack.wrapping_sub(behind), ack));
    }
}
