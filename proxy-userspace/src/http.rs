//! /healthz and /livez, as kube-proxy serves them: 503 until the first full
//! sync is in the maps; afterwards 503 while a queued change has waited
//! longer than the health timeout (2 x `--sync-period`) without being
//! programmed, a change whose writes keep failing included; 200 otherwise.
//! The body carries `lastUpdated` (the last time every queued change was in
//! the maps) and `currentTime`, RFC 3339 as kube-proxy's.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant, SystemTime},
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use k8s_openapi::jiff::Timestamp;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("binding the healthz server to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("healthz server: {0}")]
    Serve(#[source] std::io::Error),
}

/// kube-proxy's health timeout for its default `--sync-period` of 30 s.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(60);

/// Shared with the sync loop: when the datapath was last fully programmed,
/// and since when a change has been waiting.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Mutex<Progress>>,
    timeout: Duration,
}

#[derive(Debug, Default)]
struct Progress {
    /// When every queued change was last in the maps; None before the
    /// first full sync.
    last_updated: Option<(Instant, SystemTime)>,
    /// The oldest change queued since then; None when nothing waits.
    oldest_queued: Option<Instant>,
}

/// What /healthz answers at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthStatus {
    pub healthy: bool,
    pub last_updated: Option<SystemTime>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new(DEFAULT_HEALTH_TIMEOUT)
    }
}

impl Health {
    /// A queued change unprogrammed for longer than `timeout` makes the
    /// agent unhealthy.
    pub fn new(timeout: Duration) -> Self {
        Health {
            inner: Arc::default(),
            timeout,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn progress(&self) -> MutexGuard<'_, Progress> {
        // Two plain fields: whatever a panicking holder left is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A change arrived that the maps do not hold yet (kube-proxy's
    /// `QueuedUpdate`): the oldest such change starts the clock.
    pub fn queued(&self) {
        self.queued_at(Instant::now());
    }

    pub fn queued_at(&self, now: Instant) {
        self.progress().oldest_queued.get_or_insert(now);
    }

    /// Every queued change is in the maps (kube-proxy's `Updated`).
    pub fn mark_synced(&self) {
        self.mark_synced_at(Instant::now());
    }

    pub fn mark_synced_at(&self, now: Instant) {
        let mut progress = self.progress();
        progress.last_updated = Some((now, SystemTime::now()));
        progress.oldest_queued = None;
    }

    pub fn status(&self) -> HealthStatus {
        self.status_at(Instant::now())
    }

    /// Healthy at `now`: synced once, and nothing queued for as long as
    /// the timeout.
    pub fn status_at(&self, now: Instant) -> HealthStatus {
        let progress = self.progress();
        let late = progress
            .oldest_queued
            .is_some_and(|queued| now.saturating_duration_since(queued) >= self.timeout);
        HealthStatus {
            healthy: progress.last_updated.is_some() && !late,
            last_updated: progress.last_updated.map(|(_, wall)| wall),
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.status().healthy
    }

    /// What kube-proxy's health check node ports call the service proxy
    /// being healthy: the same rule as /healthz.
    pub fn is_synced(&self) -> bool {
        self.is_healthy()
    }
}

/// RFC 3339 with nanoseconds, as Go's `time.Time` marshals; the zero time
/// for never, as kube-proxy's `lastUpdated` before its first sync.
fn rfc3339(time: Option<SystemTime>) -> String {
    match time.and_then(|t| Timestamp::try_from(t).ok()) {
        Some(t) => t.to_string(),
        None => "0001-01-01T00:00:00Z".to_owned(),
    }
}

async fn healthz(State(health): State<Health>) -> impl IntoResponse {
    let status = health.status();
    let code = if status.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "lastUpdated": rfc3339(status.last_updated),
        "currentTime": rfc3339(Some(SystemTime::now())),
        "synced": status.last_updated.is_some(),
    });
    (
        code,
        [("content-type", "application/json")],
        body.to_string(),
    )
}

/// Binds now (so a bad address fails start-up), serves in the background.
/// `/livez` answers by the same rule, as kube-proxy's does (which only
/// leaves out whether the node is eligible for traffic, which /healthz
/// does not judge here either).
pub async fn serve(
    addr: SocketAddr,
    health: Health,
    metrics: crate::metrics::ProxyMetrics,
) -> Result<tokio::task::JoinHandle<Result<(), HttpError>>, HttpError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(healthz))
        .route_layer(axum::middleware::from_fn_with_state(
            metrics,
            crate::metrics::kube_proxy::count_probes,
        ))
        .with_state(health);
    Ok(tokio::spawn(async move {
        axum::serve(listener, app).await.map_err(HttpError::Serve)
    }))
}

#[cfg(test)]
mod tests {
    use axum::response::IntoResponse;

    use super::*;

    #[test]
    fn unhealthy_before_the_first_sync_and_while_a_change_is_overdue() {
        let health = Health::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(!health.status_at(t0).healthy, "never synced: 503");
        health.queued_at(t0);
        assert!(
            !health.status_at(at(1)).healthy,
            "queued, never synced: 503"
        );
        health.mark_synced_at(at(2));
        assert!(health.status_at(at(2)).healthy, "synced: 200");
        assert!(
            health.status_at(at(1000)).healthy,
            "nothing queued: 200 however long"
        );

        health.queued_at(at(1000));
        health.queued_at(at(1030));
        assert!(
            health.status_at(at(1059)).healthy,
            "queued 59 s ago, timeout 60 s: still 200"
        );
        assert!(
            !health.status_at(at(1060)).healthy,
            "the oldest change (not the newest) counts: 503 60 s after it"
        );
        health.mark_synced_at(at(1070));
        assert!(health.status_at(at(1070)).healthy, "programmed: 200 again");
        assert!(health.is_synced(), "health check ports see the same rule");
    }

    #[tokio::test]
    async fn the_body_has_kube_proxys_fields() {
        let health = Health::new(Duration::from_secs(60));
        let body = |response: axum::response::Response| async move {
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
                .await
                .expect("body");
            serde_json::from_slice::<serde_json::Value>(&bytes).expect("JSON body")
        };
        let response = healthz(State(health.clone())).await.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let json = body(response).await;
        assert_eq!(json["lastUpdated"], "0001-01-01T00:00:00Z", "{json}");
        assert_eq!(json["synced"], false, "{json}");

        health.mark_synced();
        let response = healthz(State(health)).await.into_response();
        assert_eq!(response.status(), StatusCode::OK);
        let json = body(response).await;
        for field in ["lastUpdated", "currentTime"] {
            let text = json[field].as_str().unwrap_or_default();
            assert!(
                text.parse::<Timestamp>().is_ok() && text.ends_with('Z') && text > "2020",
                "{field} is not an RFC 3339 time: {json}"
            );
        }
    }
}
