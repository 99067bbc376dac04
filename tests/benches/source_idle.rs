//! The agent at rest with S Services x 10 endpoints (10,000 by default), read
//! from one manifest file and, in the same run, from the loopback API server:
//! CPU used while nothing changes (user + system time from /proc/PID/stat
//! over a window) and resident memory, each source's absolute numbers and the
//! manifest source's ratio to the API source's.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench source_idle -- [--quick] [--out DIR]`
//! (root).

mod common;

use ebpf_proxy_apiserver as apiserver;

use std::{
    fs::{self, File},
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use ebpf_proxy_tests::{
    NotYet, Protocol,
    agent::{self, Agent, HEALTHZ},
    manifest::{ManifestDir, Service},
    netns::{NetNs, command_in, unique_stem},
};
use serde_json::json;

const ENDPOINTS: u32 = 10;
/// After the first healthy /healthz: the initial sync's aftermath (memory
/// handed back, the first rescans) is not idling.
const SETTLE: Duration = Duration::from_secs(5);

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i)
}

fn endpoints(service: u32) -> Vec<Ipv4Addr> {
    (0..ENDPOINTS)
        .map(|k| Ipv4Addr::from(0x0a80_0000 + service * (ENDPOINTS + 1) + k))
        .collect()
}

/// What one agent costs at rest.
#[derive(Clone, Copy, Debug)]
struct Idle {
    /// Percent of one core over the window.
    cpu_percent: f64,
    rss_mib: f64,
}

/// user + system time of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces; fields count from after it.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("no ')' in /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after the name.
    let field = |i: usize| -> Result<u64> {
        fields
            .get(i)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("field {} of /proc/{pid}/stat", i + 3))
    };
    Ok(field(11)? + field(12)?)
}

fn rss_mib(pid: u32) -> Result<f64> {
    Ok(ebpf_proxy_tests::process::rss_kib(pid)? as f64 / 1024.0)
}

fn measure_idle(pid: u32, window: Duration) -> Result<Idle> {
    thread::sleep(SETTLE);
    let hz = common::clock_ticks_per_second()?;
    let before = cpu_ticks(pid)?;
    let started = Instant::now();
    thread::sleep(window);
    let ticks = cpu_ticks(pid)? - before;
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Idle {
        cpu_percent: 100.0 * ticks as f64 / hz / elapsed,
        rss_mib: rss_mib(pid)?,
    })
}

/// `ebpf-proxy run --master URL` in a namespace; stopped, its pins removed
/// and its root deleted on drop. (The harness's `Agent` reads manifests.)
struct ApiAgent {
    child: Child,
    bin: PathBuf,
    bpf_root: PathBuf,
    log_path: PathBuf,
}

impl ApiAgent {
    fn start(node: &NetNs, master: &str) -> Result<ApiAgent> {
        let bin = agent::binary()?;
        let stem = unique_stem();
        // The harness's prefix, so its stale-state sweep knows it.
        let bpf_root = PathBuf::from(format!("/sys/fs/bpf/ebpf-proxy-test-{stem}"));
        let log_path = std::env::temp_dir().join(format!("{stem}-api-agent.log"));
        let log = File::create(&log_path)?;
        let child = command_in(&node.path(), &bin)
            .arg("run")
            .arg("--master")
            .arg(master)
            .arg("--bpf-root")
            .arg(&bpf_root)
            .arg("--healthz-bind-address")
            .arg(HEALTHZ.to_string())
            .arg("--node-name")
            .arg(node.name())
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the agent on the API server")?;
        let mut agent = ApiAgent {
            child,
            bin,
            bpf_root,
            log_path,
        };
        match agent::wait_healthy(&mut agent.child, &node.path(), Duration::from_mins(2)) {
            Ok(_) => Ok(agent),
            Err(NotYet::Never(why)) => bail!(
                "{why}; its log:\n{}",
                fs::read_to_string(&agent.log_path).unwrap_or_default()
            ),
            Err(NotYet::Again(last)) => bail!(
                "the agent on the API server was not healthy within 120 s (last /healthz: {last}); its log:\n{}",
                fs::read_to_string(&agent.log_path).unwrap_or_default()
            ),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ApiAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new(&self.bin)
            .arg("cleanup")
            .arg("--bpf-root")
            .arg(&self.bpf_root)
            .output();
        let _ = fs::remove_dir_all(&self.bpf_root);
        let _ = fs::remove_file(&self.log_path);
    }
}

fn from_manifests(services: u32, window: Duration) -> Result<Idle> {
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-idle-m"))?;
    node.ip(&["link", "set", "lo", "up"])?;
    let manifests = ManifestDir::create(&stem)?;
    let mut yaml = String::new();
    for i in 0..services {
        let svc = Service::new("bench", &format!("svc-{i}"), vip(i)).port(
            "http",
            80,
            Protocol::Tcp,
            8080,
        );
        yaml.push_str(&svc.yaml(Some(&endpoints(i))));
        yaml.push_str("---\n");
    }
    manifests.write("services.yaml", &yaml)?;
    let agent = Agent::start(&node, manifests.path())?;
    let pid = agent.pid().context("agent pid")?;
    measure_idle(pid, window)
}

fn from_api(services: u32, window: Duration) -> Result<Idle> {
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-idle-a"))?;
    node.ip(&["link", "set", "lo", "up"])?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let listener = node.run(|| std::net::TcpListener::bind("127.0.0.1:0"))??;
    listener.set_nonblocking(true)?;
    let server = {
        let _context = runtime.enter();
        apiserver::ApiServer::serve(tokio::net::TcpListener::from_std(listener)?)
    };
    server.apply(apiserver::node(node.name(), None));
    for i in 0..services {
        let name = format!("svc-{i}");
        server.apply(apiserver::service("bench", &name, &vip(i).to_string()));
        let ips: Vec<String> = endpoints(i).iter().map(ToString::to_string).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        server.apply(apiserver::slice(
            "bench",
            &format!("{name}-x7k2p"),
            &name,
            node.name(),
            &ips,
        ));
    }
    let agent = ApiAgent::start(&node, server.url())?;
    let idle = measure_idle(agent.pid(), window);
    drop(agent);
    drop(server);
    idle
}

fn main() {
    common::main_with("source_idle", |args| {
        let quick = args.flag("--quick");
        let services: u32 = if quick { 1_000 } else { 10_000 };
        let window = Duration::from_secs(if quick { 5 } else { 20 });
        let manifests = from_manifests(services, window)?;
        eprintln!("manifests: {manifests:?}");
        let api = from_api(services, window)?;
        eprintln!("API: {api:?}");
        let ratio = |m: f64, a: f64| {
            if a > 0.0 {
                format!("{:.2}x", m / a)
            } else {
                "-".into()
            }
        };
        let markdown = format!(
            "The agent at rest, {services} Services x {ENDPOINTS} endpoints, one run on this machine \
             (CPU: user + system time over {} s, after {} s of settling)\n\n\
             | source | idle CPU (% of a core) | resident memory |\n\
             |---|---:|---:|\n\
             | one manifest file | {:.2} % | {:.1} MiB |\n\
             | API server (loopback) | {:.2} % | {:.1} MiB |\n\
             | manifests / API | {} | {} |\n",
            window.as_secs(),
            SETTLE.as_secs(),
            manifests.cpu_percent,
            manifests.rss_mib,
            api.cpu_percent,
            api.rss_mib,
            ratio(manifests.cpu_percent, api.cpu_percent),
            ratio(manifests.rss_mib, api.rss_mib),
        );
        let json = json!({
            "services": services,
            "endpoints_per_service": ENDPOINTS,
            "window_s": window.as_secs(),
            "manifests": {"cpu_percent": manifests.cpu_percent, "rss_mib": manifests.rss_mib},
            "api": {"cpu_percent": api.cpu_percent, "rss_mib": api.rss_mib},
            "rss_ratio": manifests.rss_mib / api.rss_mib,
        });
        common::write_results(&args.out_dir()?, "source_idle", &markdown, &json)
    });
}
