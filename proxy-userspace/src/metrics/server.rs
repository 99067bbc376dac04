//! The metrics listener: `GET /metrics` on `--metrics-bind-address`, a
//! listener of its own as kube-proxy's metrics port is, so that a scrape
//! never competes with the health probes.

use std::net::{IpAddr, SocketAddr};

use axum::{Router, extract::State, response::IntoResponse, routing::get};
use prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

use super::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("binding the metrics server to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// kube-proxy's default `--metrics-bind-address` port.
pub const DEFAULT_PORT: u16 = 10249;

/// `--metrics-bind-address`: `IP:port`, or an IP alone (port 10249), as
/// kube-proxy takes it. An empty value, `0` or port 0 turn the server off,
/// as an empty address and a zero `metricsBindPort` do for kube-proxy.
pub fn parse_bind_address(s: &str) -> Result<Option<SocketAddr>, String> {
    let s = s.trim();
    if s.is_empty() || s == "0" {
        return Ok(None);
    }
    let addr = match s.parse::<SocketAddr>() {
        Ok(addr) => addr,
        Err(_) => match s
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(ip) => SocketAddr::new(ip, DEFAULT_PORT),
            Err(_) => {
                return Err(format!(
                    "{s:?} is not an address to listen on (like 0.0.0.0:10249, [::]:10249 or 127.0.0.1; empty or 0 turns metrics off)"
                ));
            }
        },
    };
    Ok((addr.port() != 0).then_some(addr))
}

async fn metrics(State(metrics): State<Metrics>) -> impl IntoResponse {
    let body = metrics.snapshot().await;
    ([("content-type", CONTENT_TYPE)], body.to_string())
}

/// Binds now (so a bad or taken address fails start-up), serves in the
/// background under `http_limits`' bounds.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
) -> Result<tokio::task::JoinHandle<()>, MetricsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let http = metrics.http.clone();
    let app = Router::new()
        .route("/metrics", get(self::metrics))
        .with_state(metrics);
    Ok(tokio::spawn(crate::http_limits::serve(
        listener,
        app,
        "metrics",
        http,
        std::future::pending(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses_as_kube_proxy_takes_them() {
        let some = |s: &str| Ok(Some(s.parse::<SocketAddr>().expect("test address")));
        assert_eq!(
            parse_bind_address("127.0.0.1:10249"),
            some("127.0.0.1:10249")
        );
        assert_eq!(parse_bind_address("0.0.0.0:9000"), some("0.0.0.0:9000"));
        assert_eq!(parse_bind_address("[::]:10249"), some("[::]:10249"));
        assert_eq!(
            parse_bind_address("10.0.0.1"),
            some("10.0.0.1:10249"),
            "an IP alone"
        );
        assert_eq!(parse_bind_address("::1"), some("[::1]:10249"));
        for off in ["", " ", "0", "0.0.0.0:0"] {
            assert_eq!(
                parse_bind_address(off),
                Ok(None),
                "{off:?} turns metrics off"
            );
        }
        for bad in [
            "localhost:10249",
            "1.2.3.4:99999",
            "10249",
            "1.2.3:80",
            ":10249",
        ] {
            let err = parse_bind_address(bad).expect_err(bad);
            assert!(err.contains(bad.trim()), "{bad:?}: {err}");
        }
    }
}
