//! /healthz, as kube-proxy serves it: 503 until the first full sync is in the
//! maps, then 200, with a small JSON body.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};

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

/// Shared with the sync loop: when the datapath was last fully synced.
#[derive(Clone, Default)]
pub struct Health {
    /// Unix milliseconds of the last successful sync; 0 before the first.
    last_synced_ms: Arc<AtomicU64>,
}

impl Health {
    pub fn mark_synced(&self) {
        self.last_synced_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub fn is_synced(&self) -> bool {
        self.last_synced_ms.load(Ordering::Relaxed) != 0
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn healthz(State(health): State<Health>) -> impl IntoResponse {
    let last = health.last_synced_ms.load(Ordering::Relaxed);
    let status = if last == 0 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    let body = serde_json::json!({
        "lastUpdated": last,
        "currentTime": now_ms(),
        "synced": last != 0,
    });
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
}

/// Binds now (so a bad address fails start-up), serves in the background.
pub async fn serve(
    addr: SocketAddr,
    health: Health,
) -> Result<tokio::task::JoinHandle<Result<(), HttpError>>, HttpError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(healthz))
        .with_state(health);
    Ok(tokio::spawn(async move {
        axum::serve(listener, app).await.map_err(HttpError::Serve)
    }))
}
