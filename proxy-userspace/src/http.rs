//! The /healthz, /livez and /readyz server: the answers are `healthz`'s.

use std::{net::SocketAddr, time::Instant};

use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};

use crate::healthz::{Health, Probe};

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("binding the healthz server to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

fn answer(health: &Health, probe: Probe) -> impl IntoResponse + use<> {
    let (code, body) = health.answer_at(probe, Instant::now());
    (
        code,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
}

async fn healthz(State(health): State<Health>) -> impl IntoResponse {
    answer(&health, Probe::Healthz)
}

async fn livez(State(health): State<Health>) -> impl IntoResponse {
    answer(&health, Probe::Livez)
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    answer(&health, Probe::Readyz)
}

/// Binds now (so a bad address fails start-up), serves in the background
/// under `http_limits`' bounds.
pub async fn serve(
    addr: SocketAddr,
    health: Health,
    metrics: &crate::metrics::Metrics,
) -> Result<tokio::task::JoinHandle<()>, HttpError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })?;
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route_layer(axum::middleware::from_fn_with_state(
            metrics.proxy.clone(),
            crate::metrics::kube_proxy::count_probes,
        ))
        .with_state(health);
    Ok(tokio::spawn(crate::http_limits::serve(
        listener,
        app,
        "healthz",
        metrics.http.clone(),
        std::future::pending(),
    )))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::http::StatusCode;

    use super::*;

    #[tokio::test]
    async fn the_routes_send_kube_proxys_headers() {
        let health = Health::new(Duration::from_mins(1));
        health.mark_synced();
        let response = healthz(State(health.clone())).await.into_response();
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers();
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        health.set_node_eligible(false);
        let response = livez(State(health.clone())).await.into_response();
        assert_eq!(response.status(), StatusCode::OK, "/livez ignores the node");
        let response = readyz(State(health)).await.into_response();
        assert_eq!(
            response.status(),
            StatusCode::OK,
            "/readyz ignores the node"
        );
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    }

    #[tokio::test]
    async fn readyz_is_503_until_the_first_sync_and_attachment() {
        let health = Health::new(Duration::from_mins(1));
        let response = readyz(State(health.clone())).await.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        health.mark_started();
        let response = readyz(State(health)).await.into_response();
        assert_eq!(response.status(), StatusCode::OK);
    }
}
