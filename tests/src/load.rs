//! The benchmarks' closed-loop client, beside [`crate::client`]'s one-request clients:
//! threads in a client namespace that open a new connection (or UDP socket) per
//! exchange with a [`crate::servers::PooledBackend`], as fast as the answers come,
//! and count what they saw.

use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    sync::{Arc, Barrier, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow};

use crate::{Protocol, bench::interrupt::INTERRUPTED, client::reset_on_close, netns::NetNs};

/// What the client sends; a [`crate::servers::PooledBackend`] answers it with its name.
pub const REQUEST: &[u8] = b"ping\n";
/// Connect and read timeout of one TCP exchange. Far above any healthy exchange (tens
/// of microseconds), low enough that a lost packet costs a cell little time.
pub const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// The UDP reply timeout.
pub const UDP_TIMEOUT: Duration = Duration::from_millis(500);
/// Upper bound on exchanges per thread and segment, whatever the machine's speed.
pub const MAX_PER_SEGMENT: usize = 2_000_000;

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
/// in turn; IPv4 unless they say otherwise), answered by backends that reply with one
/// of `backends`' names.
#[derive(Clone)]
pub struct Load<'a, A = SocketAddrV4> {
    pub ns: &'a NetNs,
    pub proto: Protocol,
    pub targets: &'a [A],
    pub backends: &'a [String],
}

impl<A: Into<SocketAddr> + Copy + Send + Sync + 'static> Load<'_, A> {
    /// `count` exchanges one at a time (a warm-up); bounded by the count, at most
    /// `count` times the I/O timeouts.
    pub fn sequential(&self, count: usize) -> Result<Sample> {
        let stop = Instant::now() + Duration::from_hours(1);
        let targets: Vec<SocketAddr> = self.targets.iter().map(|&t| t.into()).collect();
        let (proto, backends) = (self.proto, self.backends);
        self.ns
            .run(|| worker(proto, &targets, backends, 0, stop, count))
    }

    /// `threads` closed-loop clients for `segment`.
    pub fn closed_loop(&self, threads: usize, segment: Duration) -> Result<Sample> {
        let barrier = Arc::new(Barrier::new(threads + 1));
        let mut workers = Vec::new();
        for i in 0..threads {
            let (proto, targets, backends) = (
                self.proto,
                self.targets
                    .iter()
                    .map(|&t| t.into())
                    .collect::<Vec<SocketAddr>>(),
                self.backends.to_vec(),
            );
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
    proto: Protocol,
    targets: &[SocketAddr],
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
            Protocol::Tcp => tcp_exchange(target, &mut buf),
            Protocol::Udp => udp_exchange(target, &mut buf),
            // No SCTP sockets to load a Service with (sctp speaks it raw).
            Protocol::Sctp => Err(("an SCTP socket", ErrorKind::Unsupported)),
        };
        let latency = t0.elapsed();
        match result.and_then(|len| backend_of(&buf[..len], backends)) {
            Ok(b) => {
                sample.ok += 1;
                sample.backends[b] += 1;
                sample
                    .latencies
                    .push(latency.as_nanos().min(u128::from(u32::MAX)) as u32);
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
/// (`SO_LINGER` 0) keeps the client's sockets out of `TIME_WAIT`, where tens of thousands
/// of short connections would otherwise exhaust its ephemeral ports within seconds.
fn tcp_exchange(target: SocketAddr, buf: &mut [u8]) -> Result<usize, Failure> {
    let mut stream =
        TcpStream::connect_timeout(&target, IO_TIMEOUT).map_err(|e| ("connect", e.kind()))?;
    reset_on_close(&stream).map_err(|e| ("SO_LINGER", e.kind()))?;
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
fn udp_exchange(target: SocketAddr, buf: &mut [u8]) -> Result<usize, Failure> {
    let any = match target {
        SocketAddr::V4(_) => SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::V6(_) => SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
    };
    let socket = UdpSocket::bind(any).map_err(|e| ("bind", e.kind()))?;
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
