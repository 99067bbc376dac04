//! Prometheus metrics on `--metrics-bind-address` (`/metrics`), as kube-proxy
//! serves them: kube-proxy's own names, types and buckets ([`kube_proxy`]),
//! the process ([`process`]) and API client ([`rest_client`]) metrics its
//! dashboards and alerts read, and the datapath's own under `ebpf_proxy_`
//! ([`datapath`]), read from the maps when a scrape finds the last
//! encoding older than [`SNAPSHOT_MAX_AGE`], with what the address policy
//! refused ([`policy`]); and the HTTP listeners' own (`http_metrics`, below
//! both this module and the listeners).

pub mod datapath;
pub mod kube_proxy;
pub mod policy;
pub mod process;
pub mod rest_client;
pub mod server;
mod services;
mod sync;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use prometheus_client::{
    encoding::{EncodeMetric, MetricEncoder},
    metrics::{MetricType, counter::Counter},
    registry::Registry,
};

pub use self::{
    kube_proxy::ProxyMetrics, policy::PolicyMetrics, rest_client::RestClientMetrics,
    server::parse_bind_address, sync::SyncStats,
};
pub use crate::http_metrics::HttpMetrics;

/// Every metric the agent exposes; cheap to clone, shared with the loop, the
/// API client and the health server.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub proxy: ProxyMetrics,
    pub rest_client: RestClientMetrics,
    pub http: HttpMetrics,
    pub policy: PolicyMetrics,
    snapshot: Arc<Snapshot>,
}

/// How old an encoding of every metric may be when a scrape is answered
/// with it: reading the datapath's maps costs a system call per counter and
/// a pass over each hash map, which rapid or concurrent scrapes must not
/// multiply.
pub const SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(1);

/// The last encoding, and when it was begun.
#[derive(Default)]
struct Snapshot {
    /// An async lock: concurrent scrapes wait for the one encoding, without
    /// holding a thread each.
    last: tokio::sync::Mutex<Option<(Instant, Arc<str>)>>,
    encodings: Counter,
}

impl Metrics {
    /// The agent's metrics; `datapath` (the pinned maps, read at scrape
    /// time) when there is one.
    pub fn new(datapath: Option<datapath::DatapathCollector>) -> Self {
        let mut registry = Registry::default();
        let proxy = ProxyMetrics::default();
        proxy.register(&mut registry);
        let rest_client = RestClientMetrics::default();
        rest_client.register(&mut registry);
        let policy = PolicyMetrics::default();
        policy.register(&mut registry);
        registry.register_collector(Box::new(process::ProcessCollector));
        if let Some(datapath) = datapath {
            registry.register_collector(Box::new(datapath));
        }
        let http = HttpMetrics::default();
        http.register(&mut registry);
        let snapshot = Arc::new(Snapshot::default());
        registry.register(
            "ebpf_proxy_metrics_snapshots",
            "Encodings of /metrics, each reading the datapath's maps: at most one a second, however often it is scraped",
            snapshot.encodings.clone(),
        );
        Metrics {
            registry: Arc::new(registry),
            proxy,
            rest_client,
            http,
            snapshot,
            policy,
        }
    }

    /// What a scrape is answered with: the last encoding while it is younger
    /// than [`SNAPSHOT_MAX_AGE`], else a new one (off the async workers, as
    /// reading the maps is system calls). Scrapes that arrive during an
    /// encoding wait for it and share it.
    pub async fn snapshot(&self) -> Arc<str> {
        let mut last = self.snapshot.last.lock().await;
        if let Some((at, text)) = &*last
            && at.elapsed() < SNAPSHOT_MAX_AGE
        {
            return Arc::clone(text);
        }
        let began = Instant::now();
        let this = self.clone();
        let text: Arc<str> = tokio::task::spawn_blocking(move || this.render())
            .await
            .unwrap_or_default()
            .into();
        *last = Some((began, Arc::clone(&text)));
        text
    }

    /// The Prometheus text exposition (format 0.0.4, as kube-proxy serves
    /// and `promtool check metrics` reads).
    fn render(&self) -> String {
        self.snapshot.encodings.inc();
        let mut out = String::new();
        // Writing into a String cannot fail; a collector that cannot read
        // its source leaves its metrics out rather than fail the scrape.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// A metric exposed without a type. kube-proxy declares some gauges with
/// a `_total` name; as gauges those names break Prometheus' naming rules
/// (`promtool check metrics` refuses them), and as counters their value,
/// which goes down, would read as resets. Untyped keeps the name dashboards
/// query and the value as it is.
#[derive(Debug, Default, Clone)]
pub struct Untyped<M>(pub M);

impl<M: EncodeMetric> EncodeMetric for Untyped<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Unknown
    }
}
