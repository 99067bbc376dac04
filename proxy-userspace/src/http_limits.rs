//! Serving an axum router on a listener with bounds on what a client can
//! hold: every HTTP listener of the agent (/healthz, /metrics, the health
//! check node ports) is served through [`serve`] rather than
//! `axum::serve`, which has no timeout and no limit (docs/security.md,
//! "HTTP endpoints").
//!
//! - A request's head must arrive within [`HEADER_READ_TIMEOUT`] of the
//!   connection starting to wait for it (hyper's header read timeout, whose
//!   clock also runs while a kept-alive connection waits for its next
//!   request, so it is the keep-alive idle limit too).
//! - A connection on which no byte moves either way for [`IDLE_TIMEOUT`] is
//!   closed: a client that stops reading its response, or trickles a body.
//! - At most [`MAX_CONNECTIONS`] connections per listener and
//!   [`MAX_CONNECTIONS_PER_PEER`] per client address (an IPv6 client per
//!   /64); a connection over either is closed at once and counted in
//!   `ebpf_proxy_http_connections_rejected_total`.
//! - A request's head is at most [`MAX_HEAD_BYTES`] (hyper's read buffer,
//!   which is also what a connection can make the agent hold), its body at
//!   most [`MAX_BODY_BYTES`]: no endpoint reads a body.

use std::{
    collections::HashMap,
    future::Future,
    io,
    net::IpAddr,
    pin::{Pin, pin},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::Request,
    http::{StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore, watch},
    time::Instant,
};

use crate::http_metrics::{HttpMetrics, Rejection};

/// Time from a connection waiting for a request to that request's whole
/// head: probes and scrapes send theirs in one segment, so a few seconds
/// is generous even across a congested network.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time with no byte moving either way before a connection is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections open at once on one listener. Probers (the kubelet, a cloud
/// load balancer's health checker, Prometheus) hold one or two each.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections open at once from one client address (an IPv6 client: its
/// /64): one client cannot take the listener's connections from the
/// others.
pub const MAX_CONNECTIONS_PER_PEER: usize = 32;
/// A request's head, and the read buffer hyper keeps per connection (its
/// smallest allowed is 8 KiB).
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// A request's body; the endpoints take none.
pub const MAX_BODY_BYTES: usize = 4 * 1024;
/// What hyper accepts of headers in one request.
const MAX_HEADERS: usize = 64;

/// How long to wait after an accept fails for want of descriptors or memory
/// before accepting again (as `axum::serve` does).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` under the limits above until `stop` resolves
/// (or the returned future is dropped); the listener is closed then, and
/// open connections finish the request they are serving and close.
/// `listener_name` labels the listener's metrics.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    listener_name: &'static str,
    metrics: HttpMetrics,
    stop: impl Future<Output = ()>,
) {
    let app = app.layer(axum::middleware::from_fn(limit_body));
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let peers = Peers::default();
    // Dropped with this future: the connections then shut down gracefully.
    let (stopping, stopped) = watch::channel(());
    let mut stop = pin!(stop);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    if !is_connection_error(&e) {
                        tracing::warn!(listener = listener_name, error = %e, "accepting a connection");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let admitted = match Arc::clone(&slots).try_acquire_owned() {
            Err(_) => Err(Rejection::ListenerLimit),
            Ok(slot) => peers
                .admit(peer.ip())
                .map(|peer| (slot, peer))
                .ok_or(Rejection::PeerLimit),
        };
        let (slot, peer) = match admitted {
            Ok(admitted) => admitted,
            Err(why) => {
                metrics.rejected(listener_name, why);
                tracing::debug!(listener = listener_name, %peer, reason = why.label(), "connection over the limit closed");
                // Closed at once: the client learns now, and the agent holds
                // nothing of it.
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let open = metrics.open(listener_name);
        tokio::spawn(connection(
            stream,
            app.clone(),
            stopped.clone(),
            (slot, peer, open),
        ));
    }
    drop(stopping);
}

/// What a connection holds until it closes: its place under the listener's
/// and its client's limits, and its count among the open ones.
type Held = (
    OwnedSemaphorePermit,
    PeerSlot,
    crate::http_metrics::OpenGuard,
);

/// One connection, until it closes, idles out or its server stops.
async fn connection(stream: TcpStream, app: Router, mut stopped: watch::Receiver<()>, held: Held) {
    let activity = Activity::new();
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: Arc::clone(&activity),
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS);
    let mut conn = pin!(builder.serve_connection(io, TowerToHyperService::new(app)));
    let mut stopping = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "HTTP connection ended");
                }
                break;
            }
            () = activity.idle_for(IDLE_TIMEOUT) => {
                tracing::debug!("HTTP connection idle; closed");
                break;
            }
            // The sender is only ever dropped: this is the server stopping.
            _ = stopped.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
    drop(held);
}

/// Connection errors `accept` reports for one connection only; anything else
/// (out of descriptors or memory) calls for a pause.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// 413 for a body declared larger than [`MAX_BODY_BYTES`]; a body of unknown
/// length is cut there.
async fn limit_body(request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n").into_response();
    }
    let request = request.map(|body| Body::new(http_body_util::Limited::new(body, MAX_BODY_BYTES)));
    next.run(request).await
}

/// The client a per-peer limit counts: an IPv4 address, or an IPv6 /64 (what
/// one host is routinely given).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum PeerKey {
    V4(u32),
    V6(u64),
}

impl PeerKey {
    fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(v4) => PeerKey::V4(v4.to_bits()),
            IpAddr::V6(v6) => PeerKey::V6((v6.to_bits() >> 64) as u64),
        }
    }
}

/// Open connections by client.
#[derive(Clone, Default)]
struct Peers(Arc<Mutex<HashMap<PeerKey, usize>>>);

impl Peers {
    /// A place for one more connection of `ip`, unless it has its fill.
    fn admit(&self, ip: IpAddr) -> Option<PeerSlot> {
        let key = PeerKey::of(ip);
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let n = open.entry(key).or_default();
        if *n >= MAX_CONNECTIONS_PER_PEER {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            peers: self.clone(),
            key,
        })
    }
}

/// One connection's place among its client's; given back on drop.
struct PeerSlot {
    peers: Peers,
    key: PeerKey,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

/// When a connection last moved a byte, in milliseconds since it opened.
struct Activity {
    opened: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
        })
    }

    fn touch(&self) {
        let ms = self.opened.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Resolves once nothing has moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let due = self.last() + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

/// A stream that notes each byte moved in its [`Activity`].
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn a_peer_is_an_ipv4_address_or_an_ipv6_64() {
        let v6 = |s: &str| PeerKey::of(s.parse::<Ipv6Addr>().expect("address").into());
        assert_eq!(v6("2001:db8::1"), v6("2001:db8::ffff:1"), "same /64");
        assert_ne!(v6("2001:db8::1"), v6("2001:db8:0:1::1"), "another /64");
        assert_eq!(
            PeerKey::of(Ipv4Addr::new(10, 0, 0, 1).into()),
            v6("::ffff:10.0.0.1"),
            "an IPv4-mapped client is its IPv4 address"
        );
    }

    #[test]
    fn a_peer_gets_its_fill_and_its_places_back() {
        let peers = Peers::default();
        let ip: IpAddr = Ipv4Addr::new(10, 0, 0, 1).into();
        let held: Vec<_> = (0..MAX_CONNECTIONS_PER_PEER)
            .map(|_| peers.admit(ip).expect("under the limit"))
            .collect();
        assert!(peers.admit(ip).is_none(), "over the limit");
        assert!(
            peers.admit(Ipv4Addr::new(10, 0, 0, 2).into()).is_some(),
            "another client is not held back"
        );
        drop(held);
        assert!(peers.admit(ip).is_some(), "places given back");
        assert!(
            peers.0.lock().expect("lock").len() <= 1,
            "no entry left for clients without connections"
        );
    }

    async fn server() -> (SocketAddr, HttpMetrics) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let metrics = HttpMetrics::default();
        let app = Router::new().route("/", get(|| async { "ok" }).post(|| async { "ok" }));
        tokio::spawn(serve(
            listener,
            app,
            "test",
            metrics.clone(),
            std::future::pending(),
        ));
        (addr, metrics)
    }

    /// Everything the server sends until it closes, or None if it is still
    /// open after `within`.
    async fn read_until_closed(conn: &mut TcpStream, within: Duration) -> Option<String> {
        let mut out = Vec::new();
        tokio::time::timeout(within, conn.read_to_end(&mut out))
            .await
            .ok()
            .map(|_| String::from_utf8_lossy(&out).into_owned())
    }

    #[tokio::test]
    async fn an_unfinished_head_is_closed_after_the_header_timeout() {
        let (addr, _) = server().await;
        let mut conn = TcpStream::connect(addr).await.expect("connect");
        conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("part of a head");
        let started = std::time::Instant::now();
        let closed = read_until_closed(&mut conn, HEADER_READ_TIMEOUT * 2).await;
        assert!(
            closed.is_some(),
            "still open {:?} after a partial head",
            started.elapsed()
        );
        assert!(
            started.elapsed() + Duration::from_millis(100) >= HEADER_READ_TIMEOUT,
            "closed after {:?}, before the timeout",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn a_declared_body_over_the_limit_is_refused() {
        let (addr, _) = server().await;
        let mut conn = TcpStream::connect(addr).await.expect("connect");
        conn.write_all(
            format!(
                "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                MAX_BODY_BYTES + 1
            )
            .as_bytes(),
        )
        .await
        .expect("request");
        let response = read_until_closed(&mut conn, Duration::from_secs(5))
            .await
            .expect("answered and closed");
        assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    }

    #[tokio::test]
    async fn connections_over_a_peers_limit_are_closed_and_counted() {
        let (addr, metrics) = server().await;
        let mut held = Vec::new();
        for _ in 0..MAX_CONNECTIONS_PER_PEER {
            held.push(TcpStream::connect(addr).await.expect("connect"));
        }
        let mut over = TcpStream::connect(addr).await.expect("connect");
        let closed = read_until_closed(&mut over, Duration::from_secs(2)).await;
        assert_eq!(
            closed.as_deref(),
            Some(""),
            "the connection over the limit is closed at once, unanswered"
        );
        assert_eq!(metrics.rejected_count("test", Rejection::PeerLimit), 1);
        drop(held);
        // The places come back as the server sees the connections close.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .expect("request");
            let response = read_until_closed(&mut conn, Duration::from_secs(2))
                .await
                .unwrap_or_default();
            if response.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "not served again once the others closed: {response:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
