//! What the benchmarks share: the command line and where results go (all of them),
//! and for the end-to-end ones (`e2e`, `nodeport`) Ctrl-C handling, the backend
//! servers, the closed-loop client, interleaved rounds and the per-round series they
//! give, paired ratios, the machine's description and the result files.
//!
//! Each bench includes it with `mod common;`. It is a directory with a `mod.rs`, so
//! cargo does not take it for a bench target of its own; not every bench uses every
//! item, hence the `dead_code` allowance.

#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc, Barrier,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use ebpf_proxy_tests::{
    netns::{NetNs, NsThread},
    run_cmd,
};
use nix::sys::{
    signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction},
    socket::{setsockopt, sockopt},
    time::{TimeVal, TimeValLike},
};

pub const REQUEST: &[u8] = b"ping\n";
/// Connect and read timeout of one TCP exchange. Far above any healthy exchange (tens
/// of microseconds), low enough that a lost packet costs a cell little time.
pub const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// The UDP reply timeout.
pub const UDP_TIMEOUT: Duration = Duration::from_millis(500);
/// How often idle server threads look at their stop flag.
pub const SERVER_TICK: Duration = Duration::from_millis(100);
/// Upper bound on exchanges per thread and segment, whatever the machine's speed.
pub const MAX_PER_SEGMENT: usize = 2_000_000;

// ---------------------------------------------------------------------------
// Ctrl-C

/// Set by SIGINT/SIGTERM: the run stops at the next exchange and unwinds through the
/// `Drop`s, which remove the namespaces and stop the agents.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::Relaxed) {
        // A second signal: the user wants out now, even from a step that does not look
        // at the flag (an agent starting on 10,000 Services). What is left behind
        // carries this pid, and `cargo xtask` removes it on its next start.
        // SAFETY: _exit is async-signal-safe.
        unsafe { nix::libc::_exit(130) };
    }
}

/// Routes SIGINT and SIGTERM to [`INTERRUPTED`].
pub fn install_signal_handlers() -> Result<()> {
    let handler = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(signal, &handler) }.context("install the signal handler")?;
    }
    Ok(())
}

pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Command line and results

/// The benchmark's arguments; anything it does not know (cargo passes `--bench`) is
/// ignored.
pub struct Args(Vec<String>);

impl Args {
    pub fn from_env() -> Args {
        Args(std::env::args().collect())
    }

    pub fn flag(&self, flag: &str) -> bool {
        self.0.iter().any(|a| a == flag)
    }

    /// The value after `flag`, if `flag` is given.
    pub fn value(&self, flag: &str) -> Result<Option<&str>> {
        self.0
            .iter()
            .position(|a| a == flag)
            .map(|i| {
                self.0
                    .get(i + 1)
                    .map(String::as_str)
                    .ok_or_else(|| anyhow!("{flag} needs a value"))
            })
            .transpose()
    }

    /// `--sizes 10,1000`, if given.
    pub fn sizes(&self) -> Result<Option<Vec<u32>>> {
        self.value("--sizes")?
            .map(|sizes| {
                sizes
                    .split(',')
                    .map(|s| s.trim().parse().with_context(|| format!("--sizes: {s:?}")))
                    .collect()
            })
            .transpose()
    }

    /// A number after `flag`, if given.
    pub fn number(&self, flag: &str) -> Result<Option<usize>> {
        self.value(flag)?
            .map(|v| v.parse().with_context(|| format!("{flag}: {v:?}")))
            .transpose()
    }

    /// `--sizes`, `--rounds` and `--threads` over a bench's defaults, checked.
    pub fn overrides(
        &self,
        sizes: &mut Vec<u32>,
        rounds: &mut usize,
        threads: &mut usize,
    ) -> Result<()> {
        if let Some(s) = self.sizes()? {
            *sizes = s;
        }
        if let Some(r) = self.number("--rounds")? {
            *rounds = r;
        }
        if let Some(t) = self.number("--threads")? {
            *threads = t;
        }
        if sizes.contains(&0) || *rounds == 0 || !(1..=64).contains(threads) {
            bail!("sizes and rounds must be positive and threads within 1..=64");
        }
        Ok(())
    }

    /// `--out DIR`, by default the workspace's bench/results (cargo runs a bench in its
    /// package's directory, tests/, so a relative default would land in tests/).
    pub fn out_dir(&self) -> Result<PathBuf> {
        Ok(self.value("--out")?.map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/results"),
            PathBuf::from,
        ))
    }
}

/// Runs a benchmark's `run`, and on an error says so and exits with 1.
pub fn main_with(bench: &str, run: impl FnOnce(&Args) -> Result<()>) {
    if let Err(e) = run(&Args::from_env()) {
        eprintln!("{bench} benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// Prints `markdown` and writes it and `json` to `<out_dir>/<stem>.md` and `.json`.
pub fn write_results(
    out_dir: &Path,
    stem: &str,
    markdown: &str,
    json: &serde_json::Value,
) -> Result<()> {
    println!("{markdown}");
    std::fs::create_dir_all(out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let md_path = out_dir.join(format!("{stem}.md"));
    std::fs::write(&md_path, markdown).with_context(|| format!("write {}", md_path.display()))?;
    let json_path = out_dir.join(format!("{stem}.json"));
    let json = serde_json::to_string_pretty(json)?;
    std::fs::write(&json_path, json + "\n")
        .with_context(|| format!("write {}", json_path.display()))?;
    eprintln!("wrote {} and {}", md_path.display(), json_path.display());
    Ok(())
}

// ---------------------------------------------------------------------------
// Backends

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn key(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// A backend pod's TCP (and optionally UDP) server, made for speed: a fixed pool of
/// threads serving one exchange each inline (the harness's servers spawn a thread per
/// connection, which on a small machine would cost more than the load balancers being
/// compared). TCP: read the request, answer `<name>\n`, close. UDP: answer every
/// datagram with `<name>\n`.
pub struct Backend {
    stop: Arc<AtomicBool>,
    threads: Vec<NsThread<()>>,
}

impl Backend {
    /// `threads` TCP server threads on `tcp_port` and, with a `udp_port`, as many UDP
    /// ones, in `ns`.
    pub fn start(
        ns: &NetNs,
        name: &str,
        tcp_port: u16,
        udp_port: Option<u16>,
        threads: usize,
    ) -> Result<Backend> {
        let (listener, udp) = ns
            .run(|| -> std::io::Result<_> {
                let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, tcp_port))?;
                let udp = udp_port
                    .map(|port| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)))
                    .transpose()?;
                Ok((listener, udp))
            })?
            .with_context(|| format!("{name}: bind the servers in {}", ns.name()))?;
        // accept() honours SO_RCVTIMEO on Linux, so threads blocked in it wake up to see
        // the stop flag; a blocking accept shared by several threads wakes one of them
        // per connection, where poll() would wake them all.
        setsockopt(
            &listener,
            sockopt::ReceiveTimeout,
            &TimeVal::milliseconds(SERVER_TICK.as_millis() as i64),
        )
        .with_context(|| format!("{name}: SO_RCVTIMEO on the listener"))?;
        let listener = Arc::new(listener);
        let udp = udp
            .map(|udp| -> Result<_> {
                udp.set_read_timeout(Some(SERVER_TICK))?;
                Ok(Arc::new(udp))
            })
            .transpose()?;
        let reply: Arc<[u8]> = format!("{name}\n").into_bytes().into();
        let mut backend = Backend {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        for i in 0..threads {
            let (listener, stop, tcp_reply) =
                (listener.clone(), backend.stop.clone(), reply.clone());
            backend
                .threads
                .push(ns.spawn(&format!("tcp-{name}-{i}"), move || {
                    tcp_serve(&listener, &tcp_reply, &stop)
                })?);
            if let Some(udp) = &udp {
                let (udp, stop, udp_reply) = (udp.clone(), backend.stop.clone(), reply.clone());
                backend
                    .threads
                    .push(ns.spawn(&format!("udp-{name}-{i}"), move || {
                        udp_serve(&udp, &udp_reply, &stop)
                    })?);
            }
        }
        Ok(backend)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn tcp_serve(listener: &TcpListener, reply: &[u8], stop: &AtomicBool) {
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                // Errors are the client's business (it counts them); a server that gives
                // up on one connection goes on with the next.
                let _ = (|| -> std::io::Result<()> {
                    stream.set_read_timeout(Some(IO_TIMEOUT))?;
                    let mut len = 0;
                    while !buf[..len].ends_with(b"\n") {
                        match stream.read(&mut buf[len..])? {
                            0 => return Ok(()),
                            n => len += n,
                        }
                        if len == buf.len() {
                            return Ok(());
                        }
                    }
                    // Then close: the FIN goes first, and the client's RST (it closes
                    // with SO_LINGER 0) ends the socket, so neither side keeps TIME_WAIT.
                    stream.write_all(reply)
                })();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => {
                eprintln!("warning: accept: {e}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn udp_serve(socket: &UdpSocket, reply: &[u8], stop: &AtomicBool) {
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        match socket.recv_from(&mut buf) {
            Ok((_, peer)) => {
                let _ = socket.send_to(reply, peer);
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => {
                eprintln!("warning: udp recv: {e}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The client

/// What some exchanges came to.
#[derive(Debug, Default)]
pub struct Sample {
    /// Latency of every successful exchange, in nanoseconds.
    pub latencies: Vec<u32>,
    pub ok: u64,
    /// Failures by `stage: kind`.
    pub errors: BTreeMap<String, u64>,
    /// Answers per backend, in the order of the names given to [`Load`].
    pub backends: Vec<u64>,
    /// Wall time; for threads merged into one sample, the longest thread's.
    pub elapsed: Duration,
}

impl Sample {
    pub fn merge(&mut self, other: Sample) {
        self.latencies.extend(other.latencies);
        self.ok += other.ok;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        if self.backends.len() < other.backends.len() {
            self.backends.resize(other.backends.len(), 0);
        }
        for (a, b) in self.backends.iter_mut().zip(other.backends) {
            *a += b;
        }
        self.elapsed = self.elapsed.max(other.elapsed);
    }

    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// What one client namespace sends where: exchanges of `proto` with `targets` (taken
/// in turn), answered by backends that reply with one of `backends`' names.
#[derive(Clone)]
pub struct Load<'a> {
    pub ns: &'a NetNs,
    pub proto: Proto,
    pub targets: &'a [SocketAddrV4],
    pub backends: &'a [String],
}

impl Load<'_> {
    /// `count` exchanges one at a time (a warm-up); bounded by the count, at most
    /// `count` times the I/O timeouts.
    pub fn sequential(&self, count: usize) -> Result<Sample> {
        let stop = Instant::now() + Duration::from_secs(3600);
        self.ns
            .run(|| worker(self.proto, self.targets, self.backends, 0, stop, count))
    }

    /// `threads` closed-loop clients for `segment`.
    pub fn closed_loop(&self, threads: usize, segment: Duration) -> Result<Sample> {
        let barrier = Arc::new(Barrier::new(threads + 1));
        let mut workers = Vec::new();
        for i in 0..threads {
            let (proto, targets, backends) =
                (self.proto, self.targets.to_vec(), self.backends.to_vec());
            let barrier = barrier.clone();
            workers.push(self.ns.spawn(&format!("bench-client-{i}"), move || {
                barrier.wait();
                worker(
                    proto,
                    &targets,
                    &backends,
                    i,
                    Instant::now() + segment,
                    MAX_PER_SEGMENT,
                )
            })?);
        }
        barrier.wait();
        let mut total = Sample::default();
        for w in workers {
            let sample = w.join().map_err(|_| anyhow!("a client thread panicked"))?;
            total.merge(sample);
        }
        Ok(total)
    }
}

type Failure = (&'static str, ErrorKind);

/// Exchanges one after the other until `until` or `max` attempts; runs on a thread
/// inside the client's namespace. `first` staggers the threads over `targets` when
/// there are several (a no-LB mode round-robins over the backends).
fn worker(
    proto: Proto,
    targets: &[SocketAddrV4],
    backends: &[String],
    first: usize,
    until: Instant,
    max: usize,
) -> Sample {
    let mut sample = Sample {
        latencies: Vec::with_capacity(max.min(1 << 16)),
        backends: vec![0; backends.len()],
        ..Sample::default()
    };
    let start = Instant::now();
    let mut buf = [0u8; 64];
    // Attempts, not successes, are bounded: a broken mode must end its turn too.
    for i in first..first + max {
        let t0 = Instant::now();
        if t0 >= until || INTERRUPTED.load(Ordering::Relaxed) {
            break;
        }
        let target = targets[i % targets.len()];
        let result = match proto {
            Proto::Tcp => tcp_exchange(target, &mut buf),
            Proto::Udp => udp_exchange(target, &mut buf),
        };
        let latency = t0.elapsed();
        match result.and_then(|len| backend_of(&buf[..len], backends)) {
            Ok(b) => {
                sample.ok += 1;
                sample.backends[b] += 1;
                sample
                    .latencies
                    .push(latency.as_nanos().min(u32::MAX as u128) as u32);
            }
            Err((stage, kind)) => {
                *sample
                    .errors
                    .entry(format!("{stage}: {kind:?}"))
                    .or_default() += 1;
            }
        }
    }
    sample.elapsed = start.elapsed();
    sample
}

/// Connect, send the request, read the one-line answer, close with a RST. The RST
/// (SO_LINGER 0) keeps the client's sockets out of TIME_WAIT, where tens of thousands
/// of short connections would otherwise exhaust its ephemeral ports within seconds.
fn tcp_exchange(target: SocketAddrV4, buf: &mut [u8]) -> Result<usize, Failure> {
    let mut stream = TcpStream::connect_timeout(&target.into(), IO_TIMEOUT)
        .map_err(|e| ("connect", e.kind()))?;
    let linger = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(&stream, sockopt::Linger, &linger)
        .map_err(|e| ("SO_LINGER", std::io::Error::from(e).kind()))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| ("SO_RCVTIMEO", e.kind()))?;
    stream.write_all(REQUEST).map_err(|e| ("send", e.kind()))?;
    let mut len = 0;
    while !buf[..len].ends_with(b"\n") {
        match stream.read(&mut buf[len..]) {
            Ok(0) => return Err(("receive", ErrorKind::UnexpectedEof)),
            Ok(n) => len += n,
            Err(e) => return Err(("receive", e.kind())),
        }
        if len == buf.len() {
            return Err(("receive", ErrorKind::InvalidData));
        }
    }
    Ok(len)
}

/// A new socket (so a new source port and a new flow), one request, one answer. The
/// socket is connected, so only an answer from the address it sent to is accepted: a
/// reply that escaped reverse NAT counts as lost.
fn udp_exchange(target: SocketAddrV4, buf: &mut [u8]) -> Result<usize, Failure> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| ("bind", e.kind()))?;
    socket.connect(target).map_err(|e| ("connect", e.kind()))?;
    socket
        .set_read_timeout(Some(UDP_TIMEOUT))
        .map_err(|e| ("SO_RCVTIMEO", e.kind()))?;
    socket.send(REQUEST).map_err(|e| ("send", e.kind()))?;
    socket.recv(buf).map_err(|e| ("receive", e.kind()))
}

fn backend_of(reply: &[u8], backends: &[String]) -> Result<usize, Failure> {
    let name = reply.strip_suffix(b"\n").unwrap_or(reply);
    backends
        .iter()
        .position(|b| b.as_bytes() == name)
        .ok_or(("reply", ErrorKind::InvalidData))
}

// ---------------------------------------------------------------------------
// Rounds and series

/// One segment: a mode's threads for one kind of exchange, in one round.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub rate: f64,
    /// Microseconds.
    pub p99: f64,
}

/// Everything measured for one mode and kind of exchange over all rounds.
#[derive(Debug, Default)]
pub struct Series {
    pub ok: u64,
    pub failed: u64,
    pub errors: BTreeMap<String, u64>,
    pub backends: Vec<u64>,
    pub seconds: f64,
    /// Each round's segment, in round order.
    pub rounds: Vec<Segment>,
    /// Latencies in nanoseconds, sorted once every round is in.
    pub latencies: Vec<u32>,
}

impl Series {
    /// Adds one round's segment.
    pub fn record(&mut self, mut sample: Sample) {
        sample.latencies.sort_unstable();
        let seconds = sample.elapsed.as_secs_f64();
        self.rounds.push(Segment {
            rate: sample.ok as f64 / seconds,
            p99: percentile_us(&sample.latencies, 0.99),
        });
        self.seconds += seconds;
        self.ok += sample.ok;
        self.failed += sample.failed();
        for (k, v) in sample.errors {
            *self.errors.entry(k).or_default() += v;
        }
        if self.backends.len() < sample.backends.len() {
            self.backends.resize(sample.backends.len(), 0);
        }
        for (a, b) in self.backends.iter_mut().zip(sample.backends) {
            *a += b;
        }
        self.latencies.extend(sample.latencies);
    }

    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.seconds
    }

    /// Failed exchanges over all attempted.
    pub fn failure_rate(&self) -> f64 {
        self.failed as f64 / (self.ok + self.failed).max(1) as f64
    }

    /// Of the latencies, once sorted ([`interleaved`] sorts them).
    pub fn percentile_us(&self, p: f64) -> f64 {
        percentile_us(&self.latencies, p)
    }

    /// `self` against `base` round by round, through `f` (rate or p99). The two
    /// segments of a round ran within a second or two of each other, so their ratio is
    /// spared most of the machine's drift and of other tenants' bursts, which hit whole
    /// seconds; the median over rounds is what the tables show.
    pub fn paired(&self, base: &Series, f: fn(&Segment) -> f64) -> Spread {
        Spread::of(
            self.rounds
                .iter()
                .zip(&base.rounds)
                .map(|(x, y)| f(x) / f(y))
                .collect(),
        )
    }

    pub fn rate_vs(&self, base: &Series) -> Spread {
        self.paired(base, |seg| seg.rate)
    }

    pub fn p99_vs(&self, base: &Series) -> Spread {
        self.paired(base, |seg| seg.p99)
    }

    /// The JSON fields of what was measured, for a bench's result row.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "per_second": self.rate(),
            "p50_us": self.percentile_us(0.50),
            "p90_us": self.percentile_us(0.90),
            "p99_us": self.percentile_us(0.99),
            "ok": self.ok,
            "failed": self.failed,
            "errors": self.errors,
            "seconds": self.seconds,
            "round_rates": self.rounds.iter().map(|r| r.rate).collect::<Vec<_>>(),
            "round_p99_us": self.rounds.iter().map(|r| r.p99).collect::<Vec<_>>(),
        })
    }
}

/// `rounds` rounds over `modes` side by side and `kinds` kinds of exchange (TCP, UDP):
/// in each round every kind in turn, and for each kind every mode, the modes' order
/// rotating each round so no mode always runs first or last. `measure(mode, kind)`
/// measures one segment. Returns the series as `[mode][kind]`, latencies sorted.
pub fn interleaved(
    rounds: usize,
    modes: usize,
    kinds: usize,
    mut measure: impl FnMut(usize, usize) -> Result<Sample>,
) -> Result<Vec<Vec<Series>>> {
    // Flat, mode-major: series[mode * kinds + kind].
    let mut series: Vec<Series> = (0..modes * kinds).map(|_| Series::default()).collect();
    for round in 0..rounds {
        for kind in 0..kinds {
            for k in 0..modes {
                let mode = (k + round) % modes;
                check_interrupted()?;
                series[mode * kinds + kind].record(measure(mode, kind)?);
            }
        }
    }
    let mut out = Vec::with_capacity(modes);
    let mut series = series.into_iter();
    for _ in 0..modes {
        let mut per_kind: Vec<Series> = series.by_ref().take(kinds).collect();
        for s in &mut per_kind {
            s.latencies.sort_unstable();
        }
        out.push(per_kind);
    }
    Ok(out)
}

/// Nearest-rank percentile of sorted nanoseconds, in microseconds.
pub fn percentile_us(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

/// Median and quartiles of some ratios.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
}

impl Spread {
    pub fn of(mut values: Vec<f64>) -> Spread {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        let at = |q: f64| {
            if values.is_empty() {
                return f64::NAN;
            }
            // Linear interpolation between closest ranks.
            let pos = q * (values.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            values[lo] + (values[hi] - values[lo]) * (pos - lo as f64)
        };
        Spread {
            median: at(0.5),
            q1: at(0.25),
            q3: at(0.75),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"median": self.median, "q1": self.q1, "q3": self.q3})
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2}x (quartiles {:.2}–{:.2})",
            self.median, self.q1, self.q3
        )
    }
}

// ---------------------------------------------------------------------------
// Reporting

/// A bench's modes. Each bench compares with kube-proxy's iptables mode and with the
/// client talking straight to the pods (no load balancer, the limit).
pub trait BenchMode: Copy + PartialEq {
    const IPTABLES: Self;
    const DIRECT: Self;
    /// The mode in the JSON.
    fn key(self) -> &'static str;
    /// The mode in the tables and messages.
    fn label(self) -> &'static str;
}

/// One result: a mode's series at one S, and what else the bench keeps with it.
#[derive(Debug)]
pub struct Stats<M, X> {
    pub services: u32,
    pub mode: M,
    /// Time to program the Services, for the modes that program any.
    pub programming: Option<Duration>,
    pub series: Series,
    /// The kind of exchange (e2e), node a's details (nodeport).
    pub detail: X,
}

/// What a bench keeps with each result besides [`Stats`]' own fields.
pub trait Detail {
    /// Whether two results at the same S ran interleaved, and so can be paired.
    fn same_cell(&self, other: &Self) -> bool;
}

/// What a report takes from a bench's results.
pub trait Rows<M, X> {
    /// The first result of `mode` at S `services`.
    fn find(&self, services: u32, mode: M) -> Option<&Stats<M, X>>;

    /// The result of `mode` that ran interleaved with `row`.
    fn peer(&self, row: &Stats<M, X>, mode: M) -> Option<&Stats<M, X>>;

    /// `row` against mode `base` in the same cell, round by round: see
    /// [`Series::paired`].
    fn rate_vs(&self, row: &Stats<M, X>, base: M) -> Spread {
        self.peer(row, base)
            .map_or_else(|| Spread::of(Vec::new()), |b| row.series.rate_vs(&b.series))
    }

    fn p99_vs(&self, row: &Stats<M, X>, base: M) -> Spread {
        self.peer(row, base)
            .map_or_else(|| Spread::of(Vec::new()), |b| row.series.p99_vs(&b.series))
    }

    /// A table row's cells from the mode on: `| mode | rate | vs iptables | vs no LB |
    /// p50 µs | p99 µs | failed |`.
    fn cells(&self, row: &Stats<M, X>) -> String
    where
        M: BenchMode,
    {
        let s = &row.series;
        format!(
            "| {} | {:.0} | {:.2}x | {:.2}x | {:.1} | {:.1} | {} |",
            row.mode.label(),
            s.rate(),
            self.rate_vs(row, M::IPTABLES).median,
            self.rate_vs(row, M::DIRECT).median,
            s.percentile_us(0.50),
            s.percentile_us(0.99),
            s.failed
        )
    }

    /// A row's JSON: the fields every bench has, and `extra`'s (an object).
    fn json(&self, row: &Stats<M, X>, extra: serde_json::Value) -> serde_json::Value
    where
        M: BenchMode,
    {
        let mut fields = row.series.json();
        merge(
            &mut fields,
            serde_json::json!({
                "services": row.services,
                "mode": row.mode.key(),
                "label": row.mode.label(),
                "vs_iptables": self.rate_vs(row, M::IPTABLES).json(),
                "vs_direct": self.rate_vs(row, M::DIRECT).json(),
                "p99_vs_iptables": self.p99_vs(row, M::IPTABLES).json(),
                "programming_s": row.programming.map(|d| d.as_secs_f64()),
            }),
        );
        merge(&mut fields, extra);
        fields
    }

    /// For each S, `modes`' time to program the Services: `- S = 10: ebpf-proxy 0.05
    /// s, …`.
    fn programming_markdown(&self, sizes: &[u32], modes: &[M]) -> String
    where
        M: BenchMode,
    {
        let mut out = String::new();
        for &services in sizes {
            let cells: Vec<String> = modes
                .iter()
                .filter_map(|&mode| {
                    let s = self.find(services, mode)?;
                    Some(format!(
                        "{} {:.2} s",
                        mode.label(),
                        s.programming?.as_secs_f64()
                    ))
                })
                .collect();
            out.push_str(&format!("- S = {services}: {}\n", cells.join(", ")));
        }
        out
    }
}

impl<M: PartialEq, X: Detail> Rows<M, X> for [Stats<M, X>] {
    fn find(&self, services: u32, mode: M) -> Option<&Stats<M, X>> {
        self.iter()
            .find(|s| s.services == services && s.mode == mode)
    }

    fn peer(&self, row: &Stats<M, X>, mode: M) -> Option<&Stats<M, X>> {
        self.iter().find(|s| {
            s.services == row.services && s.mode == mode && s.detail.same_cell(&row.detail)
        })
    }
}

/// Adds `from`'s fields to `into`, both objects.
fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (serde_json::Value::Object(into), serde_json::Value::Object(from)) = (into, from) {
        into.extend(from);
    }
}

// ---------------------------------------------------------------------------
// The machine

pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub kernel: String,
    pub iptables: String,
    pub nft: String,
}

impl Machine {
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or("unknown CPU".into(), |(_, v)| v.trim().to_owned());
        let version = |program: &str, arg: &str| {
            run_cmd(Command::new(program).arg(arg))
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|e| format!("{program}: {e:#}"))
        };
        Machine {
            cpu,
            cores: thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or("unknown".into(), |s| s.trim().to_owned()),
            iptables: version("iptables", "--version"),
            nft: version("nft", "--version"),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "cpu": self.cpu,
            "cores": self.cores,
            "kernel": self.kernel,
            "iptables": self.iptables,
            "nft": self.nft,
        })
    }
}

/// /proc/loadavg's 1-minute figure.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Client threads: four per core, at least 8 and at most 32. The rate measured is
/// the machine's capacity for short connections, so the cores must stay busy: with
/// one thread per core each exchange waits for the other side to be woken, and a
/// woken vCPU of a VM takes tens of µs to run, which the rate then measures instead
/// of the per-connection work the datapaths differ in. On 2 cores, 8 threads gave 65%
/// more connections/s than 2 for every mode (no LB 14,800 against 9,000), and 16
/// threads no more than 8.
pub fn default_threads() -> usize {
    thread::available_parallelism()
        .map_or(2, |n| n.get())
        .saturating_mul(4)
        .clamp(8, 32)
}

/// The last 20 lines of an agent's output, to go with an error.
pub fn log_tail(agent: &ebpf_proxy_tests::agent::Agent) -> String {
    let log = agent.log();
    let lines: Vec<&str> = log.lines().collect();
    format!(
        "\nlast lines of the agent's output:\n{}",
        lines[lines.len().saturating_sub(20)..].join("\n")
    )
}
