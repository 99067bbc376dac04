//! The health check node ports of LoadBalancer Services with
//! externalTrafficPolicy Local, served as kube-proxy serves them
//! (`pkg/proxy/healthcheck/service_health.go`).
//!
//! The cloud load balancer probes spec.healthCheckNodePort on every node and
//! sends traffic only to nodes answering 200, which are the nodes with a
//! local Ready endpoint: traffic to the others would be dropped, since Local
//! policy never forwards to another node. So each port answers, on any path,
//! 200 when this node has local endpoints and the proxy is in sync, else
//! 503, with the count in a JSON body and in a weight header.
//!
//! The ports listen on the node addresses `--nodeport-addresses` lets serve
//! NodePorts (every address when it is unset, as kube-proxy), following them
//! as they come and go, and are served under `http_limits`' bounds.

use std::{
    collections::{BTreeMap, btree_map::Entry},
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    sync::{Arc, Mutex, PoisonError, Weak},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderName, StatusCode, header},
    response::IntoResponse,
};
use tokio::{
    net::{TcpListener, TcpSocket},
    sync::watch,
    task::JoinHandle,
};

use crate::{
    healthz::Health, http_limits, metrics::HttpMetrics, model::HealthCheck, retry::backoff,
};

#[derive(Debug, thiserror::Error)]
pub enum HealthCheckError {
    #[error("binding the health check of {service} to {addr}: {source}")]
    Bind {
        service: String,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

/// Listen backlog, as tokio's `TcpListener::bind` uses.
const BACKLOG: u32 = 1024;

/// The addresses the health check ports listen on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Addresses {
    /// Every address of the node, both families, whichever come later
    /// (`--nodeport-addresses` unset).
    Every,
    /// These addresses alone; none: the ports are open on no address.
    Only(Vec<IpAddr>),
}

/// Where a health check port listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum BindAddr {
    /// Every address of the node, both families: kube-proxy listens on
    /// "0.0.0.0", which Go opens as a dual-stack `[::]` socket.
    Any,
    Ip(IpAddr),
}

/// The health check node port server. The agent calls [`update`] after every
/// sync; listeners live until their port leaves the list or the server is
/// dropped. A port that fails to open is retried with backoff until it
/// opens or leaves the list: the load balancer would otherwise take the
/// node for one without endpoints until the list next changes, which may
/// be never.
///
/// [`update`]: HealthCheckServer::update
pub struct HealthCheckServer {
    inner: Arc<Inner>,
}

/// What the server and its retries share; the retries hold it weakly, so
/// that dropping the server closes its ports.
struct Inner {
    health: Health,
    http: HttpMetrics,
    /// A tokio mutex: updates await listeners being closed.
    ports: tokio::sync::Mutex<Ports>,
}

#[derive(Default)]
struct Ports {
    /// The addresses each port listens on.
    bind: Vec<BindAddr>,
    /// The listening ports.
    open: BTreeMap<u16, PortServer>,
    /// The wanted ports that failed to open.
    failed: BTreeMap<u16, HealthCheck>,
    /// A task retries `failed`; it clears this, under the lock, when it
    /// ends.
    retrying: bool,
}

/// What one port answers; shared with its handler so that a new count
/// takes effect without reopening the port.
#[derive(Debug)]
struct Served {
    namespace: String,
    name: String,
    local_endpoints: usize,
}

/// The listeners of one node port.
struct PortServer {
    served: Arc<Mutex<Served>>,
    /// Dropping it shuts the port's servers down (gracefully, so in-flight
    /// probes get their answer), also when the whole server is dropped.
    shutdown: watch::Sender<()>,
    tasks: Vec<JoinHandle<()>>,
    /// A second descriptor of each listening socket. Closing the server's
    /// descriptor does not close a socket that a child process, forked by
    /// another thread and not yet at its exec, still holds a copy of; a
    /// shutdown through this one takes the socket itself out of listening.
    listening: Vec<OwnedFd>,
}

impl PortServer {
    fn serves(&self, check: &HealthCheck) -> bool {
        let served = lock(&self.served);
        served.namespace == check.namespace && served.name == check.name
    }

    /// Closes the listeners, and returns once they are closed so the port can
    /// be reused at once. Open connections finish in the background.
    async fn stop(self) {
        drop(self.shutdown);
        for task in self.tasks {
            // Aborting drops the accept loop, and with it the listener, now
            // rather than after the last keep-alive connection goes away.
            task.abort();
            let _ = task.await;
        }
        for socket in self.listening {
            if let Err(err) =
                nix::sys::socket::shutdown(socket.as_raw_fd(), nix::sys::socket::Shutdown::Both)
            {
                tracing::warn!(error = %err, "could not shut a health check listener down");
            }
        }
    }
}

#[derive(Clone)]
struct HandlerState {
    served: Arc<Mutex<Served>>,
    health: Health,
}

impl HealthCheckServer {
    /// Listening on `addresses`, as kube-proxy listens on the node IPs
    /// matching nodePortAddresses. `health` decides "serviceProxyHealthy",
    /// as /healthz does; `http` counts the ports' connections.
    pub fn new(addresses: &Addresses, health: Health, http: HttpMetrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                health,
                http,
                ports: tokio::sync::Mutex::new(Ports {
                    bind: bind_addrs(addresses),
                    ..Ports::default()
                }),
            }),
        }
    }

    /// Listens on `addresses` from now on: the open ports are opened again
    /// on them when they differ from the last ones (the node's addresses
    /// changed).
    pub async fn set_addresses(&self, addresses: &Addresses) {
        let bind = bind_addrs(addresses);
        let mut guard = self.inner.ports.lock().await;
        let ports = &mut *guard;
        if ports.bind == bind {
            return;
        }
        tracing::info!(addresses = ?bind, "health check node ports move to the node's addresses");
        ports.bind = bind;
        let open = std::mem::take(&mut ports.open);
        let mut checks = Vec::with_capacity(open.len());
        for (port, server) in open {
            let check = {
                let served = lock(&server.served);
                HealthCheck {
                    namespace: served.namespace.clone(),
                    name: served.name.clone(),
                    node_port: port,
                    local_endpoints: served.local_endpoints,
                }
            };
            server.stop().await;
            checks.push(check);
        }
        for check in checks {
            self.inner.open(ports, check, 0);
        }
        if !ports.failed.is_empty() && !ports.retrying {
            ports.retrying = true;
            tokio::spawn(retry(Arc::downgrade(&self.inner)));
        }
    }

    /// Makes the served ports exactly those of `checks`: opens new ports,
    /// closes ports no longer listed (they refuse connections once this
    /// returns), and updates the others in place.
    ///
    /// A port that cannot be opened is logged and tried again with backoff
    /// (and on every update) until it opens; the other ports are
    /// unaffected. When two checks name the same port, the Service already
    /// holding it keeps it (else the first listed), as kube-proxy's second
    /// bind would fail.
    pub async fn update(&self, checks: Vec<HealthCheck>) {
        let mut guard = self.inner.ports.lock().await;
        let ports = &mut *guard;

        let mut wanted: BTreeMap<u16, HealthCheck> = BTreeMap::new();
        for check in checks {
            match wanted.entry(check.node_port) {
                Entry::Vacant(entry) => {
                    entry.insert(check);
                }
                Entry::Occupied(mut entry) => {
                    let holder = ports.open.get(&check.node_port);
                    let mut loser = check;
                    if holder.is_some_and(|p| p.serves(&loser) && !p.serves(entry.get())) {
                        loser = entry.insert(loser);
                    }
                    let winner = entry.get();
                    tracing::warn!(
                        service = %format!("{}/{}", loser.namespace, loser.name),
                        port = loser.node_port,
                        "health check node port is already used by {}/{}",
                        winner.namespace,
                        winner.name,
                    );
                }
            }
        }

        let stale: Vec<u16> = ports
            .open
            .keys()
            .filter(|port| !wanted.contains_key(port))
            .copied()
            .collect();
        for port in stale {
            if let Some(server) = ports.open.remove(&port) {
                tracing::info!(port, "closing health check node port");
                server.stop().await;
            }
        }

        ports.failed.clear();
        for (port, check) in wanted {
            if let Some(server) = ports.open.get(&port) {
                let mut served = lock(&server.served);
                served.namespace = check.namespace;
                served.name = check.name;
                served.local_endpoints = check.local_endpoints;
                continue;
            }
            self.inner.open(ports, check, 0);
        }
        if !ports.failed.is_empty() && !ports.retrying {
            ports.retrying = true;
            tokio::spawn(retry(Arc::downgrade(&self.inner)));
        }
    }

    /// The node ports currently listening, ascending.
    #[cfg(test)]
    pub async fn ports(&self) -> Vec<u16> {
        self.inner.ports.lock().await.open.keys().copied().collect()
    }
}

/// Tries the ports that failed to open again, with backoff, until each has
/// opened or left the list, or the server is gone.
async fn retry(inner: Weak<Inner>) {
    for attempt in 1.. {
        tokio::time::sleep(backoff(attempt)).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let mut ports = inner.ports.lock().await;
        for (_, check) in std::mem::take(&mut ports.failed) {
            inner.open(&mut ports, check, attempt);
        }
        if ports.failed.is_empty() {
            ports.retrying = false;
            return;
        }
    }
}

/// Where to listen for `addresses`: the wildcard, or each address once.
fn bind_addrs(addresses: &Addresses) -> Vec<BindAddr> {
    match addresses {
        Addresses::Every => vec![BindAddr::Any],
        Addresses::Only(ips) => {
            let mut bind: Vec<BindAddr> = ips
                .iter()
                .map(|ip| BindAddr::Ip(ip.to_canonical()))
                .collect();
            bind.sort_unstable();
            bind.dedup();
            bind
        }
    }
}

impl Inner {
    /// Opens `check`'s port, or files it among the failed ones, after
    /// `retries` retries.
    fn open(&self, ports: &mut Ports, check: HealthCheck, retries: u32) {
        let port = check.node_port;
        match self.start(&ports.bind, check.clone()) {
            Ok(server) => {
                if retries > 0 {
                    tracing::info!(port, retries, "health check node port opened on a retry");
                }
                ports.open.insert(port, server);
            }
            Err(err) => {
                let HealthCheckError::Bind { service, .. } = &err;
                tracing::warn!(
                    service = %service,
                    port,
                    error = %err,
                    retries,
                    "could not open health check node port; retrying with backoff"
                );
                ports.failed.insert(port, check);
            }
        }
    }

    /// Binds every address of the port, or none: kube-proxy too gives up on
    /// the whole port when one address fails, and retries it later.
    fn start(&self, bind: &[BindAddr], check: HealthCheck) -> Result<PortServer, HealthCheckError> {
        let service = format!("{}/{}", check.namespace, check.name);
        let (listeners, listening): (Vec<_>, Vec<_>) = bind
            .iter()
            .map(|&bind| listen(bind, check.node_port))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|(addr, source)| HealthCheckError::Bind {
                service: service.clone(),
                addr,
                source,
            })?
            .into_iter()
            .unzip();
        tracing::info!(service = %service, port = check.node_port, "opened health check node port");

        let served = Arc::new(Mutex::new(Served {
            namespace: check.namespace,
            name: check.name,
            local_endpoints: check.local_endpoints,
        }));
        let app = Router::new().fallback(respond).with_state(HandlerState {
            served: Arc::clone(&served),
            health: self.health.clone(),
        });
        let (shutdown, shutdown_rx) = watch::channel(());
        let tasks = listeners
            .into_iter()
            .map(|listener| {
                let mut shutdown_rx = shutdown_rx.clone();
                let stopped = async move {
                    // Nothing is ever sent: this resolves when the sender
                    // is dropped.
                    let _ = shutdown_rx.changed().await;
                };
                tokio::spawn(http_limits::serve(
                    listener,
                    app.clone(),
                    "health_check",
                    self.http.clone(),
                    stopped,
                ))
            })
            .collect();
        Ok(PortServer {
            served,
            shutdown,
            tasks,
            listening,
        })
    }
}

/// A listener, with a second descriptor of its socket for
/// [`PortServer::stop`]; on failure, on which address.
type Listen = Result<(TcpListener, OwnedFd), (SocketAddr, io::Error)>;

/// Opens a listener.
fn listen(bind: BindAddr, port: u16) -> Listen {
    match bind {
        BindAddr::Ip(ip) => listen_on(SocketAddr::new(ip, port)),
        BindAddr::Any => {
            match listen_on(SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port)) {
                // No IPv6 on this node (Go checks the same before choosing
                // a dual-stack socket): every address is an IPv4 one.
                Err((_, e)) if e.kind() != io::ErrorKind::AddrInUse => {
                    listen_on(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port))
                }
                result => result,
            }
        }
    }
}

fn listen_on(addr: SocketAddr) -> Listen {
    let open = || -> io::Result<(TcpListener, OwnedFd)> {
        let socket = match addr {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        // As Go and tokio do: a port closed a moment ago (connections in
        // TIME_WAIT) can be reopened.
        socket.set_reuseaddr(true)?;
        if addr.ip().is_unspecified() {
            // Dual-stack whatever net.ipv6.bindv6only says, as Go sets it.
            nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv6V6Only, &false)
                .map_err(io::Error::from)?;
        }
        socket.bind(addr)?;
        let listener = socket.listen(BACKLOG)?;
        let second = listener.as_fd().try_clone_to_owned()?;
        Ok((listener, second))
    };
    open().map_err(|e| (addr, e))
}

fn lock(served: &Mutex<Served>) -> std::sync::MutexGuard<'_, Served> {
    // The guarded data is always whole (plain assignments), so a panic
    // elsewhere leaves nothing half-updated.
    served.lock().unwrap_or_else(PoisonError::into_inner)
}

/// kube-proxy's `hcHandler.ServeHTTP`, for any method and path.
async fn respond(State(state): State<HandlerState>) -> impl IntoResponse {
    let (body, count, healthy) = {
        let served = lock(&state.served);
        let healthy = state.health.is_synced();
        (
            body(
                &served.namespace,
                &served.name,
                served.local_endpoints,
                healthy,
            ),
            served.local_endpoints,
            healthy,
        )
    };
    let status = if count != 0 && healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff".to_owned()),
            (
                HeaderName::from_static("x-load-balancing-endpoint-weight"),
                count.to_string(),
            ),
        ],
        body,
    )
}

/// The body kube-proxy writes: its dedented template with tabs, trimmed of
/// newlines, so no trailing newline. Names are quoted as JSON strings, the
/// same as Go's `%q` for the DNS labels Kubernetes names are.
fn body(namespace: &str, name: &str, count: usize, healthy: bool) -> String {
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        quote(namespace),
        quote(name),
    )
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tokio::{
        io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
        net::TcpStream,
    };

    use super::*;

    const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    /// A port nothing listens on right now.
    /// A port free when called, below the kernel's ephemeral range (32768
    /// up by default) and never handed out twice in this process: once a
    /// test releases it, no `bind(0)` or outgoing connection of a
    /// concurrent test can take it.
    fn free_port() -> u16 {
        listener_below_ephemeral_range()
            .local_addr()
            .expect("local addr")
            .port()
    }

    fn listener_below_ephemeral_range() -> std::net::TcpListener {
        static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
        let offset = (std::process::id() % 10_000) as u16;
        (0..10_000u16)
            .find_map(|_| {
                let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let port = 20_000 + offset.wrapping_add(n) % 10_000;
                std::net::TcpListener::bind((LOCALHOST, port)).ok()
            })
            .expect("a free port in 20000-29999")
    }

    fn check(name: &str, node_port: u16, local_endpoints: usize) -> HealthCheck {
        HealthCheck {
            namespace: "demo".into(),
            name: name.into(),
            node_port,
            local_endpoints,
        }
    }

    fn synced() -> Health {
        let health = Health::default();
        health.mark_synced();
        health
    }

    #[derive(Debug)]
    struct Response {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Response {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    /// One HTTP/1.1 request on an open connection, kept alive.
    async fn request(conn: &mut BufReader<TcpStream>, path: &str) -> Response {
        conn.get_mut()
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: node\r\n\r\n").as_bytes())
            .await
            .expect("sending the request");
        let mut line = String::new();
        conn.read_line(&mut line).await.expect("status line");
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            line.clear();
            conn.read_line(&mut line).await.expect("header line");
            let trimmed = line.trim_end_matches("\r\n");
            if trimmed.is_empty() {
                break;
            }
            let (name, value) = trimmed.split_once(':').expect("header has a colon");
            headers.push((name.to_owned(), value.trim().to_owned()));
        }
        let length: usize = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok())
            .expect("content-length");
        let mut body = vec![0; length];
        conn.read_exact(&mut body).await.expect("body");
        Response {
            status,
            headers,
            body: String::from_utf8(body).expect("UTF-8 body"),
        }
    }

    async fn connect(port: u16) -> io::Result<BufReader<TcpStream>> {
        TcpStream::connect((LOCALHOST, port))
            .await
            .map(BufReader::new)
    }

    async fn get(port: u16, path: &str) -> Response {
        let mut conn = connect(port).await.expect("connecting");
        request(&mut conn, path).await
    }

    fn expected_body(name: &str, count: usize, healthy: bool) -> String {
        format!(
            "{{\n\t\"service\": {{\n\t\t\"namespace\": \"demo\",\n\t\t\"name\": \"{name}\"\n\t}},\n\t\"localEndpoints\": {count},\n\t\"serviceProxyHealthy\": {healthy}\n}}"
        )
    }

    #[tokio::test]
    async fn serves_counts_and_closes_removed_ports() {
        let server = HealthCheckServer::new(
            &Addresses::Only(vec![LOCALHOST]),
            synced(),
            HttpMetrics::default(),
        );
        let port = free_port();

        server.update(vec![check("web", port, 0)]).await;
        assert_eq!(server.ports().await, vec![port]);
        let mut conn = connect(port).await.expect("connecting");
        let response = request(&mut conn, "/healthz").await;
        assert_eq!(response.status, 503, "no local endpoints: {response:?}");
        assert_eq!(response.body, expected_body("web", 0, true));
        assert_eq!(
            response.header("x-load-balancing-endpoint-weight"),
            Some("0")
        );

        server.update(vec![check("web", port, 2)]).await;
        // Same connection: the listener was updated, not reopened.
        let response = request(&mut conn, "/any/path?at=all").await;
        assert_eq!(response.status, 200, "{response:?}");
        assert_eq!(response.body, expected_body("web", 2, true));
        assert_eq!(response.header("content-type"), Some("application/json"));
        assert_eq!(response.header("x-content-type-options"), Some("nosniff"));
        assert_eq!(
            response.header("x-load-balancing-endpoint-weight"),
            Some("2")
        );
        drop(conn);

        server.update(Vec::new()).await;
        assert_eq!(server.ports().await, Vec::<u16>::new());
        let err = connect(port)
            .await
            .expect_err("a removed port refuses connections");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    }

    #[tokio::test]
    async fn unhealthy_proxy_answers_503() {
        let health = Health::default();
        let server = HealthCheckServer::new(
            &Addresses::Only(vec![LOCALHOST]),
            health.clone(),
            HttpMetrics::default(),
        );
        let port = free_port();
        server.update(vec![check("web", port, 2)]).await;

        let response = get(port, "/").await;
        assert_eq!(response.status, 503, "{response:?}");
        assert_eq!(response.body, expected_body("web", 2, false));
        assert_eq!(
            response.header("x-load-balancing-endpoint-weight"),
            Some("2")
        );

        health.mark_synced();
        assert_eq!(get(port, "/").await.status, 200);
    }

    #[tokio::test]
    async fn bind_failure_spares_other_ports_and_is_retried() {
        let server = HealthCheckServer::new(
            &Addresses::Only(vec![LOCALHOST]),
            synced(),
            HttpMetrics::default(),
        );
        let taken = listener_below_ephemeral_range();
        let busy = taken.local_addr().expect("local addr").port();
        let free = free_port();
        let checks = vec![check("busy", busy, 1), check("free", free, 1)];

        server.update(checks.clone()).await;
        assert_eq!(server.ports().await, vec![free]);
        assert_eq!(get(free, "/").await.body, expected_body("free", 1, true));

        drop(taken);
        server.update(checks).await;
        let mut want = vec![busy, free];
        want.sort_unstable();
        assert_eq!(server.ports().await, want);
        assert_eq!(get(busy, "/").await.body, expected_body("busy", 1, true));
    }

    /// Waits until `port` answers; panics with `what` after `within`.
    async fn answers_within(port: u16, within: std::time::Duration, what: &str) -> Response {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(mut conn) = connect(port).await {
                return request(&mut conn, "/").await;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: port {port} did not answer within {within:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// No update comes after the failure: the server's own retries open the
    /// port once it is free, and stop for a port no longer listed.
    #[tokio::test]
    async fn a_port_that_failed_to_open_is_retried_until_it_opens() {
        let server = HealthCheckServer::new(
            &Addresses::Only(vec![LOCALHOST]),
            synced(),
            HttpMetrics::default(),
        );
        let taken = listener_below_ephemeral_range();
        let busy = taken.local_addr().expect("local addr").port();
        server.update(vec![check("busy", busy, 1)]).await;
        assert_eq!(
            server.ports().await,
            Vec::<u16>::new(),
            "port {busy} is taken"
        );
        // A few retries fail while the port is still taken.
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        assert_eq!(
            server.ports().await,
            Vec::<u16>::new(),
            "port {busy} is taken"
        );

        drop(taken);
        let response = answers_within(busy, std::time::Duration::from_secs(10), "once freed").await;
        assert_eq!(response.body, expected_body("busy", 1, true));
        assert_eq!(server.ports().await, vec![busy]);

        let taken = listener_below_ephemeral_range();
        let unlisted = taken.local_addr().expect("local addr").port();
        server
            .update(vec![check("busy", busy, 1), check("gone", unlisted, 1)])
            .await;
        server.update(vec![check("busy", busy, 1)]).await;
        drop(taken);
        // Past several retries of a port still wanted (100 ms, then doubling).
        tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
        assert_eq!(
            server.ports().await,
            vec![busy],
            "a port that left the list before it could open stays closed"
        );
    }

    #[tokio::test]
    async fn a_shared_port_stays_with_its_holder() {
        let server = HealthCheckServer::new(
            &Addresses::Only(vec![LOCALHOST]),
            synced(),
            HttpMetrics::default(),
        );
        let port = free_port();

        server.update(vec![check("b", port, 1)]).await;
        server
            .update(vec![check("a", port, 3), check("b", port, 1)])
            .await;
        assert_eq!(get(port, "/").await.body, expected_body("b", 1, true));

        server.update(vec![check("a", port, 3)]).await;
        assert_eq!(get(port, "/").await.body, expected_body("a", 3, true));
    }

    #[tokio::test]
    async fn listens_on_every_address_by_default() {
        let server = HealthCheckServer::new(&Addresses::Every, synced(), HttpMetrics::default());
        let port = free_port();
        server.update(vec![check("web", port, 1)]).await;
        assert_eq!(get(port, "/").await.status, 200);
        server.update(Vec::new()).await;
        assert!(connect(port).await.is_err(), "closed");
    }

    /// A process forked by another thread holds a copy of every descriptor
    /// until its exec closes them; closing ours alone would leave the port
    /// accepting meanwhile (CI saw it while a test ran bpftool).
    #[tokio::test]
    async fn a_closed_port_refuses_while_another_descriptor_holds_its_socket() {
        let server = HealthCheckServer::new(&Addresses::Every, synced(), HttpMetrics::default());
        let port = free_port();
        server.update(vec![check("web", port, 1)]).await;
        let copy = server.inner.ports.lock().await.open[&port].listening[0]
            .try_clone()
            .expect("a copy of the listening socket, as a fork would hold");
        server.update(Vec::new()).await;
        let result = connect(port).await;
        assert!(
            result.is_err(),
            "port {port} still accepts once closed, while a copy of its socket is open"
        );
        drop(copy);
    }

    /// `--nodeport-addresses`: the ports listen on the addresses given, none
    /// before the node's are known, and move when they change.
    #[tokio::test]
    async fn ports_listen_only_on_the_addresses_given() {
        let other = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
        let server = HealthCheckServer::new(
            &Addresses::Only(Vec::new()),
            synced(),
            HttpMetrics::default(),
        );
        let port = free_port();
        server.update(vec![check("web", port, 1)]).await;
        assert!(connect(port).await.is_err(), "no address yet: refused");

        server
            .set_addresses(&Addresses::Only(vec![LOCALHOST]))
            .await;
        assert_eq!(get(port, "/").await.status, 200, "on {LOCALHOST}");

        server.set_addresses(&Addresses::Only(vec![other])).await;
        let err = connect(port).await.expect_err("moved off 127.0.0.1");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
        let conn = TcpStream::connect((other, port))
            .await
            .expect("on 127.0.0.2");
        let response = request(&mut BufReader::new(conn), "/").await;
        assert_eq!(response.body, expected_body("web", 1, true));
    }

    #[test]
    fn body_is_kube_proxys() {
        assert_eq!(
            body("kube-system", "dns", 3, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"kube-system\",\n\t\t\"name\": \"dns\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }
}
