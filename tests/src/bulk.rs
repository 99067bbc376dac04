//! Large transfers: a TCP backend that sends or takes megabytes, and the clients
//! that move them and check every byte, to show that full-sized and offloaded
//! (GSO/GRO) segments and path MTU discovery work through a translated path.
//!
//! Protocol: on accept the server greets with `<name> <peer ip>:<peer port>\n`
//! (as [`crate::servers::TcpServer`]); then the client sends one request line:
//! - `get <len> <seed>`: the server sends `len` bytes of [`fill`] of `seed` and
//!   closes;
//! - `put <len> <seed>`: the client sends `len` bytes of [`fill`] of `seed`; the
//!   server checks each and answers `<received> ok` or `<received> mismatch at
//!   <offset>` once it has them all (or at the first wrong byte).
//!
//! The server counts what it sent and received over all its connections, so that a
//! test can say how far a stalled upload got.

use std::{
    fmt,
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsFd,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::{
    client::{Peer, Reply},
    netns::{NetNs, NsThread},
};

/// How often blocked threads look at their stop flag or deadline.
const TICK: Duration = Duration::from_millis(100);
/// Size of the reads and writes of both ends.
const CHUNK: usize = 64 * 1024;

/// The `i`th 8-byte word of `seed`'s stream (splitmix64).
fn word(seed: u64, i: u64) -> u64 {
    let mut z = seed
        .wrapping_add(i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(0x0123_4567_89ab_cdef);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with the bytes at `offset..` of `seed`'s stream: pseudo-random, so a
/// lost, repeated or misplaced segment, or one with a wrong payload, shows.
pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    for (k, b) in buf.iter_mut().enumerate() {
        let at = offset + k as u64;
        *b = word(seed, at / 8).to_le_bytes()[(at % 8) as usize];
    }
}

/// The offset of the first byte of `buf` (at `offset` of `seed`'s stream) that is
/// not the stream's.
fn first_mismatch(seed: u64, offset: u64, buf: &[u8], scratch: &mut Vec<u8>) -> Option<u64> {
    scratch.resize(buf.len(), 0);
    fill(seed, offset, scratch);
    buf.iter()
        .zip(scratch.iter())
        .position(|(a, b)| a != b)
        .map(|k| offset + k as u64)
}

/// A bulk backend; see the module doc for its protocol.
#[derive(Debug)]
pub struct BulkServer {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    received: Arc<AtomicU64>,
    thread: Option<NsThread<()>>,
}

impl BulkServer {
    /// Listens on `[::]:port` inside `ns` (both families); returns once listening.
    pub fn start(ns: &NetNs, name: &str, port: u16) -> Result<BulkServer> {
        let listener = ns
            .run(|| TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)))?
            .with_context(|| format!("{name}: bind TCP port {port} in {}", ns.name()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let received = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, sent, received) = (stop.clone(), sent.clone(), received.clone());
            let name = name.to_owned();
            ns.spawn(&format!("bulk-{name}"), move || {
                let counts = Counts { sent, received };
                accept_loop(&listener, &name, &stop, &counts);
            })?
        };
        Ok(BulkServer {
            stop,
            sent,
            received,
            thread: Some(thread),
        })
    }

    /// Bytes sent to `get` requests so far (handed to the socket).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes of `put` requests received so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

impl Drop for BulkServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(Clone)]
struct Counts {
    sent: Arc<AtomicU64>,
    received: Arc<AtomicU64>,
}

fn accept_loop(listener: &TcpListener, name: &str, stop: &Arc<AtomicBool>, counts: &Counts) {
    let mut connections = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(TICK.as_millis() as u16)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => {
                eprintln!("{name}: poll: {e}");
                break;
            }
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let (name, stop, counts) = (name.to_owned(), stop.clone(), counts.clone());
                connections.push(thread::spawn(move || {
                    if let Err(e) = serve(stream, peer, &name, &stop, &counts) {
                        eprintln!("{name}: bulk connection from {peer}: {e:#}");
                    }
                }));
                connections.retain(|c| !c.is_finished());
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => eprintln!("{name}: accept: {e}"),
        }
    }
    for c in connections {
        let _ = c.join();
    }
}

fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    name: &str,
    stop: &AtomicBool,
    counts: &Counts,
) -> Result<()> {
    let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    stream.write_all(format!("{name} {peer}\n").as_bytes())?;
    stream.set_read_timeout(Some(TICK))?;
    stream.set_write_timeout(Some(TICK))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    loop {
        match reader.read_line(&mut line) {
            Ok(0) => return Ok(()),
            Ok(_) => break,
            Err(e) if try_again(&e) && !stop.load(Ordering::Relaxed) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let (len, seed) = match words[..] {
        [_, len, seed] => (len.parse::<u64>()?, seed.parse::<u64>()?),
        _ => bail!("malformed request {line:?}"),
    };
    match words[0] {
        "get" => {
            let mut buf = vec![0; CHUNK];
            let mut offset = 0;
            while offset < len && !stop.load(Ordering::Relaxed) {
                let n = CHUNK.min((len - offset) as usize);
                fill(seed, offset, &mut buf[..n]);
                let mut done = 0;
                while done < n && !stop.load(Ordering::Relaxed) {
                    match stream.write(&buf[done..n]) {
                        Ok(w) => done += w,
                        Err(e) if try_again(&e) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                offset += n as u64;
                counts.sent.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(())
        }
        "put" => {
            // What the reader buffered after the request line comes first.
            let mut received = 0u64;
            let mut mismatch = None;
            let mut scratch = Vec::new();
            let mut buf = vec![0; CHUNK];
            while received < len && mismatch.is_none() && !stop.load(Ordering::Relaxed) {
                let want = CHUNK.min((len - received) as usize);
                let n = match reader.read(&mut buf[..want]) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if try_again(&e) => continue,
                    Err(e) => return Err(e.into()),
                };
                mismatch = first_mismatch(seed, received, &buf[..n], &mut scratch);
                received += n as u64;
                counts.received.fetch_add(n as u64, Ordering::Relaxed);
            }
            let verdict = match mismatch {
                Some(at) => format!("{received} mismatch at {at}\n"),
                None => format!("{received} ok\n"),
            };
            stream.set_write_timeout(Some(Duration::from_secs(5)))?;
            stream.write_all(verdict.as_bytes())?;
            Ok(())
        }
        other => bail!("unknown request {other:?}"),
    }
}

/// Whether `e` means only that nothing moved yet: a socket timeout, or a
/// signal that interrupted a blocking call (the test process has many
/// threads, and a signal meant for any of them may land in this one's
/// read). The caller tries again, within its own deadline.
fn try_again(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
    )
}

/// How long a transfer may take: `within` in all, and no longer than `stall`
/// without a byte moving.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub within: Duration,
    pub stall: Duration,
}

/// What one transfer came to.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// `get` or `put`.
    pub direction: &'static str,
    pub expected: u64,
    /// Bytes that arrived (a download: read by the client; an upload: as the
    /// server counted them in its answer, else handed to the client's socket).
    pub moved: u64,
    /// The offset of the first wrong byte, if one was.
    pub mismatch: Option<u64>,
    /// Why it stopped short, if it did.
    pub error: Option<String>,
    pub elapsed: Duration,
}

impl Transfer {
    /// Every byte arrived, each the one sent.
    pub fn complete(&self) -> bool {
        self.moved == self.expected && self.mismatch.is_none() && self.error.is_none()
    }
}

impl fmt::Display for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} bytes: {} arrived in {:.1?}",
            self.direction, self.expected, self.moved, self.elapsed
        )?;
        if let Some(at) = self.mismatch {
            write!(f, ", wrong byte at offset {at}")?;
        }
        if let Some(e) = &self.error {
            write!(f, ", stopped: {e}")?;
        }
        Ok(())
    }
}

/// Connects from `ns` to `addr`, reads the greeting and sends `request`.
fn open<A: Peer>(ns: &NetNs, addr: A, request: &str) -> Result<(TcpStream, Reply<A>)> {
    let mut stream = ns
        .run(|| TcpStream::connect_timeout(&addr.into(), Duration::from_secs(5)))?
        .with_context(|| format!("connect to {addr} from {}", ns.name()))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    // The greeting byte by byte, so that nothing after it is read away.
    let mut greeting = Vec::new();
    let mut byte = [0u8; 1];
    while greeting.last() != Some(&b'\n') {
        if stream.read(&mut byte).context("read the greeting")? == 0 {
            bail!("{addr} closed the connection without a greeting");
        }
        greeting.push(byte[0]);
    }
    let reply = Reply::parse(&String::from_utf8_lossy(&greeting))?;
    stream.write_all(request.as_bytes())?;
    stream.set_read_timeout(Some(TICK))?;
    stream.set_write_timeout(Some(TICK))?;
    Ok((stream, reply))
}

/// Downloads `len` bytes of `seed`'s stream from the bulk server at `addr`, from
/// inside `ns`, checking each byte; the greeting says who served it.
pub fn download<A: Peer>(
    ns: &NetNs,
    addr: A,
    len: u64,
    seed: u64,
    limits: Limits,
) -> Result<(Reply<A>, Transfer)> {
    let (mut stream, reply) = open(ns, addr, &format!("get {len} {seed}\n"))?;
    let start = Instant::now();
    let mut last_progress = start;
    let mut t = Transfer {
        direction: "download",
        expected: len,
        moved: 0,
        mismatch: None,
        error: None,
        elapsed: Duration::ZERO,
    };
    let (mut buf, mut scratch) = (vec![0; CHUNK], Vec::new());
    while t.moved < len {
        match stream.read(&mut buf) {
            Ok(0) => {
                t.error = Some("the server closed the connection early".into());
                break;
            }
            Ok(n) => {
                if let Some(at) = first_mismatch(seed, t.moved, &buf[..n], &mut scratch) {
                    t.mismatch = Some(at);
                    t.moved += n as u64;
                    break;
                }
                t.moved += n as u64;
                last_progress = Instant::now();
            }
            Err(e) if try_again(&e) => {}
            Err(e) => {
                t.error = Some(format!("{:?}: {e}", e.kind()));
                break;
            }
        }
        if let Some(e) = overdue(start, last_progress, limits) {
            t.error = Some(e);
            break;
        }
    }
    t.elapsed = start.elapsed();
    Ok((reply, t))
}

/// Uploads `len` bytes of `seed`'s stream to the bulk server at `addr`, from inside
/// `ns`, and reads back how many arrived intact.
pub fn upload<A: Peer>(
    ns: &NetNs,
    addr: A,
    len: u64,
    seed: u64,
    limits: Limits,
) -> Result<(Reply<A>, Transfer)> {
    let (mut stream, reply) = open(ns, addr, &format!("put {len} {seed}\n"))?;
    let start = Instant::now();
    let mut last_progress = start;
    let mut t = Transfer {
        direction: "upload",
        expected: len,
        moved: 0,
        mismatch: None,
        error: None,
        elapsed: Duration::ZERO,
    };
    let mut buf = vec![0; CHUNK];
    let mut written = 0u64;
    'send: while written < len {
        let n = CHUNK.min((len - written) as usize);
        fill(seed, written, &mut buf[..n]);
        let mut done = 0;
        while done < n {
            match stream.write(&buf[done..n]) {
                Ok(w) => {
                    done += w;
                    written += w as u64;
                    last_progress = Instant::now();
                }
                Err(e) if try_again(&e) => {}
                Err(e) => {
                    t.error = Some(format!("{:?}: {e}", e.kind()));
                    break 'send;
                }
            }
            if let Some(e) = overdue(start, last_progress, limits) {
                t.error = Some(format!("{e} (sending)"));
                break 'send;
            }
        }
    }
    t.moved = written;
    if t.error.is_none() {
        let _ = stream.shutdown(Shutdown::Write);
        // The answer comes once the last byte arrived.
        let mut answer = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            match stream.read(&mut byte) {
                Ok(0) => {
                    t.error = Some("the server closed the connection without an answer".into());
                    break;
                }
                Ok(_) if byte[0] == b'\n' => break,
                Ok(_) => answer.push(byte[0]),
                Err(e) if try_again(&e) => {}
                Err(e) => {
                    t.error = Some(format!("{:?}: {e} (awaiting the answer)", e.kind()));
                    break;
                }
            }
            // Waiting for the answer counts against the stall limit from the
            // last byte handed to the socket.
            if let Some(e) = overdue(start, last_progress, limits) {
                t.error = Some(format!("{e} (all sent, no answer)"));
                break;
            }
        }
        let answer = String::from_utf8_lossy(&answer).into_owned();
        if t.error.is_none() {
            let words: Vec<&str> = answer.split_whitespace().collect();
            match words[..] {
                [n, "ok"] => t.moved = n.parse()?,
                [n, "mismatch", "at", at] => {
                    t.moved = n.parse()?;
                    t.mismatch = Some(at.parse()?);
                }
                _ => t.error = Some(format!("malformed answer {answer:?}")),
            }
        }
    }
    t.elapsed = start.elapsed();
    Ok((reply, t))
}

/// Why a transfer started at `start`, last moving at `last_progress`, must stop.
fn overdue(start: Instant, last_progress: Instant, limits: Limits) -> Option<String> {
    if last_progress.elapsed() > limits.stall {
        Some(format!("nothing moved for {:?}", limits.stall))
    } else if start.elapsed() > limits.within {
        Some(format!("not done after {:?}", limits.within))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_the_same_from_any_offset() {
        let mut whole = vec![0; 100];
        fill(7, 0, &mut whole);
        let mut tail = vec![0; 37];
        fill(7, 63, &mut tail);
        assert_eq!(&whole[63..], &tail[..]);
        let mut other = vec![0; 100];
        fill(8, 0, &mut other);
        assert_ne!(whole, other, "seeds give different streams");
        let mut scratch = Vec::new();
        assert_eq!(first_mismatch(7, 63, &tail, &mut scratch), None);
        tail[5] ^= 1;
        assert_eq!(first_mismatch(7, 63, &tail, &mut scratch), Some(68));
    }
}
