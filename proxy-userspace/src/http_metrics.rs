//! The agent's HTTP listeners' own metrics (`http_limits`), below both the
//! listeners and `metrics`, which registers them: connections
//! open, and connections closed unserved for being over a limit, by
//! listener (`healthz`, `metrics`, `health_check`).

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// Why a connection was closed unserved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// The listener had its fill of connections.
    ListenerLimit,
    /// The client (its address, an IPv6 client's /64) had its fill.
    PeerLimit,
}

impl Rejection {
    pub fn label(self) -> &'static str {
        match self {
            Rejection::ListenerLimit => "listener_limit",
            Rejection::PeerLimit => "peer_limit",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabel {
    listener: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectedLabels {
    listener: &'static str,
    reason: &'static str,
}

/// Cheap to clone: every listener counts into the same families.
#[derive(Clone, Debug, Default)]
pub struct HttpMetrics {
    open: Family<ListenerLabel, Gauge>,
    rejected: Family<RejectedLabels, Counter>,
}

/// One open connection, counted until dropped.
#[derive(Debug)]
pub struct OpenGuard(Gauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl HttpMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "ebpf_proxy_http_connections",
            "Connections open on each of the agent's HTTP listeners",
            self.open.clone(),
        );
        registry.register(
            "ebpf_proxy_http_connections_rejected",
            "Connections closed unserved for being over a listener's or a client's limit",
            self.rejected.clone(),
        );
    }

    pub fn rejected(&self, listener: &'static str, why: Rejection) {
        self.rejected
            .get_or_create(&RejectedLabels {
                listener,
                reason: why.label(),
            })
            .inc();
    }

    /// Counts a connection open on `listener` until the guard is dropped.
    pub fn open(&self, listener: &'static str) -> OpenGuard {
        let gauge = self.open.get_or_create(&ListenerLabel { listener }).clone();
        gauge.inc();
        OpenGuard(gauge)
    }

    #[cfg(test)]
    pub fn rejected_count(&self, listener: &'static str, why: Rejection) -> u64 {
        self.rejected
            .get_or_create(&RejectedLabels {
                listener,
                reason: why.label(),
            })
            .get()
    }
}
