//! client-go's API client metrics (`rest_client_requests_total`,
//! `rest_client_request_duration_seconds`), measured by a layer in the
//! kube-rs client's service stack: every request the agent makes to the
//! API server, list, watch or other, counted by its answer's status code
//! and timed until the answer's headers, as client-go times them.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use kube::Client;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};
use tower_layer::Layer;
use tower_service::Service;

use crate::source::kube::{KubeSourceError, config};

/// client-go's latency buckets, 5 ms to a minute.
const DURATION_BUCKETS: [f64; 12] = [
    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
];

/// What client-go reports for a request that got no answer.
pub const NO_ANSWER: &str = "<error>";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub code: String,
    pub method: String,
    pub host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DurationLabels {
    pub verb: String,
    pub host: String,
}

type DurationFamily = Family<DurationLabels, Histogram, fn() -> Histogram>;

#[derive(Clone, Debug)]
pub struct RestClientMetrics {
    requests: Family<RequestLabels, Counter>,
    duration: DurationFamily,
}

impl Default for RestClientMetrics {
    fn default() -> Self {
        RestClientMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS)),
        }
    }
}

impl RestClientMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host",
            self.requests.clone(),
        );
        registry.register(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host",
            self.duration.clone(),
        );
    }

    /// The API client of `source::kube::client`, with every request
    /// counted and timed here (labelled with the server's `host:port`): the
    /// measuring is these metrics' concern, the client the source's.
    pub async fn client(
        &self,
        kubeconfig: Option<std::path::PathBuf>,
        master: Option<String>,
    ) -> Result<Client, KubeSourceError> {
        let config = config(kubeconfig, master).await?;
        let server = config.cluster_url.to_string();
        let host = config
            .cluster_url
            .authority()
            .map(ToString::to_string)
            .unwrap_or_default();
        let builder = kube::client::ClientBuilder::try_from(config)
            .map_err(|source| KubeSourceError::Client { server, source })?;
        Ok(builder.with_layer(&self.layer(host)).build())
    }

    /// The layer that measures requests to `host` (the API server's
    /// `host:port`, client-go's `host` label).
    pub fn layer(&self, host: impl Into<String>) -> MeasureLayer {
        MeasureLayer {
            metrics: self.clone(),
            host: host.into().into(),
        }
    }

    fn record(&self, method: &str, host: &str, code: String, seconds: f64) {
        self.requests
            .get_or_create(&RequestLabels {
                code,
                method: method.to_owned(),
                host: host.to_owned(),
            })
            .inc();
        self.duration
            .get_or_create(&DurationLabels {
                verb: method.to_owned(),
                host: host.to_owned(),
            })
            .observe(seconds);
    }

    /// Requests so far with this status code and method.
    #[cfg(test)]
    pub fn requests(&self, code: &str, method: &str, host: &str) -> u64 {
        self.requests
            .get(&RequestLabels {
                code: code.to_owned(),
                method: method.to_owned(),
                host: host.to_owned(),
            })
            .map_or(0, |c| c.get())
    }
}

#[derive(Clone, Debug)]
pub struct MeasureLayer {
    metrics: RestClientMetrics,
    host: Arc<str>,
}

impl<S> Layer<S> for MeasureLayer {
    type Service = Measure<S>;

    fn layer(&self, inner: S) -> Measure<S> {
        Measure {
            inner,
            metrics: self.metrics.clone(),
            host: Arc::clone(&self.host),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Measure<S> {
    inner: S,
    metrics: RestClientMetrics,
    host: Arc<str>,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for Measure<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let method = request.method().as_str().to_owned();
        let started = Instant::now();
        let answer = self.inner.call(request);
        let metrics = self.metrics.clone();
        let host = Arc::clone(&self.host);
        Box::pin(async move {
            let result = answer.await;
            let code = match &result {
                Ok(response) => response.status().as_u16().to_string(),
                Err(_) => NO_ANSWER.to_owned(),
            };
            metrics.record(&method, &host, code, started.elapsed().as_secs_f64());
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use std::future::Ready;

    use super::*;

    /// An API server that answers `status`, or fails to answer at all.
    struct Answer(Option<u16>);

    impl Service<http::Request<()>> for Answer {
        type Response = http::Response<()>;
        type Error = &'static str;
        type Future = Ready<Result<http::Response<()>, &'static str>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: http::Request<()>) -> Self::Future {
            std::future::ready(match self.0 {
                Some(status) => Ok(http::Response::builder()
                    .status(status)
                    .body(())
                    .expect("a response")),
                None => Err("connection refused"),
            })
        }
    }

    #[tokio::test]
    async fn requests_are_counted_by_code_method_and_host() {
        let metrics = RestClientMetrics::default();
        let host = "10.0.0.1:6443";
        let layer = metrics.layer(host);
        let request = |method: &str| {
            http::Request::builder()
                .method(method)
                .uri("/api/v1/services")
                .body(())
                .expect("a request")
        };
        let mut ok = layer.layer(Answer(Some(200)));
        for _ in 0..3 {
            ok.call(request("GET")).await.expect("answered");
        }
        let mut gone = layer.layer(Answer(Some(410)));
        gone.call(request("GET")).await.expect("answered");
        let mut down = layer.layer(Answer(None));
        assert!(
            down.call(request("POST")).await.is_err(),
            "the error passes through"
        );

        assert_eq!(metrics.requests("200", "GET", host), 3);
        assert_eq!(metrics.requests("410", "GET", host), 1);
        assert_eq!(metrics.requests(NO_ANSWER, "POST", host), 1);
        assert_eq!(metrics.requests("200", "GET", "elsewhere:443"), 0);
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).expect("encode");
        let timed = |verb: &str| {
            let series = format!(
                "rest_client_request_duration_seconds_count{{verb=\"{verb}\",host=\"{host}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(&series)?.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
        };
        assert_eq!((timed("GET"), timed("POST")), (4, 1), "every request timed");
    }
}
