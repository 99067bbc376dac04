//! The agent at scale: S Services x 10 endpoints (S = 1,000, 10,000 and
//! 100,000; `--quick` stops at 10,000) served by the loopback API server to
//! the agent binary through the real kube-rs client and watch.
//!
//! For each size: time from the agent's start to programmed (`/healthz` 200),
//! the initial sync's own time and the CPU time it took (its `synced` log
//! line: on a busy machine the sync also waits for a CPU, so the load
//! average at the time is reported beside them), resident memory after
//! the sync and its peak (`VmRSS`, `VmHWM`), one endpoint change from the API
//! server's store to the frontend's map entry (polled in the pinned
//! `SERVICES` map), from its arrival at the agent's sync loop to its map
//! writes and the sync's own time for it (both from the agent's log), p50
//! and p99, and a burst
//! (the endpoints of 1,000 Services changed at once) until every one of them
//! is in the maps, with the number of syncs it took. Beside them,
//! `iptables-restore` of kube-proxy's rules for the same Services, at the
//! sizes where it finishes within minutes.
//!
//! Then, in this process, where the agent's heap goes per Service: the same
//! objects decoded, held in the cluster state (Services, then slices), and
//! programmed by the planner into an in-memory store, each step's live bytes
//! counted by a counting global allocator, at 10,000 and 100,000 Services
//! (2,000 with `--quick`): the tables' fill differs with their size; and at
//! those sizes the first sync's CPU time in this process on maps that write
//! nothing, the agent's own share of it apart from the kernel's.
//!
//! RSS and the initial sync's time against the number of Services are
//! plotted into `scale.svg` beside the tables.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench scale -- [--quick] [--out DIR]
//! [--sizes 1000,10000] [--heap-sizes 10000] [--in-process-only]
//! [--sticky-service]` (root; `--in-process-only` stops after the in-process
//! measures, writing nothing; `--sticky-service` gives one Service, never one
//! of those changed, ClientIP session affinity).

mod common;

use ebpf_proxy_apiserver as apiserver;

use std::{
    alloc::{GlobalAlloc, Layout, System},
    collections::BTreeSet,
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    sync::atomic::{AtomicIsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use ebpf_proxy_tests::{
    POLL, Protocol as HarnessProtocol,
    agent::Agent,
    iptables::{self, KubeService},
    netns::{NetNs, unique_stem},
    process, wait_for, wait_until,
};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_common::{ServiceKey, ServiceValue, map_names::SERVICES};
use proxy_userspace::{
    agent::sync::{SyncLoop, SyncTarget},
    healthz::Health,
    model::ModelConfig,
    planner::{AffinityPurge, Departed, MapOp, MapStore, Planner, StoredState},
    source::{Kind, Object, ObjectKey, SourceEvent},
    state::ClusterState,
};
use serde_json::{Value, json};

const ENDPOINTS: u32 = 10;
const NAMESPACE: &str = "bench";
/// Pause after each single change: longer than the agent's
/// `--min-sync-period` (20 ms), so that each change is an isolated one.
const ISOLATED: Duration = Duration::from_millis(30);
/// Services whose endpoints change together in the burst.
const BURST: u32 = 1_000;
/// iptables-restore runs only up to this size: at 10,000 Services it already
/// takes seconds, and it grows faster than the rules do.
const IPTABLES_MAX: u32 = 10_000;

/// Bytes currently allocated through the global allocator, by anyone.
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// Blocks currently allocated (each costs the allocator a header too).
static BLOCKS: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is the one `System` needs.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
            BLOCKS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through `alloc`/`realloc` above, with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        BLOCKS.fetch_sub(1, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`, as the caller promises.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> (isize, isize) {
    (LIVE.load(Ordering::Relaxed), BLOCKS.load(Ordering::Relaxed))
}

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i)
}

/// Endpoint `k` of Service `i`; generation `g` moves endpoint 0 to an address
/// no other endpoint has.
fn endpoint(i: u32, k: u32, g: u32) -> Ipv4Addr {
    if k == 0 && g > 0 {
        Ipv4Addr::from(0x0b00_0000 + i * 64 + g)
    } else {
        Ipv4Addr::from(0x0a80_0000 + i * (ENDPOINTS + 1) + k)
    }
}

fn name(i: u32) -> String {
    format!("svc-{i}")
}

/// Service `i`; with ClientIP session affinity if `sticky`.
fn service_json(i: u32, sticky: bool) -> Value {
    let mut service = apiserver::service(NAMESPACE, &name(i), &vip(i).to_string());
    if sticky {
        service["spec"]["sessionAffinity"] = json!("ClientIP");
    }
    service
}

fn slice_json(i: u32, node: &str, generation: u32) -> Value {
    let ips: Vec<String> = (0..ENDPOINTS)
        .map(|k| endpoint(i, k, generation).to_string())
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let mut slice = apiserver::slice(
        NAMESPACE,
        &format!("{}-x7k2p", name(i)),
        &name(i),
        node,
        &ips,
    );
    // What a real API server adds to every object.
    slice["metadata"]["uid"] = json!(format!("0b5c1f7e-2d4a-4e8b-9c3f-{i:012}"));
    slice["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    slice["metadata"]["generation"] = json!(1);
    slice
}

fn frontend_key(i: u32) -> ServiceKey {
    ServiceKey {
        addr_be: proxy_common::v4_mapped(u32::from_ne_bytes(vip(i).octets())),
        port_be: 80u16.to_be(),
        proto: proxy_common::PROTO_TCP,
        scope: proxy_common::scope::ANY,
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// One `synced` line of the agent's JSON log.
struct Synced {
    frontends_changed: u64,
    elapsed_us: u64,
    /// From its oldest change's arrival at the agent's sync loop until its
    /// writes landed; None from an agent that does not log it.
    event_to_write_us: Option<u64>,
}

/// The `synced` lines of the agent's JSON log, in order.
fn syncs(log: &str) -> Vec<Synced> {
    synced_lines(log)
        .map(|v| Synced {
            frontends_changed: v["frontends_changed"].as_u64().unwrap_or(0),
            elapsed_us: v["elapsed_us"].as_u64().unwrap_or(0),
            event_to_write_us: v["event_to_write_us"].as_u64(),
        })
        .collect()
}

fn synced_lines(log: &str) -> impl Iterator<Item = Value> + '_ {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "synced")
}

/// The CPU time of the agent's first sync, in seconds: all its threads',
/// as the batches' writes have a thread of their own; the sync thread's
/// from an agent that logs only that, None from one that logs neither (an
/// older build, as a baseline).
fn first_sync_cpu(log: &str) -> Option<f64> {
    synced_lines(log)
        .next()
        .and_then(|v| {
            v["process_cpu_us"]
                .as_u64()
                .or_else(|| v["cpu_us"].as_u64())
        })
        .map(|us| us as f64 / 1e6)
}

/// The phases of the agent's first sync: where its time went, in seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Phases {
    /// The model: frontends from the objects.
    model: f64,
    /// The planner: ids, writes, bookkeeping.
    plan: f64,
    /// The batched map writes.
    write: f64,
    /// Booking each Service's outcome.
    book: f64,
}

/// [`Phases`] of the first `synced` line; None from an agent that does not
/// log them.
fn first_sync_phases(log: &str) -> Option<Phases> {
    let line = synced_lines(log).next()?;
    let s = |field: &str| line[field].as_u64().map(|us| us as f64 / 1e6);
    Some(Phases {
        model: s("model_us")?,
        plan: s("plan_us")?,
        write: s("write_us")?,
        book: s("book_us")?,
    })
}

/// Seconds since the epoch of a JSON log line's `timestamp`
/// (`2026-01-01T00:00:00.123456Z`, as the agent's subscriber writes it, UTC).
fn log_time(line: &Value) -> Option<f64> {
    let text = line["timestamp"].as_str()?;
    let (date, time) = text.strip_suffix('Z')?.split_once('T')?;
    let mut date = date.splitn(3, '-').map(str::parse::<i64>);
    let (year, month, day) = (date.next()?.ok()?, date.next()?.ok()?, date.next()?.ok()?);
    let mut time = time.splitn(3, ':').map(str::parse::<f64>);
    let (hours, minutes, seconds) = (time.next()?.ok()?, time.next()?.ok()?, time.next()?.ok()?);
    // Days from the civil date (Howard Hinnant's days_from_civil).
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    Some(days as f64 * 86_400.0 + hours * 3_600.0 + minutes * 60.0 + seconds)
}

/// From the last of the initial listings the first sync waits for (the
/// source's `listed` line for Services and for EndpointSlices, each logged
/// once its listing is decoded) until the first sync logged `synced`, its
/// writes landed: what "programmed within so long of the lists" means. None
/// from a log without them.
fn lists_to_programmed(log: &str) -> Option<f64> {
    let mut listed: Option<f64> = None;
    for line in log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        if line["message"] == "synced" {
            return Some(log_time(&line)? - listed?);
        }
        let kind = line["span"]["kind"].as_str();
        if line["message"] == "listed"
            && matches!(kind, Some("Service" | "EndpointSlice"))
            && let Some(at) = log_time(&line)
        {
            listed = Some(listed.map_or(at, |last| last.max(at)));
        }
    }
    None
}

/// The load average over the last minute.
fn load_average() -> Result<f64> {
    let text = fs::read_to_string("/proc/loadavg")?;
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no load average in /proc/loadavg: {text:?}"))
}

/// The pinned SERVICES map of an agent.
fn services_map(bpf_root: &Path) -> Result<BpfHashMap<MapData, ServiceKey, ServiceValue>> {
    let pin = bpf_root
        .join(format!("v{}", proxy_common::LAYOUT_VERSION))
        .join("maps")
        .join(SERVICES);
    let data = MapData::from_pin(&pin).with_context(|| format!("open {}", pin.display()))?;
    Ok(BpfHashMap::try_from(Map::HashMap(data))?)
}

/// Waits up to 2 s for the `synced` lines after the first `synced_before` to
/// count `frontends` changed frontends (a sync logs just after its map
/// writes): how long that took, or what the log had.
fn logged_changes(agent: &Agent, synced_before: usize, frontends: u64) -> Result<Duration, String> {
    wait_until(Duration::from_secs(2), POLL, || {
        let changed: u64 = syncs(&agent.log())
            .iter()
            .skip(synced_before)
            .map(|s| s.frontends_changed)
            .sum();
        if changed >= frontends {
            Ok(())
        } else {
            Err(format!("{changed} of {frontends} changed frontends logged"))
        }
    })
}

/// Polls until every key's entry differs from `before`; the time each was
/// first seen changed, from `since`.
fn wait_changed(
    map: &BpfHashMap<MapData, ServiceKey, ServiceValue>,
    before: &[(ServiceKey, ServiceValue)],
    since: Instant,
    timeout: Duration,
) -> Result<Vec<Duration>> {
    let mut seen: Vec<Option<Duration>> = vec![None; before.len()];
    let mut left = before.len();
    while left > 0 {
        for (i, (key, old)) in before.iter().enumerate() {
            if seen[i].is_some() {
                continue;
            }
            if map.get(key, 0).ok().is_some_and(|now| now != *old) {
                seen[i] = Some(since.elapsed());
                left -= 1;
            }
        }
        if since.elapsed() > timeout {
            bail!(
                "{left} of {} frontends were not reprogrammed within {timeout:?}",
                before.len()
            );
        }
    }
    Ok(seen.into_iter().flatten().collect())
}

#[derive(Debug, Default)]
struct Row {
    services: u32,
    start_to_programmed_s: f64,
    /// From the last initial listing decoded until the first sync's writes
    /// landed ([`lists_to_programmed`]).
    lists_to_programmed_s: Option<f64>,
    initial_sync_s: f64,
    initial_sync_cpu_s: Option<f64>,
    initial_sync_phases: Option<Phases>,
    /// The load average over the minute before the initial sync ended.
    load: f64,
    rss_mib: f64,
    hwm_mib: f64,
    change_p50_ms: f64,
    change_p99_ms: f64,
    change_sync_p50_ms: f64,
    change_sync_p99_ms: f64,
    /// A change's arrival at the agent's sync loop until its map writes, from
    /// the agent's log; NaN from an agent that does not log it.
    event_to_write_p50_ms: f64,
    event_to_write_p99_ms: f64,
    burst_s: f64,
    burst_syncs: usize,
    burst_hwm_mib: f64,
    iptables_restore_s: Option<f64>,
}

#[expect(
    clippy::too_many_lines,
    reason = "one measurement's steps in the order they run, sharing one agent and its API server"
)]
fn measure(services: u32, changes: u32, sticky: bool) -> Result<Row> {
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-scale"))?;
    node.ip(&["link", "set", "lo", "up"])?;
    let (runtime, server) = apiserver::serve_in(&node);
    server.set_history_limit(100_000);
    server.apply(apiserver::node(node.name(), None));
    for i in 0..services {
        // Service 1 is never one of the changes' (spread at a stride of 2 or
        // more): what a change to a Service without affinity costs on a
        // cluster where another has it.
        server.apply(service_json(i, sticky && i == 1));
        server.apply(slice_json(i, node.name(), 0));
    }
    let started = Instant::now();
    let agent = Agent::start_on_api(&node, server.url(), &["--log-format", "json"])?;
    let start_to_programmed = started.elapsed();
    let pid = agent.pid().context("agent pid")?;
    let map = services_map(agent.bpf_root())?;
    // /healthz turns 200 as the sync ends, just before its log line.
    let logged = wait_for(Duration::from_secs(30), POLL, || {
        syncs(&agent.log())
            .first()
            .map(|first| first.elapsed_us as f64 / 1e6)
            .ok_or("no synced line yet")
    });
    let Ok((initial_sync, _)) = logged else {
        bail!("no synced line in the agent's log:\n{}", agent.log());
    };
    let load = load_average()?;
    let initial_sync_cpu = first_sync_cpu(&agent.log());
    let phases = first_sync_phases(&agent.log());
    let lists_to_programmed = lists_to_programmed(&agent.log());
    // The sync's aftermath (allocator trims, the first rescans) is not the steady state.
    thread::sleep(Duration::from_secs(2));
    let rss = process::status_kib(pid, "VmRSS:")? as f64 / 1024.0;
    let hwm = process::status_kib(pid, "VmHWM:")? as f64 / 1024.0;
    eprintln!(
        "{services}: programmed {start_to_programmed:?}, {lists_to_programmed:?} s after the lists (sync {initial_sync:.3} s, CPU {initial_sync_cpu:?} s, load {load:.2}, {phases:?}), RSS {rss:.1} MiB, peak {hwm:.1} MiB"
    );

    // One change at a time, spread over the Services.
    let synced_before = syncs(&agent.log()).len();
    let mut latencies = Vec::new();
    for c in 0..changes {
        let i = (c * (services / changes).max(1)) % services;
        let key = frontend_key(i);
        let old = map
            .get(&key, 0)
            .context("the frontend is not in SERVICES")?;
        let at = Instant::now();
        server.apply(slice_json(i, node.name(), 1 + c / services));
        let seen = wait_changed(&map, &[(key, old)], at, Duration::from_secs(10))?;
        latencies.push(seen[0].as_secs_f64() * 1e3);
        // Isolated changes: the next finds the last sync more than
        // --min-sync-period ago, as a change on a quiet cluster does.
        thread::sleep(ISOLATED);
    }
    latencies.sort_by(f64::total_cmp);
    // Each change's own sync, and its wait from the event's arrival to its
    // map writes, from the agent's log: once the log has the last of them
    // (a sync logs just after its writes), or after 2 s with what it has.
    if let Err(last) = logged_changes(&agent, synced_before, u64::from(changes)) {
        eprintln!("warning: {services}: the log of the changes's syncs read as it is: {last}");
    }
    let change_lines: Vec<Synced> = syncs(&agent.log())
        .into_iter()
        .skip(synced_before)
        .filter(|s| s.frontends_changed > 0)
        .collect();
    let mut change_syncs: Vec<f64> = change_lines
        .iter()
        .map(|s| s.elapsed_us as f64 / 1e3)
        .collect();
    change_syncs.sort_by(f64::total_cmp);
    let mut event_to_write: Vec<f64> = change_lines
        .iter()
        .filter_map(|s| s.event_to_write_us)
        .map(|us| us as f64 / 1e3)
        .collect();
    event_to_write.sort_by(f64::total_cmp);

    // The burst: a rolling update of BURST Services' endpoints.
    let burst = BURST.min(services);
    let synced_before = syncs(&agent.log()).len();
    let targets: Vec<u32> = (0..burst)
        .map(|b| (b * (services / burst)) % services)
        .collect();
    let before: Vec<(ServiceKey, ServiceValue)> = targets
        .iter()
        .map(|&i| {
            let key = frontend_key(i);
            map.get(&key, 0).map(|v| (key, v))
        })
        .collect::<Result<_, _>>()?;
    let at = Instant::now();
    for &i in &targets {
        server.apply(slice_json(i, node.name(), 1000));
    }
    let seen = wait_changed(&map, &before, at, Duration::from_mins(1))?;
    let burst_time = seen.iter().max().copied().unwrap_or_default();
    if let Err(last) = logged_changes(&agent, synced_before, u64::from(burst)) {
        eprintln!("warning: {services}: the log of the burst's syncs read as it is: {last}");
    }
    let burst_syncs = syncs(&agent.log())[synced_before..]
        .iter()
        .filter(|s| s.frontends_changed > 0)
        .count();
    let burst_hwm = process::status_kib(pid, "VmHWM:")? as f64 / 1024.0;
    drop(map);
    drop(agent);
    drop(server);
    drop(runtime);

    let iptables_restore = if services <= IPTABLES_MAX {
        let kube: Vec<KubeService> = (0..services)
            .map(|i| KubeService {
                namespace: NAMESPACE.into(),
                name: name(i),
                port_name: "http".into(),
                protocol: HarnessProtocol::Tcp,
                cluster_ip: vip(i),
                port: 80,
                endpoints: (0..ENDPOINTS)
                    .map(|k| SocketAddrV4::new(endpoint(i, k, 0), 8080))
                    .collect(),
                affinity_timeout: None,
            })
            .collect();
        let started = Instant::now();
        iptables::apply(&node, &kube).context("iptables-restore of kube-proxy's rules")?;
        Some(started.elapsed().as_secs_f64())
    } else {
        None
    };
    drop(node);

    Ok(Row {
        services,
        start_to_programmed_s: start_to_programmed.as_secs_f64(),
        lists_to_programmed_s: lists_to_programmed,
        initial_sync_s: initial_sync,
        initial_sync_cpu_s: initial_sync_cpu,
        initial_sync_phases: phases,
        load,
        rss_mib: rss,
        hwm_mib: hwm,
        change_p50_ms: percentile(&latencies, 0.5),
        change_p99_ms: percentile(&latencies, 0.99),
        change_sync_p50_ms: percentile(&change_syncs, 0.5),
        change_sync_p99_ms: percentile(&change_syncs, 0.99),
        event_to_write_p50_ms: percentile(&event_to_write, 0.5),
        event_to_write_p99_ms: percentile(&event_to_write, 0.99),
        burst_s: burst_time.as_secs_f64(),
        burst_syncs,
        burst_hwm_mib: burst_hwm,
        iptables_restore_s: iptables_restore,
    })
}

/// Live heap bytes (and blocks) per Service at each step the agent takes.
#[derive(Debug, Default)]
struct Heap {
    services: u32,
    /// The decoded objects of one listing, before the state takes them.
    decoded: (f64, f64),
    /// What the cluster state keeps of them: the Services, then the slices.
    state_services: (f64, f64),
    state_slices: (f64, f64),
    /// The planner's bookkeeping of the programmed frontends.
    planner: (f64, f64),
    /// The source's keys of what it has sent (one set per kind).
    source_keys: (f64, f64),
}

fn per_service(delta: (isize, isize), services: u32) -> (f64, f64) {
    (
        delta.0 as f64 / f64::from(services),
        delta.1 as f64 / f64::from(services),
    )
}

fn sub(a: (isize, isize), b: (isize, isize)) -> (isize, isize) {
    (a.0 - b.0, a.1 - b.1)
}

/// What dropping `value` frees.
fn dropped<T>(value: T) -> (isize, isize) {
    let with = live();
    drop(value);
    sub(with, live())
}

/// Writes nothing: the sync's own work without the kernel's.
struct Discard;

impl MapStore for Discard {
    type Error = std::convert::Infallible;
    fn apply(&mut self, _: &MapOp) -> Result<(), Self::Error> {
        Ok(())
    }
    fn apply_all(&mut self, _: &[MapOp]) -> Result<(), (usize, Self::Error)> {
        Ok(())
    }
}

impl SyncTarget for Discard {
    type Store = Discard;
    fn store(&mut self) -> &mut Discard {
        self
    }
    fn clean_departed(&mut self, _: &[Departed], _: &AffinityPurge) -> bool {
        true
    }
}

/// CPU time of this thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The agent's first sync of `services` Services in this process, on maps
/// that write nothing: its CPU time in seconds, the kernel's writes left
/// out (the model, the planner and the booking of outcomes, which a
/// loaded machine's figures for the agent do not tell apart).
fn sync_cpu(services: u32) -> Result<f64> {
    let node = "node-a";
    let mut svc_objects = Vec::with_capacity(services as usize);
    let mut slice_objects = Vec::with_capacity(services as usize);
    for i in 0..services {
        let svc: Service = serde_json::from_value(service_json(i, false))?;
        let slice: EndpointSlice = serde_json::from_value(slice_json(i, node, 0))?;
        svc_objects.push(Object::service(&svc));
        slice_objects.push(Object::slice(&slice));
    }
    let now = Instant::now();
    let mut sync = SyncLoop::new(
        Duration::from_millis(20),
        Health::new(Duration::from_mins(1)),
        now,
    );
    let mut state = ClusterState::new(node);
    for (kind, objects) in [
        (Kind::Service, svc_objects),
        (Kind::EndpointSlice, slice_objects),
        (Kind::Node, Vec::new()),
    ] {
        sync.on_event(&mut state, SourceEvent::Replace { kind, objects }, now);
    }
    let mut planner = Planner::new();
    let started = thread_cpu();
    sync.run(
        now,
        &state,
        &ModelConfig::default(),
        &mut planner,
        &mut Discard,
    );
    let cpu = thread_cpu().saturating_sub(started);
    if planner.frontend_count() != services as usize {
        bail!(
            "the in-process sync programmed {} frontends of {services}",
            planner.frontend_count()
        );
    }
    Ok(cpu.as_secs_f64())
}

fn heap_by_structure(services: u32) -> Result<Heap> {
    let node = "node-a";
    // The JSON as the API server sends it, decoded as the source does.
    let texts: Vec<(String, String)> = (0..services)
        .map(|i| {
            (
                service_json(i, false).to_string(),
                slice_json(i, node, 0).to_string(),
            )
        })
        .collect();
    let start = live();
    let mut decoded_objects = Vec::with_capacity(services as usize);
    for (svc, slice) in &texts {
        let svc: Service = serde_json::from_str(svc)?;
        let slice: EndpointSlice = serde_json::from_str(slice)?;
        decoded_objects.push((svc, slice));
    }
    let decoded = sub(live(), start);
    // As the source hands them on: the Services alone, in a state of
    // their own, then both kinds; each state's bytes are what dropping it
    // frees. Each state gets Services of its own making: a clone would
    // share their names with the first.
    let listing = |decoded: &[(Service, EndpointSlice)]| -> Vec<Object> {
        decoded
            .iter()
            .map(|(svc, _)| Object::service(svc))
            .collect()
    };
    let services_only = {
        let mut state = ClusterState::new(node);
        state.apply(SourceEvent::Replace {
            kind: Kind::Service,
            objects: listing(&decoded_objects),
        });
        state
    };
    let services_bytes = dropped(services_only);
    let mut state = ClusterState::new(node);
    state.apply(SourceEvent::Replace {
        kind: Kind::Service,
        objects: listing(&decoded_objects),
    });
    state.apply(SourceEvent::Replace {
        kind: Kind::EndpointSlice,
        objects: decoded_objects
            .iter()
            .map(|(_, slice)| Object::slice(slice))
            .collect(),
    });
    drop(decoded_objects);
    drop(texts);

    let config = ModelConfig::default();
    let keys: Vec<ObjectKey> = state.services().cloned().collect();
    let mut store = StoredState::default();
    let mut planner = Planner::new();
    for key in &keys {
        let frontends = state.frontends_for(key, &config)?;
        let outcome = planner.sync_service(key, &frontends, &mut store);
        if !outcome.errors.is_empty() {
            bail!("programming {key}: {:?}", outcome.errors);
        }
    }
    let with_planner = live();
    drop(planner);
    let planner_bytes = sub(with_planner, live());
    drop(store);

    let start_keys = live();
    let known: [BTreeSet<ObjectKey>; 2] = [
        keys.iter().cloned().collect(),
        keys.iter()
            .map(|k| ObjectKey {
                namespace: k.namespace.clone(),
                name: format!("{}-x7k2p", k.name),
            })
            .collect(),
    ];
    let source_keys = sub(live(), start_keys);
    drop(known);
    let slices_bytes = sub(dropped(state), services_bytes);
    Ok(Heap {
        services,
        decoded: per_service(decoded, services),
        state_services: per_service(services_bytes, services),
        state_slices: per_service(slices_bytes, services),
        planner: per_service(planner_bytes, services),
        source_keys: per_service(source_keys, services),
    })
}

fn main() {
    common::main_with("scale", |args| {
        let quick = args.flag("--quick");
        let sizes = match args.value("--sizes")? {
            Some(list) => numbers(list, "--sizes")?,
            None if quick => vec![1_000, 10_000],
            None => vec![1_000, 10_000, 100_000],
        };
        let changes = if quick { 100 } else { 300 };
        let heap_sizes = match args.value("--heap-sizes")? {
            Some(list) => numbers(list, "--heap-sizes")?,
            None if quick => vec![2_000],
            None => vec![10_000, 100_000],
        };
        let mut heaps = Vec::new();
        let mut in_process = Vec::new();
        for &services in &heap_sizes {
            heaps.push(heap_by_structure(services)?);
            eprintln!("heap: {:?}", heaps.last());
            in_process.push((services, sync_cpu(services)?));
            eprintln!("in-process first sync: {:?}", in_process.last());
        }
        if args.flag("--in-process-only") {
            return Ok(());
        }
        let mut rows = Vec::new();
        for &services in &sizes {
            rows.push(measure(services, changes, args.flag("--sticky-service"))?);
            eprintln!("{:?}", rows.last());
        }

        let markdown = markdown(changes, &rows, &heaps, &in_process);
        let out = args.out_dir()?;
        write_plot(&out, &rows)?;
        let json = json!({
            "endpoints_per_service": ENDPOINTS,
            "changes": changes,
            "burst": BURST,
            "rows": rows.iter().map(|r| json!({
                "services": r.services,
                "start_to_programmed_s": r.start_to_programmed_s,
                "lists_to_programmed_s": r.lists_to_programmed_s,
                "initial_sync_s": r.initial_sync_s,
                "initial_sync_cpu_s": r.initial_sync_cpu_s,
                "initial_sync_phases_s": r.initial_sync_phases.map(|p| json!({
                    "model": p.model,
                    "plan": p.plan,
                    "write": p.write,
                    "book": p.book,
                })),
                "load_average": r.load,
                "rss_mib": r.rss_mib,
                "peak_rss_mib": r.hwm_mib,
                "change_p50_ms": r.change_p50_ms,
                "change_p99_ms": r.change_p99_ms,
                "change_sync_p50_ms": r.change_sync_p50_ms,
                "change_sync_p99_ms": r.change_sync_p99_ms,
                "event_to_write_p50_ms": r.event_to_write_p50_ms,
                "event_to_write_p99_ms": r.event_to_write_p99_ms,
                "burst_s": r.burst_s,
                "burst_syncs": r.burst_syncs,
                "peak_rss_after_burst_mib": r.burst_hwm_mib,
                "iptables_restore_s": r.iptables_restore_s,
            })).collect::<Vec<_>>(),
            "heap_per_service_bytes": heaps.iter().map(|h| json!({
                "services": h.services,
                "decoded_listing": h.decoded.0,
                "state_services": h.state_services.0,
                "state_slices": h.state_slices.0,
                "planner": h.planner.0,
                "source_keys": h.source_keys.0,
            })).collect::<Vec<_>>(),
            "in_process_first_sync_cpu_s": in_process.iter().map(|(services, cpu)| json!({
                "services": services,
                "cpu_s": cpu,
            })).collect::<Vec<_>>(),
        });
        common::write_results(&out, "scale", &markdown, &json)
    });
}

/// The results as markdown: the agent's table, the first syncs' phases, the
/// in-process syncs and the heap per structure.
fn markdown(changes: u32, rows: &[Row], heaps: &[Heap], in_process: &[(u32, f64)]) -> String {
    let mut markdown = format!(
        "The agent on the loopback API server (real kube-rs list and watch), S Services x \
         {ENDPOINTS} endpoints, one run on this machine. One change: an EndpointSlice \
         stored in the API server until its frontend's entry in the pinned `SERVICES` \
         map changes ({changes} changes, one at a time, each 30 ms after the last \
         was seen; includes the API server's watch and the bench's polling of the map); its event's arrival at the \
         agent's sync loop until its map writes landed, and the sync's own time \
         (model, planner, map writes), both from the agent's log. A change that finds \
         the last sync at least `--min-sync-period` (20 ms) ago is synced at once. Burst: {BURST} Services' slices changed at \
         once, until the last of them is in the maps. The initial sync's CPU time is \
         the agent's (every thread: its batches are written on one of their own while the \
         next is planned), with the machine's load average (1 minute) as it ended. Lists \
         to programmed: from the last of the Service and EndpointSlice listings decoded (the \
         agent's `listed` line) until the first sync's writes landed (its `synced` line): \
         the listing handed to the cluster state, then the initial sync.\n\n\
         | Services | start to programmed | lists to programmed | initial sync | its CPU time | load | \
         RSS after sync | peak RSS | \
         RSS per Service | one change p50 / p99 | event to map write p50 / p99 | \
         its sync p50 / p99 | burst | burst syncs | \
         peak after burst | iptables-restore (kube-proxy) |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        markdown.push_str(&format!(
            "| {} | {:.2} s | {} | {:.2} s | {} | {:.1} | {:.0} MiB | {:.0} MiB | {:.1} KiB | \
             {:.2} / {:.2} ms | {:.3} / {:.3} ms | {:.3} / {:.3} ms | {:.3} s | {} | \
             {:.0} MiB | {} |\n",
            r.services,
            r.start_to_programmed_s,
            r.lists_to_programmed_s
                .map_or_else(|| "not logged".to_owned(), |s| format!("{s:.2} s")),
            r.initial_sync_s,
            r.initial_sync_cpu_s
                .map_or_else(|| "not logged".to_owned(), |s| format!("{s:.2} s")),
            r.load,
            r.rss_mib,
            r.hwm_mib,
            r.rss_mib * 1024.0 / f64::from(r.services),
            r.change_p50_ms,
            r.change_p99_ms,
            r.event_to_write_p50_ms,
            r.event_to_write_p99_ms,
            r.change_sync_p50_ms,
            r.change_sync_p99_ms,
            r.burst_s,
            r.burst_syncs,
            r.burst_hwm_mib,
            r.iptables_restore_s
                .map_or_else(|| "not run".to_owned(), |s| format!("{s:.2} s")),
        ));
    }
    markdown.push_str(&phases_text(rows));
    for (services, cpu) in in_process {
        markdown.push_str(&format!(
            "\nThe same first sync of {services} Services in the bench's own process, on \
             maps that write nothing (model, planner and booking, without the kernel's \
             writes): {cpu:.2} s of CPU.\n"
        ));
    }
    markdown.push_str(&heap_table(heaps));
    markdown
}
/// A comma-separated list of numbers given to `option`.
fn numbers(list: &str, option: &str) -> Result<Vec<u32>> {
    list.split(',')
        .map(|s| {
            s.trim()
                .parse()
                .with_context(|| format!("{option}: {s:?} in a comma-separated list of numbers"))
        })
        .collect()
}

/// [`plot`] into `out`/scale.svg.
fn write_plot(out: &Path, rows: &[Row]) -> Result<()> {
    fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let path = out.join("scale.svg");
    fs::write(&path, plot(rows)).with_context(|| format!("write {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Where each initial sync's time went, by its phases (wall time, so on a
/// busy machine each includes its waits for a CPU).
fn phases_text(rows: &[Row]) -> String {
    let mut text = String::new();
    for r in rows {
        let Some(p) = r.initial_sync_phases else {
            continue;
        };
        if text.is_empty() {
            text.push_str(
                "\nWhere the initial sync's time went (wall time of each phase, from the \
                 agent's log):\n\n| Services | model | planner | map writes | booking |\n\
                 |---:|---:|---:|---:|---:|\n",
            );
        }
        text.push_str(&format!(
            "| {} | {:.2} s | {:.2} s | {:.2} s | {:.2} s |\n",
            r.services, p.model, p.plan, p.write, p.book
        ));
    }
    text
}

/// The heap per structure, one column per size counted.
fn heap_table(heaps: &[Heap]) -> String {
    let kib = |b: (f64, f64)| format!("{:.2} KiB in {:.1} blocks", b.0 / 1024.0, b.1);
    let mut markdown = format!(
        "\nRSS after the initial sync and the sync's time against the number of \
         Services: [scale.svg](scale.svg).\n\n![RSS and initial sync time against \
         Services](scale.svg)\n\n\
         Where the heap goes, per Service (S Services x {ENDPOINTS} endpoints in this \
         process, live bytes requested from the allocator; each block costs the \
         allocator about 16 bytes more):\n\n| structure |"
    );
    for h in heaps {
        markdown.push_str(&format!(" S = {} |", h.services));
    }
    markdown.push_str("\n|---|");
    markdown.push_str(&"---:|".repeat(heaps.len()));
    markdown.push('\n');
    type Pick = fn(&Heap) -> (f64, f64);
    let lines: [(&str, Pick); 5] = [
        (
            "the objects as decoded from the API's JSON (transient)",
            |h| h.decoded,
        ),
        ("cluster state: the Services kept", |h| h.state_services),
        ("cluster state: the EndpointSlices kept", |h| h.state_slices),
        ("planner's bookkeeping of the programmed frontends", |h| {
            h.planner
        }),
        ("the source's keys of what it sent", |h| h.source_keys),
    ];
    for (what, pick) in lines {
        markdown.push_str(&format!("| {what} |"));
        for h in heaps {
            markdown.push_str(&format!(" {} |", kib(pick(h))));
        }
        markdown.push('\n');
    }
    markdown
}

/// Two panels, RSS after the initial sync and the sync's own time, against
/// the number of Services on a logarithmic axis: an SVG small enough to
/// write by hand.
fn plot(rows: &[Row]) -> String {
    const W: f64 = 420.0;
    const H: f64 = 300.0;
    const LEFT: f64 = 64.0;
    const RIGHT: f64 = 16.0;
    const TOP: f64 = 36.0;
    const BOTTOM: f64 = 48.0;
    type Panel = (&'static str, &'static str, fn(&Row) -> f64);
    let panels: [Panel; 2] = [
        ("RSS after the initial sync", "MiB", |r| r.rss_mib),
        ("Initial sync (lists complete to programmed)", "s", |r| {
            r.initial_sync_s
        }),
    ];
    let services: Vec<f64> = rows.iter().map(|r| f64::from(r.services)).collect();
    let (lo, hi) = (
        services
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
            .log10()
            .floor(),
        services.iter().copied().fold(1.0, f64::max).log10().ceil(),
    );
    let span = (hi - lo).max(1.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{H}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        W * 2.0
    );
    for (panel, (title, unit, value)) in panels.iter().enumerate() {
        let x0 = panel as f64 * W;
        let values: Vec<f64> = rows.iter().map(value).collect();
        let top = nice_ceiling(values.iter().copied().fold(0.0, f64::max));
        let x = |n: f64| x0 + LEFT + (n.log10() - lo) / span * (W - LEFT - RIGHT);
        let y = |v: f64| TOP + (1.0 - v / top) * (H - TOP - BOTTOM);
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"13\">{title}</text>\n",
            x0 + W / 2.0
        ));
        for tick in 0..=4 {
            let v = top * f64::from(tick) / 4.0;
            svg.push_str(&format!(
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{} {unit}</text>\n",
                x0 + LEFT,
                x0 + W - RIGHT,
                y(v),
                y(v),
                x0 + LEFT - 4.0,
                y(v) + 4.0,
                trim(v),
            ));
        }
        let mut decade = lo;
        while decade <= hi {
            let n = 10f64.powf(decade);
            svg.push_str(&format!(
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
                x(n),
                x(n),
                TOP,
                H - BOTTOM,
                x(n),
                H - BOTTOM + 16.0,
                trim(n),
            ));
            decade += 1.0;
        }
        svg.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">Services ({ENDPOINTS} endpoints each)</text>\n",
            x0 + LEFT + (W - LEFT - RIGHT) / 2.0,
            H - 10.0
        ));
        let points: Vec<String> = services
            .iter()
            .zip(&values)
            .map(|(n, v)| format!("{:.1},{:.1}", x(*n), y(*v)))
            .collect();
        svg.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n",
            points.join(" ")
        ));
        for (v, point) in values.iter().zip(&points) {
            let (px, py) = point.split_once(',').unwrap_or(("0", "0"));
            svg.push_str(&format!(
                "<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"#1f77b4\"/>\
                 <text x=\"{px}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#1f77b4\">{} {unit}</text>\n",
                py.parse::<f64>().unwrap_or(0.0) - 7.0,
                trim(*v),
            ));
        }
    }
    svg.push_str("</svg>\n");
    svg
}

/// 1, 2 or 5 times a power of ten, at least `v`.
fn nice_ceiling(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * power)
}

/// A number as a label: whole when it is, else with two significant decimals.
fn trim(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 || v >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}
