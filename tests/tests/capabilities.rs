//! Least privilege, proven on the agent binary: started under `setpriv` with
//! exactly the capabilities deploy/daemonset.yaml adds (root's uid, every other
//! capability gone, as in a container that drops ALL) it serves a ClusterIP;
//! without any one of them it stops at start with an error naming it; and
//! once serving it keeps only the steady-state set, on every thread, and
//! still serves.
//!
//! Needs root and the release binary (`cargo xtask build`).

mod daemonset;

use std::net::Ipv4Addr;

use caps::{CapSet, Capability};

use ebpf_proxy_tests::{
    Protocol,
    agent::Agent,
    client::tcp_tally,
    manifest::{ManifestDir, Service},
    require_root,
    servers::TcpServer,
    topology::{
        Topology,
        one_node::{BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, VIP},
    },
    wait_for, wait_until,
};
use proxy_userspace::{
    datapath::{EBPF_OBJECT, PinLayout},
    privileges::{REQUIRED, effective, explain, missing_from, shed::Sets},
};

const BACKEND: (&str, Ipv4Addr) = BACKENDS[0];
use ebpf_proxy_tests::client::TIMEOUT;

/// setpriv's spelling of a manifest's capability (`NET_ADMIN` -> `net_admin`).
fn setpriv_name(cap: &str) -> String {
    cap.trim_start_matches("CAP_").to_ascii_lowercase()
}

/// `setpriv` that leaves exactly `caps` (manifest spelling) effective: the
/// bounding set limits what root's exec gains, inheritable and ambient carry
/// them across the exec, as a container runtime sets them up.
fn setpriv(caps: &[String]) -> Vec<String> {
    let list: String = caps
        .iter()
        .map(|c| format!(",+{}", setpriv_name(c)))
        .collect();
    vec![
        "setpriv".to_owned(),
        format!("--inh-caps=-all{list}"),
        format!("--ambient-caps=-all{list}"),
        format!("--bounding-set=-all{list}"),
        "--".to_owned(),
    ]
}

struct Fixture {
    // Declared in drop order: servers and manifests before the namespaces.
    _server: TcpServer,
    manifests: ManifestDir,
    topology: Topology,
}

fn fixture() -> Fixture {
    require_root().expect("privileged test");
    let topology = Topology::routed(&[CLIENT, BACKEND]).expect("topology");
    let server =
        TcpServer::start(&topology.pod(BACKEND.0).ns, BACKEND.0, TCP_PORT).expect("backend");
    let manifests = ManifestDir::create(topology.stem()).expect("manifest directory");
    manifests
        .write(
            "web.yaml",
            &Service::new("test", "web", CLUSTER_IP)
                .port("http", VIP.port(), Protocol::Tcp, TCP_PORT)
                .yaml(Some(&[BACKEND.1])),
        )
        .expect("write manifest");
    Fixture {
        _server: server,
        manifests,
        topology,
    }
}

fn start_with_caps(fx: &Fixture, caps: &[String]) -> anyhow::Result<Agent> {
    let launcher = setpriv(caps);
    let launcher: Vec<&str> = launcher.iter().map(String::as_str).collect();
    Agent::start_under(&fx.topology.node, fx.manifests.path(), &launcher, &[])
}

/// A capability's bit in `/proc/…/status` (manifest spelling).
fn bit(cap: &str) -> u64 {
    1u64 << match cap {
        "BPF" => 39,
        "PERFMON" => 38,
        "NET_ADMIN" => 12,
        "NET_RAW" => 13,
        "SYS_RESOURCE" => 24,
        "SYS_ADMIN" => 21,
        other => panic!("no bit known for capability {other}"),
    }
}

/// Each thread of `pid`: its id, and its effective, permitted and
/// inheritable sets and `no_new_privs` as `/proc` shows them.
fn thread_sets(pid: u32) -> Vec<(String, Option<Sets>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the agent's threads")
        .flatten()
    {
        let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
        out.push((
            entry.file_name().to_string_lossy().into_owned(),
            Sets::parse(&status),
        ));
    }
    out
}

/// An interface that appears after the drop gets the datapath.
fn an_interface_added_later_is_attached(fx: &Fixture, agent: &Agent) {
    let name = "capslater0";
    for args in [
        vec![
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            "capslater1",
        ],
        vec!["link", "set", name, "up"],
        vec!["link", "set", "capslater1", "up"],
    ] {
        let status = fx
            .topology
            .node
            .command("ip")
            .args(&args)
            .status()
            .expect("ip");
        assert!(status.success(), "ip {args:?}");
    }
    let attached = wait_until(
        std::time::Duration::from_secs(20),
        std::time::Duration::from_millis(200),
        || {
            let pins = agent.pins();
            if pins.iter().any(|p| p.to_string_lossy().contains(name)) {
                Ok(())
            } else {
                Err(format!("pins {pins:?}"))
            }
        },
    );
    if let Err(last) = attached {
        panic!(
            "interface {name}, added after the capabilities were dropped, was not attached: {last}\n{}",
            agent.log()
        );
    }
}

/// Once the agent has loaded, attached and taken the node over it keeps, on
/// every thread, exactly the steady-state set (docs/security.md,
/// "Privileges and pins"), with `no_new_privs`; and it still does its work:
/// a Service added afterwards is served, an interface that appears
/// afterwards gets the datapath.
#[test]
fn the_daemonsets_capabilities_suffice_to_serve() {
    let fx = fixture();
    let caps = daemonset::added_capabilities(daemonset::container(&daemonset::load()));
    let agent = start_with_caps(&fx, &caps)
        .unwrap_or_else(|e| panic!("the agent with only {caps:?} did not start: {e:#}"));
    let pid = agent.pid().expect("running");
    let started_with: u64 = caps.iter().map(|c| bit(c)).sum();
    let steady: u64 = ["BPF", "NET_ADMIN"].iter().map(|c| bit(c)).sum();
    let dropped = wait_for(
        std::time::Duration::from_secs(20),
        std::time::Duration::from_millis(100),
        || {
            let sets = thread_sets(pid);
            let dropped = sets.iter().all(|(_, s)| {
                s.is_some_and(|s| {
                    s.effective == steady
                        && s.permitted == steady
                        && s.inheritable & !steady == 0
                        && s.no_new_privs
                })
            });
            if dropped {
                Ok(sets)
            } else {
                Err(format!("threads: {sets:#?}"))
            }
        },
    );
    let sets = match dropped {
        Ok((sets, _)) => sets,
        Err(last) => panic!(
            "started with {started_with:016x} ({caps:?}); every thread should hold exactly \
             {steady:016x} (BPF, NET_ADMIN) with no_new_privs once serving; {last}\n{}",
            agent.log()
        ),
    };
    eprintln!(
        "capabilities: started with CapEff {started_with:016x} ({caps:?}); steady state CapEff/CapPrm {steady:016x} on all {} threads",
        sets.len()
    );
    let tally = tcp_tally(&fx.topology.pod(CLIENT.0).ns, VIP, 20, TIMEOUT).expect("connections");
    assert!(
        tally.failures.is_empty() && tally.counts_for(&[BACKEND.0]) == [20],
        "with {caps:?}, then the steady set, every connection to the ClusterIP is served by {}: {tally:?}",
        BACKEND.0
    );

    // A Service added after the drop is programmed.
    let later = std::net::SocketAddrV4::new(CLUSTER_IP, VIP.port() + 1);
    fx.manifests
        .write(
            "later.yaml",
            &Service::new("test", "later", CLUSTER_IP)
                .port("http", later.port(), Protocol::Tcp, TCP_PORT)
                .yaml(Some(&[BACKEND.1])),
        )
        .expect("write manifest");
    let client = &fx.topology.pod(CLIENT.0).ns;
    let served = wait_until(
        std::time::Duration::from_secs(10),
        std::time::Duration::from_millis(200),
        || {
            let tally = tcp_tally(client, later, 5, TIMEOUT).expect("connections");
            if tally.failures.is_empty() && tally.counts_for(&[BACKEND.0]) == [5] {
                Ok(())
            } else {
                Err(format!("{tally:?}"))
            }
        },
    );
    if let Err(last) = served {
        panic!(
            "a Service added after the capabilities were dropped is not served: {last}\n{}",
            agent.log()
        );
    }

    an_interface_added_later_is_attached(&fx, &agent);
    // The program arrays `tc_ingress` reads stay pinned (so that it serves
    // IPv6 and DSR arrivals while no agent runs): pinned through the agent's
    // own descriptors, as opening them by id would need CAP_SYS_ADMIN.
    let dir = PinLayout::new(agent.bpf_root()).tail_calls_dir();
    let mut pinned: Vec<String> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    pinned.sort();
    assert!(
        pinned.len() == 2
            && pinned[0].starts_with("TC_DSR-of-tc_ingress-")
            && pinned[1].starts_with("TC_NEXT-of-tc_ingress-"),
        "with {caps:?}, the pinned program arrays in {} are {pinned:?}, not TC_DSR's and \
         TC_NEXT's:\n{}",
        dir.display(),
        agent.log()
    );
    let log = agent.log();
    assert!(
        !log.contains("Operation not permitted") && !log.contains("EPERM"),
        "something was refused after the drop:\n{log}"
    );
}

#[test]
fn without_each_capability_the_agent_stops_naming_it() {
    let fx = fixture();
    let caps = daemonset::added_capabilities(daemonset::container(&daemonset::load()));
    // The capabilities the agent itself needs; the DaemonSet's others are the
    // image's tools' (NET_RAW, iptables-legacy's raw socket).
    let required: Vec<String> = REQUIRED
        .iter()
        .map(|r| {
            format!("{:?}", r.capability)
                .trim_start_matches("CAP_")
                .to_owned()
        })
        .collect();
    for lacking in caps.iter().filter(|c| required.contains(c)) {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != lacking).cloned().collect();
        let err = match start_with_caps(&fx, &fewer) {
            Ok(agent) => panic!(
                "the agent started without CAP_{lacking}; its log:\n{}",
                agent.log()
            ),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains("exited") && err.contains(&format!("missing CAP_{lacking} (")),
            "without CAP_{lacking} the agent stops at start and names it; got: {err}"
        );
        for other in fewer {
            assert!(
                !err.contains(&format!("CAP_{other} (")),
                "without CAP_{lacking} the error names only it, not CAP_{other}: {err}"
            );
        }
    }
}

// The agent's explanation of a refused load (proxy_userspace::privileges::explain),
// on real refusals: the datapath loaded on a thread whose effective set lacks a
// capability.

/// Runs `f` on a thread of its own whose effective set lacks `drop`
/// (capabilities are per thread, so the test process keeps its own).
fn without<T: Send>(drop: &[Capability], f: impl FnOnce() -> T + Send) -> T {
    // aya probes the kernel's features once per process; probed on a
    // thread without CAP_BPF they would all read as missing, for every
    // other test too.
    aya::features();
    std::thread::scope(|s| {
        s.spawn(|| {
            for cap in drop {
                caps::drop(None, CapSet::Effective, *cap).expect("dropping a capability");
            }
            f()
        })
        .join()
        .expect("the thread ran")
    })
}

/// A pin directory of a test's own, emptied and removed on drop, also when
/// the test fails.
struct TestPins {
    root: std::path::PathBuf,
    pins: PinLayout,
}

impl TestPins {
    fn new() -> TestPins {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let root = std::path::PathBuf::from(format!(
            "/sys/fs/bpf/ebpf-proxy-unit-privileges-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let pins = PinLayout::new(&root);
        TestPins { root, pins }
    }
}

impl Drop for TestPins {
    fn drop(&mut self) {
        let _ = proxy_userspace::datapath::cleanup(&self.pins);
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The agent's own load of the datapath on a pin directory of its own, on
/// a thread without `drop`; the refusal explained.
fn load_without(drop: &[Capability]) -> Option<String> {
    let pins = TestPins::new();
    without(drop, || {
        match proxy_userspace::datapath::Datapath::load(pins.pins.clone()) {
            Ok(_) => panic!("the datapath loaded without {drop:?}"),
            Err(e) => match explain(&e) {
                Some(explained) => Some(explained.to_string()),
                None => panic!("not explained: {e:?}"),
            },
        }
    })
}

/// The explained refusal of the datapath's load without `drop`.
fn refusal_without(drop: &[Capability]) -> String {
    require_root().expect("privileged test");
    let effective = effective().expect("reading this process's capabilities");
    assert!(
        missing_from(&REQUIRED, &effective).is_empty(),
        "these tests take capabilities away and need them all to start with; missing {:?}",
        missing_from(&REQUIRED, &effective)
    );
    assert!(
        !EBPF_OBJECT.is_empty(),
        "the agent was built without its eBPF object"
    );
    load_without(drop).expect("the refusal is explained")
}

/// The agent's own explanation of a real refusal by the kernel, without `CAP_BPF`: the object's BTF, the
/// first thing loaded.
#[test]
fn a_refused_btf_load_names_cap_bpf() {
    let err = refusal_without(&[Capability::CAP_BPF, Capability::CAP_SYS_ADMIN]);
    assert!(
        err.starts_with("loading the object's BTF was refused")
            && err.contains("missing CAP_BPF ("),
        "{err}"
    );
    assert!(!err.contains("missing CAP_PERFMON"), "{err}");
}

/// A real refusal by the verifier, without `CAP_PERFMON`: the tc program.
#[test]
fn a_refused_program_load_names_cap_perfmon() {
    let err = refusal_without(&[Capability::CAP_PERFMON, Capability::CAP_SYS_ADMIN]);
    assert!(
        err.starts_with("loading a program was refused") && err.contains("missing CAP_PERFMON ("),
        "{err}"
    );
    assert!(!err.contains("missing CAP_BPF"), "{err}");
}

/// Without `CAP_NET_ADMIN` the kernel refuses to load a tc program at all.
#[test]
fn a_refused_program_load_names_cap_net_admin() {
    let err = refusal_without(&[Capability::CAP_NET_ADMIN, Capability::CAP_SYS_ADMIN]);
    assert!(
        err.starts_with("loading a program was refused") && err.contains("missing CAP_NET_ADMIN ("),
        "{err}"
    );
}

/// An EPERM with every capability there was refused by something else: the agent
/// does not blame a capability.
#[test]
fn a_refusal_with_every_capability_there_is_not_explained() {
    require_root().expect("privileged test");
    let effective = effective().expect("reading this process's capabilities");
    assert!(
        missing_from(&REQUIRED, &effective).is_empty(),
        "this test needs every capability the agent needs; missing {:?}",
        missing_from(&REQUIRED, &effective)
    );
    let err = std::io::Error::from_raw_os_error(libc::EPERM);
    assert!(explain(&err).is_none(), "explained as {:?}", explain(&err));
}
