//! Prometheus metrics on `--metrics-bind-address` (`/metrics`), as kube-proxy
//! serves them: kube-proxy's own names, types and buckets ([`kube_proxy`]),
//! the process ([`process`]) and API client ([`rest_client`]) metrics its
//! dashboards and alerts read, and the datapath's own under `ebpf_proxy_`
//! ([`datapath`]), read from the maps at scrape time, with what the
//! address policy refused ([`policy`]).

pub mod datapath;
pub mod kube_proxy;
pub mod policy;
pub mod process;
pub mod rest_client;
pub mod server;
mod sync;

use std::sync::Arc;

use prometheus_client::{
    encoding::{EncodeMetric, MetricEncoder},
    metrics::MetricType,
    registry::Registry,
};

pub use self::{
    kube_proxy::ProxyMetrics, policy::PolicyMetrics, rest_client::RestClientMetrics,
    server::parse_bind_address, sync::SyncStats,
};

/// Every metric the agent exposes; cheap to clone, shared with the loop, the
/// API client and the health server.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub proxy: ProxyMetrics,
    pub rest_client: RestClientMetrics,
    pub policy: PolicyMetrics,
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
        Metrics {
            registry: Arc::new(registry),
            proxy,
            rest_client,
            policy,
        }
    }

    /// The Prometheus text exposition (format 0.0.4, as kube-proxy serves
    /// and `promtool check metrics` reads).
    pub fn render(&self) -> String {
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
