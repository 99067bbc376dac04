//! What a hook costs a real packet, where `BPF_PROG_TEST_RUN` cannot tell: generic
//! XDP runs only on a socket buffer the stack built (test runs hand an XDP program a
//! bare buffer, as native XDP has), so its price is measured here on the wire.
//!
//! Veth pairs between two namespaces, one per case: frames sent into one end
//! (`s<i>`, an `AF_PACKET` socket, `sendmmsg` in batches, the sending thread on one
//! CPU) arrive at the other (`r<i>`), where the case's hook runs, and are then dropped
//! by the stack as not addressed to it (their destination MAC is another's), so that
//! what follows the hook is the same few steps in every case. All of it runs on the
//! sender's CPU: a veth hands its frames to the receiving side, whose softirq runs as
//! the send returns. The cost per packet is the wall time of a burst of sends over its
//! frames. Cases, each attached by a bpf link of its own for the whole run: nothing
//! (the wire itself), tc ingress, generic XDP and native XDP (veth's own, which takes
//! the frame out of its socket buffer), each with the empty program of the hook and
//! with the datapath's (`tc_ingress`, `xdp_ingress`), on one TCP segment that is not
//! for any Service (pod to pod: most of a node's packets). IPv6's cases send the same
//! segment over IPv6 through tc: nothing, the empty program, and the agent's
//! `tc_ingress`, which hands IPv6 to `tc_ingress6` by its tail call. Every program
//! at tc, the empty one too, passes with tcx's `TCX_NEXT`, as the agent's do, so that
//! the interface's legacy tc runs after it. Rounds send a burst through each pair in turn, so that every case sees the machine
//! as the others did; figures are medians over rounds, ratios medians of per-round
//! ratios.

use std::{
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    time::Instant,
};

use ebpf_proxy_tests::{
    netns::{NetNs, unique_stem},
    raw_bpf::{BPF_F_AFTER, BPF_TCX_INGRESS, link_create},
};
use proxy_userspace::datapath::Datapath;

/// The batch of one `sendmmsg`.
const BATCH: usize = 32;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Hook {
    None,
    Tc,
    Generic,
    Native,
}

impl Hook {
    fn name(self) -> &'static str {
        match self {
            Hook::None => "no program",
            Hook::Tc => "tc",
            Hook::Generic => "generic XDP",
            Hook::Native => "native XDP (veth)",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// What runs at the hook.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    /// The hook's empty program.
    Empty,
    /// The datapath's program; over IPv6 at tc, `tc_ingress` and its tail
    /// call to `tc_ingress6`.
    Datapath,
}

struct Case {
    family: Family,
    hook: Hook,
    run: Run,
}

impl Case {
    const fn v4(hook: Hook, run: Run) -> Case {
        Case {
            family: Family::V4,
            hook,
            run,
        }
    }

    const fn v6(hook: Hook, run: Run) -> Case {
        Case {
            family: Family::V6,
            hook,
            run,
        }
    }

    fn name(&self) -> String {
        if self.family == Family::V6 {
            return match (self.hook, self.run) {
                (Hook::None, _) => "IPv6: no program".into(),
                (_, Run::Empty) => "IPv6: tc: empty program".into(),
                (_, Run::Datapath) => "IPv6: tc: tc_ingress, tail call to tc_ingress6".into(),
            };
        }
        match (self.hook, self.run != Run::Empty) {
            (Hook::None, _) => "no program".into(),
            (hook, true) => format!(
                "{}: {}",
                hook.name(),
                if hook == Hook::Tc {
                    "tc_ingress"
                } else {
                    "xdp_ingress"
                }
            ),
            (hook, false) => format!("{}: empty program", hook.name()),
        }
    }
}

const CASES: [Case; 10] = [
    Case::v4(Hook::None, Run::Empty),
    Case::v4(Hook::Tc, Run::Empty),
    Case::v4(Hook::Tc, Run::Datapath),
    Case::v4(Hook::Generic, Run::Empty),
    Case::v4(Hook::Generic, Run::Datapath),
    Case::v4(Hook::Native, Run::Empty),
    Case::v4(Hook::Native, Run::Datapath),
    Case::v6(Hook::None, Run::Empty),
    Case::v6(Hook::Tc, Run::Empty),
    Case::v6(Hook::Tc, Run::Datapath),
];

/// The result: per case, its median ns per packet, its median added to no
/// program, and its median ratio to `tc_ingress`.
pub struct Wire {
    rows: Vec<(String, f64, f64, f64)>,
    rounds: usize,
    frames: usize,
    services: u32,
    delivered: f64,
}

/// `ifname`'s received packets, as `ip -s link` counts them.
fn rx_packets(ns: &NetNs, ifname: &str) -> u64 {
    let out = ns
        .ip(&["-s", "link", "show", "dev", ifname])
        .expect("ip -s link");
    let mut lines = out.lines();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("RX:") {
            let values = lines.next().unwrap_or_default();
            return values
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .expect("RX packets");
        }
    }
    panic!("no RX line in {out}");
}

/// `ifname`'s ifindex in `ns`.
fn ifindex(ns: &NetNs, ifname: &str) -> u32 {
    let name = std::ffi::CString::new(ifname).expect("name");
    let index = ns
        .run(|| {
            // SAFETY: a NUL-terminated name.
            unsafe { libc::if_nametoindex(name.as_ptr()) }
        })
        .expect("entering the namespace");
    assert!(index > 0, "no {ifname} in {}", ns.name());
    index
}

/// A raw socket on `ifname` of `ns`.
fn sender(ns: &NetNs, ifname: &str) -> OwnedFd {
    let ifindex = ifindex(ns, ifname);
    ns.run(|| {
        // SAFETY: plain socket(2); the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        assert!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a descriptor just made.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: zeroed sockaddr_ll is valid; the fields set are its own.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: `addr` is a sockaddr_ll of the length given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(addr).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        fd
    })
    .expect("entering the sender's namespace")
}

/// Sends `frame` `count` times (a multiple of [`BATCH`]) through `fd`.
fn send(fd: BorrowedFd<'_>, frame: &[u8], count: usize) {
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: frame.len(),
    };
    let mut msgs: Vec<libc::mmsghdr> = (0..BATCH)
        .map(|_| {
            // SAFETY: a zeroed mmsghdr is valid (no name, no control).
            let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
            m.msg_hdr.msg_iov = std::ptr::addr_of_mut!(iov);
            m.msg_hdr.msg_iovlen = 1;
            m
        })
        .collect();
    let mut left = count;
    while left > 0 {
        let n = left.min(BATCH);
        // SAFETY: `msgs` holds `n` valid headers pointing at `frame`, which the
        // kernel only reads.
        let sent = unsafe { libc::sendmmsg(fd.as_raw_fd(), msgs.as_mut_ptr(), n as u32, 0) };
        if sent <= 0 {
            let error = std::io::Error::last_os_error();
            // The device queue is full (another program on this CPU held
            // the softirq back): the frames wait, as a sender would, and the
            // wait counts in the case's time.
            assert_eq!(
                error.raw_os_error(),
                Some(libc::ENOBUFS),
                "sendmmsg: {error}"
            );
            std::thread::yield_now();
            continue;
        }
        left -= sent as usize;
    }
}

/// Pins the calling thread to its current CPU, so that the send and the receive it
/// runs stay on one.
fn pin_to_this_cpu() {
    // SAFETY: sched_getcpu has no arguments; sched_setaffinity gets a valid set.
    unsafe {
        let cpu = libc::sched_getcpu();
        if cpu < 0 {
            return;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set);
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One veth pair per case from `tx` to `rx`, the case attached to its end in
/// `rx` (by links that last as long as the descriptors returned), and a socket
/// sending into each pair.
fn pairs(datapath: &Datapath, tx: &NetNs, rx: &NetNs) -> (Vec<OwnedFd>, Vec<OwnedFd>) {
    const BPF_XDP: u32 = 37;
    const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
    const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
    let (tc_floor, xdp_floor) = datapath.floors().expect("floor programs loaded");
    let tc = |run: Run| {
        if run == Run::Empty {
            tc_floor.fd().expect("tc floor fd").as_fd()
        } else {
            datapath.tc_program().fd().expect("tc fd").as_fd()
        }
    };
    let xdp = |run: Run| {
        if run == Run::Empty {
            xdp_floor.fd().expect("xdp floor fd").as_fd()
        } else {
            datapath.xdp_program().fd().expect("xdp fd").as_fd()
        }
    };
    let mut sockets = Vec::new();
    let mut links = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let (s, r) = (format!("s{i}"), format!("r{i}"));
        tx.ip(&[
            "link",
            "add",
            &s,
            "type",
            "veth",
            "peer",
            "name",
            &r,
            "netns",
            rx.name(),
        ])
        .expect("veth pair");
        tx.ip(&["link", "set", &s, "up"]).expect("up");
        rx.ip(&["link", "set", &r, "up"]).expect("up");
        let index = ifindex(rx, &r);
        let how = match case.hook {
            Hook::None => vec![],
            Hook::Tc => vec![(tc(case.run), BPF_TCX_INGRESS, BPF_F_AFTER)],
            Hook::Generic => vec![(xdp(case.run), BPF_XDP, XDP_FLAGS_SKB_MODE)],
            Hook::Native => vec![(xdp(case.run), BPF_XDP, XDP_FLAGS_DRV_MODE)],
        };
        for (prog, kind, flags) in how {
            links.push(
                rx.run(|| link_create(prog, index, kind, flags))
                    .expect("entering the receiver's namespace")
                    .unwrap_or_else(|e| {
                        panic!("BPF_LINK_CREATE (type {kind}, flags {flags}): {e}")
                    }),
            );
        }
        sockets.push(sender(tx, &s));
    }
    (sockets, links)
}

/// Measures every case over `rounds` rounds of a burst of `frames` frames each
/// (`frame` over IPv4, `frame6` over IPv6), `datapath` holding `services`
/// Services.
pub fn measure(
    datapath: &mut Datapath,
    services: u32,
    (frame, frame6): (&[u8], &[u8]),
    rounds: usize,
    frames: usize,
) -> Wire {
    datapath.load_floors().expect("loading the floor programs");
    let stem = unique_stem();
    let tx = NetNs::create(&format!("{stem}-wtx")).expect("sender namespace");
    let rx = NetNs::create(&format!("{stem}-wrx")).expect("receiver namespace");
    let (sockets, links) = pairs(datapath, &tx, &rx);
    let before: Vec<u64> = (0..CASES.len())
        .map(|i| rx_packets(&rx, &format!("r{i}")))
        .collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                pin_to_this_cpu();
                // Round 0 warms up (caches, the veths' queues, the flow cache) and
                // is left out.
                for round in 0..=rounds {
                    for (i, (socket, case)) in sockets.iter().zip(&CASES).enumerate() {
                        let frame = match case.family {
                            Family::V4 => frame,
                            Family::V6 => frame6,
                        };
                        let started = Instant::now();
                        send(socket.as_fd(), frame, frames);
                        let ns = started.elapsed().as_nanos() as f64 / frames as f64;
                        if round > 0 {
                            samples[i].push(ns);
                        }
                    }
                }
            })
            .join()
            .expect("the sending thread");
    });
    let seen: u64 = (0..CASES.len())
        .map(|i| rx_packets(&rx, &format!("r{i}")) - before[i])
        .sum();
    drop(links);
    let sent = (CASES.len() * (rounds + 1) * frames) as u64;
    // Each family's rows against its own: no program, and the datapath at tc.
    let of_family = |family: Family, hook: Hook, run: Run| {
        CASES
            .iter()
            .position(|c| c.family == family && c.hook == hook && c.run == run)
            .expect("a case of each family")
    };
    let per_round = |i: usize, f: &dyn Fn(f64, f64, f64) -> f64| -> f64 {
        let family = CASES[i].family;
        let none = of_family(family, Hook::None, Run::Empty);
        let reference = of_family(family, Hook::Tc, Run::Datapath);
        let mut v: Vec<f64> = (0..rounds)
            .map(|r| f(samples[i][r], samples[none][r], samples[reference][r]))
            .collect();
        median(&mut v)
    };
    let rows = CASES
        .iter()
        .enumerate()
        .map(|(i, case)| {
            (
                case.name(),
                per_round(i, &|x, _, _| x),
                per_round(i, &|x, none, _| x - none),
                per_round(i, &|x, _, tc| x / tc),
            )
        })
        .collect();
    Wire {
        rows,
        rounds,
        frames,
        services,
        delivered: seen as f64 / sent as f64,
    }
}

impl Wire {
    fn find(&self, name: &str) -> &(String, f64, f64, f64) {
        self.rows
            .iter()
            .find(|r| r.0 == name)
            .expect("a measured case")
    }

    /// The table and its summary, in markdown.
    pub fn render(&self) -> String {
        let mut s = format!(
            "\nHooks on the wire: one TCP segment that is not for any Service ({} Services \
             installed), sent through a veth pair (one per case) into the end with the hook \
             on it, and dropped after it by the stack (not addressed to it); ns per packet \
             of the sender's wall time, all on its CPU (the veth's softirq runs as each \
             send returns), {} rounds of a burst of {} frames through each pair in turn, \
             medians over rounds; `added` = over no program of the same family in the same \
             round; `vs tc` = per-round ratio to `tc_ingress` on the same family (IPv6: by \
             its tail call). {:.1}% of the frames sent were counted by the receiving \
             ends.\n\n",
            self.services,
            self.rounds,
            self.frames,
            self.delivered * 100.0
        );
        s.push_str("| hook | ns per packet | added ns | vs tc |\n|---|---:|---:|---:|\n");
        for (name, ns, added, ratio) in &self.rows {
            s.push_str(&format!(
                "| {name} | {ns:.0} | {added:.0} | {ratio:.2}x |\n"
            ));
        }
        let tc = self.find("tc: tc_ingress");
        let generic = self.find("generic XDP: xdp_ingress");
        let native = self.find("native XDP (veth): xdp_ingress");
        let tc_empty = self.find("tc: empty program");
        let generic_empty = self.find("generic XDP: empty program");
        s.push_str(&format!(
            "\nGeneric XDP against tc, same packet: xdp_ingress in generic mode {:.2}x \
             tc_ingress per packet ({:.0} ns added over no program against {:.0} ns); the \
             empty programs {:.0} ns (generic XDP) and {:.0} ns (tc) added; native XDP on the \
             veth {:.2}x tc_ingress ({:.0} ns added).\n",
            generic.3, generic.2, tc.2, generic_empty.2, tc_empty.2, native.3, native.2
        ));
        let tail = self.find("IPv6: tc: tc_ingress, tail call to tc_ingress6");
        let empty6 = self.find("IPv6: tc: empty program");
        s.push_str(&format!(
            "\nIPv6 at tc, same segment: the agent's programs added {:.0} ns over no program \
             (tc_ingress's tail call to tc_ingress6), the empty program {:.0} ns.\n",
            tail.2, empty6.2
        ));
        s
    }

    /// The rows as JSON.
    pub fn json(&self) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|(name, ns, added, ratio)| {
                format!(
                    "{{\"case\":\"{name}\",\"ns\":{ns:.1},\"added_ns\":{added:.1},\
                     \"vs_tc\":{ratio:.3}}}"
                )
            })
            .collect();
        format!(
            "{{\"services\":{},\"rounds\":{},\"frames\":{},\"delivered\":{:.4},\"rows\":[{}]}}",
            self.services,
            self.rounds,
            self.frames,
            self.delivered,
            rows.join(",")
        )
    }
}
