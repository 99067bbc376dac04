//! The property every output of the programs must have, checked on one
//! run: what the program did, or what was wrong with it.

use super::{
    Conntrack, DropReason, Hook, ICMP, Outcome, Tuple, Universe,
    frame::{ETH_HLEN, View, be16, ip_residual, l4_residual, view},
    verdict,
};
use crate::frames::{TCP, UDP, csum};

/// Checks one run of `hook` on `input`: what it did, or what was wrong.
pub fn check(
    u: &Universe,
    ct: &dyn Conntrack,
    hook: Hook,
    input: &[u8],
    verdict: u32,
    output: &[u8],
) -> Result<Outcome, String> {
    use verdict::{TC_ACT_REDIRECT, TC_ACT_SHOT, TCX_NEXT, XDP_DROP, XDP_PASS, XDP_REDIRECT};
    let (pass, drop, redirect) = match hook {
        Hook::Tc => (TCX_NEXT, TC_ACT_SHOT, TC_ACT_REDIRECT),
        Hook::Xdp => (XDP_PASS, XDP_DROP, XDP_REDIRECT),
    };
    if verdict == drop {
        let reason = explain_drop(u, ct, hook, input)?;
        return Ok(if view(input).is_some_and(|v| v.proto == ICMP) {
            Outcome::IcmpErrorDropped(reason)
        } else {
            Outcome::Dropped(reason)
        });
    }
    if verdict != pass && verdict != redirect {
        return Err(format!("verdict {verdict} is not one {hook:?} may give"));
    }
    if output == input {
        return if verdict == pass {
            Ok(Outcome::Untouched)
        } else {
            Err("redirected without a change (routing always takes one off the TTL)".into())
        };
    }
    if hook == Hook::Tc && verdict == redirect && is_reject(u, input, output)? {
        return Ok(if output.len() == input.len() {
            Outcome::Reset
        } else {
            Outcome::PortUnreachable
        });
    }
    if output.len() != input.len() {
        return Err(format!(
            "a {}-byte frame came out as {} bytes, and is no reject",
            input.len(),
            output.len()
        ));
    }
    if view(input).is_some_and(|v| v.proto == ICMP) {
        return icmp_error(ct, input, output, verdict == redirect);
    }
    translation(u, ct, input, output, verdict == redirect)
}

/// The TCP or UDP tuple an ICMP error frame quotes, and where the quote's
/// L4 header starts in the frame.
fn icmp_quote(f: &[u8]) -> Option<(Tuple, usize)> {
    let v = view(f)?;
    let end = ETH_HLEN + v.tot_len;
    let q = v.l4 + 8;
    if end > f.len() || q > end {
        return None;
    }
    let frame = [&f[..ETH_HLEN], &f[q..end]].concat();
    let qv = view(&frame)?;
    let t = qv
        .tuple(&frame)
        .filter(|t| t.proto == TCP || t.proto == UDP)?;
    Some((t, q + qv.ihl))
}

/// An ICMP error about a translated flow, translated: its quote reversed is
/// a tuple conntrack translates; the quote becomes that translation
/// reversed, the error goes to the translation's destination (from its
/// source when the quoted peer sent it, else from where it came), and only
/// those addresses, ports and checksums change, each checksum still right.
fn icmp_error(
    ct: &dyn Conntrack,
    input: &[u8],
    output: &[u8],
    routed: bool,
) -> Result<Outcome, String> {
    let vi = view(input).ok_or("no IPv4")?;
    let vo = view(output).ok_or("made an ICMP error unreadable")?;
    let end = ETH_HLEN + vi.tot_len;
    if vi.fragment() || end > input.len() || ![3, 11, 12].contains(&input[vi.l4]) {
        return Err(format!(
            "changed ICMP type {} (fragment: {}), which is no error it translates",
            input[vi.l4],
            vi.fragment()
        ));
    }
    let q = vi.l4 + 8;
    let (qt, ql4) =
        icmp_quote(input).ok_or("changed an error whose quote has no TCP or UDP ports")?;
    let quote_of = |f: &[u8]| [&f[..ETH_HLEN], &f[q..end]].concat();
    let qout = quote_of(output);
    let back = qt.reversed();
    let Some((want, want_routed)) = ct.translation(&back) else {
        return Err(format!(
            "changed an error quoting {qt}, a flow conntrack has not"
        ));
    };
    let from_peer = vi.src == qt.dst;
    let (want_src, want_dst) = (if from_peer { want.src } else { vi.src }, want.dst);
    let got = view(&qout)
        .and_then(|v| v.tuple(&qout))
        .ok_or("made the quote unreadable")?;
    let want_quote = want.reversed();
    if vi.dst != qt.src
        || (vo.src, vo.dst) != (want_src, want_dst)
        || got != want_quote
        || routed != (from_peer && want_routed)
    {
        return Err(format!(
            "an error {} -> {} quoting {qt} became {} -> {} quoting {got} (routed: {routed}); \
             its flow's translation {back} -> {want} (routed: {want_routed}) wants {want_src} -> \
             {want_dst} quoting {want_quote}",
            vi.src, vi.dst, vo.src, vo.dst
        ));
    }
    let l4_csum = ql4 + if qt.proto == TCP { 16 } else { 6 };
    let l4_csum = Some(l4_csum).filter(|o| o + 2 <= end);
    for i in (0..input.len()).filter(|&i| input[i] != output[i]) {
        let allowed = ((i < 12 || i == 22) && routed)
            || (24..34).contains(&i)
            || (vi.l4 + 2..vi.l4 + 4).contains(&i)
            || (q + 10..q + 20).contains(&i)
            || (ql4..ql4 + 4).contains(&i)
            || l4_csum.is_some_and(|o| (o..o + 2).contains(&i));
        if !allowed {
            return Err(format!(
                "byte {i} of an ICMP error changed ({:#04x} -> {:#04x}), outside the \
                 addresses, ports and checksums",
                input[i], output[i]
            ));
        }
    }
    // Each checksum balances its header's change: the residuals stay.
    let icmp = |f: &[u8]| csum(&f[vi.l4..end], 0);
    let quoted_ip = |f: &[u8]| csum(&f[q..ql4], 0);
    if ip_residual(output, &vo) != ip_residual(input, &vi)
        || icmp(output) != icmp(input)
        || quoted_ip(output) != quoted_ip(input)
    {
        return Err(format!(
            "ICMP error checksum residuals (IP, ICMP, quoted IP) {:?}, the input's {:?}",
            (ip_residual(output, &vo), icmp(output), quoted_ip(output)),
            (ip_residual(input, &vi), icmp(input), quoted_ip(input))
        ));
    }
    // The quoted L4 checksum covers the pseudo-header's addresses and the
    // ports: their sum with it stays (0 and 0xffff being one).
    if let Some(o) = l4_csum {
        let covered = |f: &[u8]| {
            let mut b = f[q + 12..q + 20].to_vec();
            b.extend_from_slice(&f[ql4..ql4 + 4]);
            b.extend_from_slice(&f[o..o + 2]);
            match csum(&b, 0) {
                0xffff => 0,
                c => c,
            }
        };
        let zero = |f: &[u8]| be16(f, o) == 0;
        if qt.proto == UDP && zero(input) != zero(output) {
            return Err("a quoted UDP checksum of 0 (none) must stay 0, and only 0".into());
        }
        if !(qt.proto == UDP && zero(input)) && covered(output) != covered(input) {
            return Err("the quoted L4 checksum does not follow its addresses and ports".into());
        }
    }
    Ok(Outcome::IcmpError)
}

/// The drop is one the datapath is meant to make.
fn explain_drop(
    u: &Universe,
    ct: &dyn Conntrack,
    hook: Hook,
    input: &[u8],
) -> Result<DropReason, String> {
    let v = view(input).ok_or("dropped a frame that is not IPv4")?;
    if v.proto == ICMP {
        // Only an error the datapath routes, from the quoted peer, is
        // dropped: for its TTL or for want of a route, as a flow's packet.
        return match icmp_quote(input).and_then(|(qt, _)| ct.translation(&qt.reversed())) {
            Some((to, true)) if !u.routable(to.dst) => Ok(DropReason::Unroutable),
            Some((_, true)) if v.ttl <= 1 => Ok(DropReason::TtlSpent),
            other => Err(format!("dropped an ICMP frame (its flow: {other:?})")),
        };
    }
    if v.frag_offset != 0 {
        // A later fragment, translated at its IP header as an entry between
        // its addresses says, then routed: the route is looked up first (at
        // tc; XDP leaves what it cannot route to tc), then the TTL taken.
        let to = ct.address_translations(v.proto, v.src, v.dst);
        if hook == Hook::Tc && to.iter().any(|(_, dst)| !u.routable(*dst)) {
            return Ok(DropReason::Unroutable);
        }
        if v.ttl <= 1 && !to.is_empty() {
            return Ok(DropReason::TtlSpent);
        }
        return Err(format!(
            "dropped a later fragment {} -> {} (TTL {}), translations {to:?}",
            v.src, v.dst, v.ttl
        ));
    }
    let t = v
        .tuple(input)
        .ok_or("dropped a frame whose ports cannot be read")?;
    if let Some((to, true)) = ct.translation(&t) {
        // The route is looked up before the TTL is taken down (XDP, which
        // cannot route it, leaves it to tc).
        if !u.routable(to.dst) {
            return Ok(DropReason::Unroutable);
        }
        if v.ttl <= 1 {
            return Ok(DropReason::TtlSpent);
        }
        return Err(format!(
            "dropped {t}, routed to {to}, which has a route (TTL {})",
            v.ttl
        ));
    }
    let Some(fe) = u.frontend(t.proto, t.dst, t.dport) else {
        return Err(format!("dropped {t}, which addresses no frontend"));
    };
    if let Some(allowed) = &fe.allowed
        && !allowed.contains(&t.src)
    {
        return Ok(DropReason::SourceRange);
    }
    if fe.backends.is_empty() {
        return Ok(if fe.drop_when_empty {
            DropReason::NoEndpoint
        } else if hook == Hook::Tc {
            DropReason::RejectImpossible
        } else {
            return Err(format!(
                "XDP dropped {t}, to a frontend without endpoints that rejects (XDP leaves rejects to tc)"
            ));
        });
    }
    if v.ttl <= 1 && fe.snat {
        return Ok(DropReason::TtlSpent);
    }
    Err(format!(
        "dropped {t}, a packet to a frontend with endpoints (TTL {})",
        v.ttl
    ))
}

/// Whether `output` is the reject of `input`; an error when it tries to
/// be one and is wrong.
fn is_reject(u: &Universe, input: &[u8], output: &[u8]) -> Result<bool, String> {
    let (Some(vi), Some(vo)) = (view(input), view(output)) else {
        return Ok(false);
    };
    let reversed = vo.src == vi.dst && vo.dst == vi.src;
    let rst = vo.proto == TCP
        && output.len() == input.len()
        && vo.l4 + 14 <= output.len()
        && output[vo.l4 + 13] & 0x04 != 0;
    let icmp = vo.proto == ICMP && vi.proto != ICMP;
    if !reversed || !(rst || icmp) {
        return Ok(false);
    }
    let t = vi.tuple(input).ok_or("a reject of a frame without ports")?;
    let fe = u
        .frontend(t.proto, t.dst, t.dport)
        .ok_or_else(|| format!("a reject of {t}, which addresses no frontend"))?;
    if !fe.backends.is_empty() || fe.drop_when_empty {
        return Err(format!(
            "a reject of {t}, whose frontend has endpoints or drops"
        ));
    }
    if output[0..6] != input[6..12] || output[6..12] != input[0..6] {
        return Err("the reject's Ethernet addresses are not the sender's swapped".into());
    }
    if rst {
        let l4 = vi.l4;
        if input[l4 + 13] & 0x16 != 0x02 {
            return Err(format!(
                "a RST answering flags {:#04x}, not a bare SYN",
                input[l4 + 13]
            ));
        }
        let seq = u32::from_be_bytes(input[l4 + 4..l4 + 8].try_into().unwrap());
        let ack = u32::from_be_bytes(output[l4 + 8..l4 + 12].try_into().unwrap());
        if output[l4 + 13] != 0x14 || ack != seq.wrapping_add(1) {
            return Err(format!(
                "RST flags {:#04x} ack {ack:#x}: want RST|ACK acknowledging {seq:#x} + 1",
                output[l4 + 13]
            ));
        }
        if be16(output, l4) != t.dport || be16(output, l4 + 2) != t.sport {
            return Err("the RST's ports are not the SYN's swapped".into());
        }
        if ip_residual(output, &vo) != ip_residual(input, &vi) {
            return Err("the RST's IP header checksum is wrong".into());
        }
        if l4_residual(output, &vo) != l4_residual(input, &vi) {
            return Err(format!(
                "the RST's TCP checksum is wrong (residual {:?}, the SYN's {:?})",
                l4_residual(output, &vo),
                l4_residual(input, &vi)
            ));
        }
    } else {
        if output.len() != ETH_HLEN + 20 + 8 + 28 || vo.tot_len != 56 || vo.ihl != 20 {
            return Err(format!(
                "an ICMP error of {} bytes (IP total length {}): want 70 and 56",
                output.len(),
                vo.tot_len
            ));
        }
        if output[34] != 3 || output[35] != 3 {
            return Err(format!(
                "ICMP type {} code {}: want 3/3 (port unreachable)",
                output[34], output[35]
            ));
        }
        if ip_residual(output, &vo) != 0 {
            return Err("the ICMP error's IP header checksum is wrong".into());
        }
        if csum(&output[34..70], 0) != 0 {
            return Err("the ICMP checksum is wrong".into());
        }
        if output[42..70] != input[14..42] {
            return Err("the ICMP error does not quote the IP header and 8 bytes".into());
        }
    }
    Ok(true)
}

/// A translation: the same frame with only addresses, ports, checksums and
/// (when routed) TTL and MACs changed, to where the maps say.
fn translation(
    u: &Universe,
    ct: &dyn Conntrack,
    input: &[u8],
    output: &[u8],
    routed: bool,
) -> Result<Outcome, String> {
    let vi = view(input).ok_or("changed a frame that is not IPv4")?;
    if vi.proto != TCP && vi.proto != UDP {
        return Err(format!("changed a packet of protocol {}", vi.proto));
    }
    let vo = view(output).ok_or("made an IPv4 frame unreadable")?;
    let ports_move = vi.frag_offset == 0;
    let csum_off = vi.l4_csum_off().filter(|_| ports_move);
    for i in (0..input.len()).filter(|&i| input[i] != output[i]) {
        let allowed = ((i < 12 || i == 22) && routed)
            || (24..34).contains(&i)
            || (ports_move && (vi.l4..vi.l4 + 4).contains(&i))
            || csum_off.is_some_and(|o| (o..o + 2).contains(&i));
        if !allowed {
            return Err(format!(
                "byte {i} changed ({:#04x} -> {:#04x}), outside addresses, ports, checksums{}",
                input[i],
                output[i],
                if routed { ", TTL and MACs" } else { "" }
            ));
        }
    }
    let want_ttl = if routed {
        vi.ttl.wrapping_sub(1)
    } else {
        vi.ttl
    };
    if vo.ttl != want_ttl || (routed && vi.ttl <= 1) {
        return Err(format!(
            "TTL {} -> {} ({})",
            vi.ttl,
            vo.ttl,
            if routed { "routed" } else { "not routed" }
        ));
    }
    if ip_residual(output, &vo) != ip_residual(input, &vi) {
        return Err(format!(
            "IP header checksum: residual {:#06x}, the input's {:#06x}",
            ip_residual(output, &vo),
            ip_residual(input, &vi)
        ));
    }
    if vi.fragment() {
        return fragment(u, ct, input, output, &vi, &vo);
    }
    let l4_in = l4_residual(input, &vi);
    let l4_out = l4_residual(output, &vo);
    if l4_in.is_none() {
        return Err("translated a segment that is not inside the frame".into());
    }
    let off = csum_off.ok_or("no L4 checksum")?;
    let (cin, cout) = (be16(input, off), be16(output, off));
    if vi.proto == UDP && (cin == 0) != (cout == 0) {
        return Err(format!(
            "UDP checksum {cin:#06x} -> {cout:#06x}: 0 (none) must stay 0, and only 0"
        ));
    }
    if !(vi.proto == UDP && cin == 0) && l4_out != l4_in {
        return Err(format!(
            "L4 checksum: residual {l4_out:?}, the input's {l4_in:?} (valid: Some(0))"
        ));
    }
    let ti = vi.tuple(input).ok_or("no ports")?;
    let to = vo.tuple(output).ok_or("no ports")?;
    match ct.translation(&ti) {
        Some((want, want_routed)) if want == to && want_routed == routed => {}
        other => {
            return Err(format!(
                "{ti} became {to} (routed: {routed}); its conntrack entry says {other:?}"
            ));
        }
    }
    consistent(u, &ti, &to)
}

/// Whether `port` is one a client's port `client_port` may be changed to when
/// its flow's tuple at the backend is another flow's.
fn remap_port(client_port: u16, port: u16) -> bool {
    let (min, max) = proxy_common::remap_ports(client_port);
    (min..=max).contains(&port)
}

/// The translation `ti` -> `to` follows the programmed frontends.
fn consistent(u: &Universe, ti: &Tuple, to: &Tuple) -> Result<Outcome, String> {
    if let Some(fe) = u.frontend(ti.proto, ti.dst, ti.dport) {
        let kept = to.sport == ti.sport;
        let port_remapped = !kept && remap_port(ti.sport, to.sport);
        let hairpin = to.src == u.hairpin_src && to.dst == ti.src && (kept || port_remapped);
        let snat = fe.snat && to.src == u.node_ip && u.snat_ports.contains(&to.sport);
        let plain = to.src == ti.src && kept;
        let remapped = (to.src == ti.src || hairpin) && port_remapped;
        if fe.backends.contains(&(to.dst, to.dport)) && (plain || hairpin || snat || remapped) {
            return Ok(Outcome::Forward {
                snat,
                hairpin,
                remapped,
            });
        }
    }
    for fe in u.served_by(ti.proto, ti.src, ti.sport) {
        if (to.src, to.sport) != (fe.addr, fe.port) {
            continue;
        }
        let kept = to.dport == ti.dport;
        let port_remapped = !kept && remap_port(to.dport, ti.dport);
        let hairpin = ti.dst == u.hairpin_src && to.dst == ti.src && (kept || port_remapped);
        let snat = fe.snat && ti.dst == u.node_ip && u.snat_ports.contains(&ti.dport);
        let plain = to.dst == ti.dst && kept;
        let remapped = (to.dst == ti.dst || hairpin) && port_remapped;
        if plain || hairpin || snat || remapped {
            return Ok(Outcome::Reply {
                snat,
                hairpin,
                remapped,
            });
        }
    }
    Err(format!(
        "{ti} became {to}: neither a frontend to one of its backends nor a backend's reply"
    ))
}

/// A fragment may be left alone or translated at the IP level, as a
/// conntrack entry between its addresses says; its L4 checksum covers the
/// whole datagram and cannot be checked from one piece.
fn fragment(
    u: &Universe,
    ct: &dyn Conntrack,
    input: &[u8],
    output: &[u8],
    vi: &View,
    vo: &View,
) -> Result<Outcome, String> {
    if let (Some(ti), Some(to)) = (vi.tuple(input), vo.tuple(output))
        && ti != to
    {
        consistent(u, &ti, &to)?;
    }
    let got = (vo.src, vo.dst);
    if got != (vi.src, vi.dst)
        && !ct
            .address_translations(vi.proto, vi.src, vi.dst)
            .contains(&got)
    {
        return Err(format!(
            "fragment {} -> {} became {} -> {}, which no conntrack entry between them says",
            vi.src, vi.dst, vo.src, vo.dst
        ));
    }
    Ok(Outcome::Fragment)
}
