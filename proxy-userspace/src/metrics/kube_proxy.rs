//! kube-proxy's own metrics (its `pkg/proxy/metrics`), same names, types,
//! help and buckets, so that dashboards and alerts written for kube-proxy
//! read this agent unchanged.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets, linear_buckets},
    },
    registry::Registry,
};

use super::Untyped;
use crate::{
    model::{CompactService, Frontend, FrontendKind, Scope, Slice},
    source::{Kind, Object, ObjectKey, SourceEvent},
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabel {
    pub traffic_policy: &'static str,
}

/// The two health endpoints kube-proxy counts requests of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Healthz,
    Livez,
}

/// kube-proxy's metrics, and what the sync loop tells them.
#[derive(Clone, Debug)]
pub struct ProxyMetrics {
    sync_duration: Histogram,
    sync_full_duration: Histogram,
    sync_partial_duration: Histogram,
    network_programming: Histogram,
    last_sync: Gauge<f64, std::sync::atomic::AtomicU64>,
    last_queued: Gauge<f64, std::sync::atomic::AtomicU64>,
    endpoint_changes_pending: Gauge,
    endpoint_changes: Counter,
    service_changes_pending: Gauge,
    service_changes: Counter,
    no_local_endpoints: Untyped<Family<TrafficPolicyLabel, Gauge>>,
    healthz: Family<CodeLabel, Counter>,
    livez: Family<CodeLabel, Counter>,
    tracker: Arc<Mutex<Tracker>>,
}

/// What the gauges and the programming latency are computed from.
#[derive(Debug)]
struct Tracker {
    /// Changes older than this are not this agent's to time (kube-proxy
    /// times only what its tracker saw happen).
    started: SystemTime,
    pending_services: BTreeSet<ObjectKey>,
    pending_endpoints: i64,
    /// Trigger times of EndpointSlice changes not yet in the maps, by Service.
    triggers: BTreeMap<ObjectKey, Vec<SystemTime>>,
    /// The newest trigger time taken from each slice: a relisting that
    /// brings a slice back unchanged is not timed twice.
    seen: BTreeMap<ObjectKey, SystemTime>,
    /// Service ports without a local endpoint, internal and external, by Service.
    no_local: BTreeMap<ObjectKey, (i64, i64)>,
    /// The sums of `no_local`, kept as it changes: summed again for every
    /// Service synced, a first sync of many such Services would be
    /// quadratic.
    no_local_total: (i64, i64),
}

/// kube-proxy's sync duration buckets: 1 ms to about 16 s.
fn sync_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's network programming buckets: 0.25 s to 5 min.
fn programming_buckets() -> impl Iterator<Item = f64> {
    linear_buckets(0.25, 0.25, 2)
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7))
        .fold(Vec::new(), |mut merged: Vec<f64>, b| {
            if merged.last().is_none_or(|last| b > *last) {
                merged.push(b);
            }
            merged
        })
        .into_iter()
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        ProxyMetrics {
            sync_duration: Histogram::new(sync_buckets()),
            sync_full_duration: Histogram::new(sync_buckets()),
            sync_partial_duration: Histogram::new(sync_buckets()),
            network_programming: Histogram::new(programming_buckets()),
            last_sync: Gauge::default(),
            last_queued: Gauge::default(),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            no_local_endpoints: Untyped::default(),
            healthz: Family::default(),
            livez: Family::default(),
            tracker: Arc::new(Mutex::new(Tracker {
                started: SystemTime::now(),
                pending_services: BTreeSet::new(),
                pending_endpoints: 0,
                triggers: BTreeMap::new(),
                seen: BTreeMap::new(),
                no_local: BTreeMap::new(),
                no_local_total: (0, 0),
            })),
        }
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

impl ProxyMetrics {
    pub fn register(&self, registry: &mut Registry) {
        let r = registry;
        r.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            self.sync_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            self.sync_full_duration.clone(),
        );
        r.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            self.sync_partial_duration.clone(),
        );
        r.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            self.network_programming.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            self.last_sync.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            self.last_queued.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            self.endpoint_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            self.endpoint_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            self.service_changes_pending.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            self.service_changes.clone(),
        );
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            self.no_local_endpoints.clone(),
        );
        r.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            self.healthz.clone(),
        );
        r.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            self.livez.clone(),
        );
    }

    fn tracker(&self) -> MutexGuard<'_, Tracker> {
        // Plain collections: whatever a panicking holder left is usable.
        self.tracker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An event of `kind` changed `services`; a sync is queued.
    pub fn queued(&self, kind: Kind, services: &BTreeSet<ObjectKey>) {
        if services.is_empty() {
            return;
        }
        self.last_queued.set(unix_seconds(SystemTime::now()));
        let mut tracker = self.tracker();
        match kind {
            Kind::Service => {
                self.service_changes.inc_by(services.len() as u64);
                if tracker.pending_services.is_empty() {
                    // A listing's keys, copied whole rather than inserted one
                    // by one.
                    tracker.pending_services.clone_from(services);
                } else {
                    tracker.pending_services.extend(services.iter().cloned());
                }
                self.service_changes_pending
                    .set(tracker.pending_services.len() as i64);
            }
            Kind::EndpointSlice => {
                self.endpoint_changes.inc_by(services.len() as u64);
                tracker.pending_endpoints += services.len() as i64;
                self.endpoint_changes_pending.set(tracker.pending_endpoints);
            }
            Kind::Node | Kind::ServiceCidr => {}
        }
    }

    /// Notes the trigger times of slices whose Service an event changed,
    /// to be timed once that Service is programmed. Only changes made after
    /// this agent started count, and each trigger time once.
    pub fn triggered(&self, triggers: Vec<Trigger>, changed: &BTreeSet<ObjectKey>) {
        let mut tracker = self.tracker();
        for Trigger {
            service,
            slice,
            time,
        } in triggers
        {
            if !changed.contains(&service)
                || time <= tracker.started
                || tracker.seen.get(&slice).is_some_and(|seen| time <= *seen)
            {
                continue;
            }
            tracker.seen.insert(slice, time);
            tracker.triggers.entry(service).or_default().push(time);
        }
    }

    /// The Service's frontends are all in the maps: the changes that
    /// triggered them are programmed.
    pub fn programmed(&self, service: &ObjectKey) {
        self.programmed_at(service, SystemTime::now());
    }

    pub fn programmed_at(&self, service: &ObjectKey, now: SystemTime) {
        let times = self.tracker().triggers.remove(service).unwrap_or_default();
        for time in times {
            let latency = now.duration_since(time).unwrap_or_default();
            self.network_programming.observe(latency.as_secs_f64());
        }
    }

    /// A sync ran: the first (which also removes what no Service claims)
    /// is kube-proxy's full sync, the rest partial ones. `complete` when
    /// every write landed.
    pub fn synced(&self, full: bool, elapsed: Duration, complete: bool) {
        let seconds = elapsed.as_secs_f64();
        self.sync_duration.observe(seconds);
        if full {
            self.sync_full_duration.observe(seconds);
        } else {
            self.sync_partial_duration.observe(seconds);
        }
        if complete {
            self.last_sync.set(unix_seconds(SystemTime::now()));
        }
        let mut tracker = self.tracker();
        tracker.pending_services.clear();
        tracker.pending_endpoints = 0;
        self.service_changes_pending.set(0);
        self.endpoint_changes_pending.set(0);
    }

    /// The Service's ports whose Local traffic policy leaves them without
    /// an endpoint on this node, counted as kube-proxy does: per service
    /// port, internal (internalTrafficPolicy Local, its ClusterIP) and
    /// external (externalTrafficPolicy Local, its node ports and external
    /// addresses).
    pub fn local_endpoints(
        &self,
        key: &ObjectKey,
        service: Option<&CompactService>,
        desired: &[Frontend],
    ) {
        let counts = service.map_or((0, 0), |s| no_local_endpoints(s, desired));
        let mut tracker = self.tracker();
        let previous = if counts == (0, 0) {
            tracker.no_local.remove(key)
        } else {
            tracker.no_local.insert(key.clone(), counts)
        }
        .unwrap_or((0, 0));
        let total = &mut tracker.no_local_total;
        total.0 += counts.0 - previous.0;
        total.1 += counts.1 - previous.1;
        let (internal, external) = *total;
        for (policy, value) in [("internal", internal), ("external", external)] {
            self.no_local_endpoints
                .0
                .get_or_create(&TrafficPolicyLabel {
                    traffic_policy: policy,
                })
                .set(value);
        }
    }

    /// A request to /healthz or /livez was answered with `code`.
    pub fn probe(&self, probe: Probe, code: u16) {
        let family = match probe {
            Probe::Healthz => &self.healthz,
            Probe::Livez => &self.livez,
        };
        family
            .get_or_create(&CodeLabel {
                code: code.to_string(),
            })
            .inc();
    }
}

/// When the change an EndpointSlice reflects happened, by its
/// `last-change-trigger-time` annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trigger {
    pub service: ObjectKey,
    pub slice: ObjectKey,
    pub time: SystemTime,
}

impl Trigger {
    /// The event's kind and the trigger times of the slices it carries.
    pub fn of(event: &SourceEvent) -> (Kind, Vec<Trigger>) {
        let slices = |objects: &[Object]| -> Vec<Trigger> {
            objects
                .iter()
                .filter_map(|o| match o {
                    Object::EndpointSlice(slice) => Trigger::from_slice(slice),
                    _ => None,
                })
                .collect()
        };
        match event {
            SourceEvent::Replace { kind, objects } => (*kind, slices(objects)),
            SourceEvent::Apply(object) => {
                let kind = match object {
                    Object::Service(_) => Kind::Service,
                    Object::EndpointSlice(_) => Kind::EndpointSlice,
                    Object::Node(_) => Kind::Node,
                    Object::ServiceCidr(_) => Kind::ServiceCidr,
                };
                (kind, slices(std::slice::from_ref(object)))
            }
            SourceEvent::Delete { kind, .. } => (*kind, Vec::new()),
        }
    }

    /// The slice's Service, its own key and its trigger time, when it has
    /// one that parses (RFC 3339, as the controller writes it).
    pub fn from_slice(slice: &Slice) -> Option<Trigger> {
        let time = slice.trigger_time?;
        let service = slice.service.as_deref()?;
        Some(Trigger {
            slice: ObjectKey {
                namespace: slice.namespace.to_string(),
                name: slice.name.to_string(),
            },
            service: ObjectKey {
                namespace: slice.namespace.to_string(),
                name: service.to_owned(),
            },
            time,
        })
    }
}

/// (internal, external) service ports without a local endpoint.
fn no_local_endpoints(service: &CompactService, desired: &[Frontend]) -> (i64, i64) {
    let (internal_local, external_local) = service.local_policies();
    // Per service port: whether its frontends of each kind have endpoints
    // (the policy already narrowed them to local ones).
    let mut ports: BTreeMap<&crate::model::ServicePortName, (Option<bool>, Option<bool>)> =
        BTreeMap::new();
    for fe in desired.iter().filter(|fe| fe.key.scope == Scope::Any) {
        let entry = ports.entry(&fe.service).or_default();
        let has = !fe.backends.is_empty();
        let slot = match fe.kind {
            FrontendKind::ClusterIp => &mut entry.0,
            FrontendKind::NodePort | FrontendKind::ExternalIp | FrontendKind::LoadBalancer => {
                &mut entry.1
            }
        };
        *slot = Some(slot.unwrap_or(false) || has);
    }
    ports.values().fold((0, 0), |(i, e), (cluster, external)| {
        (
            i + i64::from(internal_local && *cluster == Some(false)),
            e + i64::from(external_local && *external == Some(false)),
        )
    })
}

/// Middleware of the health server: counts each answer of /healthz and
/// /livez by status code (not /readyz's).
pub async fn count_probes(
    axum::extract::State(metrics): axum::extract::State<ProxyMetrics>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    // kube-proxy has no /readyz, nor a counter for it.
    let probe = match request.uri().path() {
        "/livez" => Some(Probe::Livez),
        "/readyz" => None,
        _ => Some(Probe::Healthz),
    };
    let response = next.run(request).await;
    if let Some(probe) = probe {
        metrics.probe(probe, response.status().as_u16());
    }
    response
}

#[cfg(test)]
#[expect(
    clippy::float_cmp,
    reason = "the samples compared are counts and gauges, whole numbers that f64 holds exactly"
)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use k8s_openapi::{
        api::{
            core::v1::{Service, ServiceSpec},
            discovery::v1::EndpointSlice,
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;
    use crate::model::{
        BackendAddr, LABEL_SERVICE_NAME as SERVICE_NAME_LABEL, LAST_CHANGE_TRIGGER_TIME,
        NoEndpointAction, Protocol, ServicePortName,
    };

    /// The sample `series` of the exposition of a registry holding only
    /// `metrics`.
    fn sample(metrics: &ProxyMetrics, series: &str) -> f64 {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).expect("encode");
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    fn trigger(service: &str, slice: &str, time: SystemTime) -> Trigger {
        Trigger {
            service: key(service),
            slice: key(slice),
            time,
        }
    }

    #[test]
    fn a_trigger_time_is_timed_once_when_its_service_is_programmed() {
        let metrics = ProxyMetrics::default();
        let t = SystemTime::now() + Duration::from_millis(10);
        let changed = BTreeSet::from([key("web")]);
        let count = "kubeproxy_network_programming_duration_seconds_count";
        metrics.triggered(
            vec![
                trigger("web", "web-1", t),
                trigger("web", "web-old", t - Duration::from_hours(1)),
                trigger("other", "other-1", t),
            ],
            &changed,
        );
        metrics.programmed_at(&key("other"), t + Duration::from_secs(1));
        assert_eq!(
            sample(&metrics, count),
            0.0,
            "a slice whose Service the event did not change is not timed"
        );
        metrics.programmed_at(&key("web"), t + Duration::from_millis(1500));
        assert_eq!(
            sample(&metrics, count),
            1.0,
            "one change after the start, timed; the one from before the start not"
        );
        let bucket = |le: &str| {
            sample(
                &metrics,
                &format!("kubeproxy_network_programming_duration_seconds_bucket{{le=\"{le}\"}}"),
            )
        };
        assert_eq!((bucket("1"), bucket("2")), (0.0, 1.0), "1.5 s");

        // Relisted unchanged (after a reconnect, say): not timed again.
        metrics.triggered(vec![trigger("web", "web-1", t)], &changed);
        metrics.programmed_at(&key("web"), t + Duration::from_secs(5));
        assert_eq!(sample(&metrics, count), 1.0, "the same trigger time twice");
        let later = t + Duration::from_secs(10);
        metrics.triggered(vec![trigger("web", "web-1", later)], &changed);
        metrics.programmed_at(&key("web"), later + Duration::from_secs(70));
        assert_eq!(sample(&metrics, count), 2.0, "a newer change of the slice");
        assert_eq!((bucket("65"), bucket("70")), (1.0, 2.0), "70 s");
    }

    #[test]
    fn changes_are_pending_until_a_sync_and_counted_for_good() {
        let metrics = ProxyMetrics::default();
        metrics.queued(Kind::Service, &BTreeSet::from([key("a"), key("b")]));
        metrics.queued(Kind::Service, &BTreeSet::from([key("a")]));
        metrics.queued(Kind::EndpointSlice, &BTreeSet::from([key("a")]));
        metrics.queued(Kind::Node, &BTreeSet::from([key("a")]));
        let pending = |kind: &str| {
            sample(
                &metrics,
                &format!("kubeproxy_sync_proxy_rules_{kind}_changes_pending"),
            )
        };
        let total = |kind: &str| {
            sample(
                &metrics,
                &format!("kubeproxy_sync_proxy_rules_{kind}_changes_total"),
            )
        };
        assert_eq!(pending("service"), 2.0, "two distinct Services");
        assert_eq!(total("service"), 3.0);
        assert_eq!((pending("endpoint"), total("endpoint")), (1.0, 1.0));
        let queued = sample(
            &metrics,
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        );
        assert!(queued > 1.6e9, "last queued at {queued}");

        let last = "kubeproxy_sync_proxy_rules_last_timestamp_seconds";
        metrics.synced(true, Duration::from_millis(3), false);
        assert_eq!(
            sample(&metrics, last),
            0.0,
            "a sync with failed writes is not a successful one"
        );
        assert_eq!((pending("service"), pending("endpoint")), (0.0, 0.0));
        assert_eq!(total("service"), 3.0);
        metrics.synced(false, Duration::from_millis(20), true);
        assert!(sample(&metrics, last) >= queued);
        let count = |which: &str| {
            sample(
                &metrics,
                &format!("kubeproxy_sync_{which}proxy_rules_duration_seconds_count"),
            )
        };
        assert_eq!(
            (count(""), count("full_"), count("partial_")),
            (2.0, 1.0, 1.0)
        );
        assert_eq!(
            sample(
                &metrics,
                "kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{le=\"0.016\"}"
            ),
            0.0,
            "20 ms is above the 16 ms bucket"
        );
    }

    fn service(itp: Option<&str>, etp: Option<&str>) -> CompactService {
        CompactService::from(Service {
            metadata: ObjectMeta::default(),
            spec: Some(ServiceSpec {
                internal_traffic_policy: itp.map(Into::into),
                external_traffic_policy: etp.map(Into::into),
                ..Default::default()
            }),
            status: None,
        })
    }

    fn frontend(port: &str, kind: FrontendKind, backends: usize) -> Frontend {
        let backends = (0..backends)
            .map(|i| BackendAddr {
                local: true,
                ..BackendAddr::remote(
                    IpAddr::V4(Ipv4Addr::new(10, 0, 0, i as u8 + 1)),
                    8080,
                    Protocol::Tcp,
                )
            })
            .collect::<Vec<_>>();
        let no_endpoints = if backends.is_empty() {
            NoEndpointAction::Drop
        } else {
            NoEndpointAction::Reject
        };
        let service = ServicePortName::new("ns", "web", port, Protocol::Tcp);
        Frontend {
            kind,
            no_endpoints,
            ..Frontend::cluster_ip(
                service,
                IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1)),
                80,
                backends,
            )
        }
    }

    #[test]
    fn service_ports_without_local_endpoints_by_policy() {
        use FrontendKind::*;
        let metrics = ProxyMetrics::default();
        let gauge = |policy: &str| {
            sample(
                &metrics,
                &format!(
                    "kubeproxy_sync_proxy_rules_no_local_endpoints_total{{traffic_policy=\"{policy}\"}}"
                ),
            )
        };
        // Two ports without local endpoints, one with; internal policy Local.
        let desired = [
            frontend("a", ClusterIp, 0),
            frontend("b", ClusterIp, 0),
            frontend("c", ClusterIp, 2),
        ];
        let local = service(Some("Local"), None);
        metrics.local_endpoints(&key("web"), Some(&local), &desired);
        assert_eq!((gauge("internal"), gauge("external")), (2.0, 0.0));
        let cluster = service(None, None);
        metrics.local_endpoints(&key("other"), Some(&cluster), &desired);
        assert_eq!(gauge("internal"), 2.0, "Cluster policy: not counted");

        // externalTrafficPolicy Local: the NodePort (per port, not per frontend).
        let desired = [
            frontend("a", ClusterIp, 2),
            frontend("a", NodePort, 0),
            frontend("a", LoadBalancer, 0),
            frontend("b", ClusterIp, 2),
            frontend("b", NodePort, 1),
            // Not reachable from outside: externalTrafficPolicy does not apply.
            frontend("c", ClusterIp, 0),
        ];
        let external = service(None, Some("Local"));
        metrics.local_endpoints(&key("lb"), Some(&external), &desired);
        assert_eq!((gauge("internal"), gauge("external")), (2.0, 1.0));
        metrics.local_endpoints(&key("lb"), Some(&external), &desired);
        assert_eq!(
            (gauge("internal"), gauge("external")),
            (2.0, 1.0),
            "synced again unchanged: counted once"
        );

        metrics.local_endpoints(&key("web"), None, &[]);
        assert_eq!(
            (gauge("internal"), gauge("external")),
            (0.0, 1.0),
            "a deleted Service leaves the count"
        );
    }

    #[test]
    fn trigger_times_come_from_the_annotation_of_labelled_slices() {
        let slice = |annotation: Option<&str>, service: Option<&str>| EndpointSlice {
            metadata: ObjectMeta {
                name: Some("web-1".into()),
                namespace: Some("ns".into()),
                annotations: annotation
                    .map(|a| [(LAST_CHANGE_TRIGGER_TIME.to_owned(), a.to_owned())].into()),
                labels: service.map(|s| [(SERVICE_NAME_LABEL.to_owned(), s.to_owned())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: Vec::new(),
            ports: None,
        };
        let found = Trigger::from_slice(&Slice::from(slice(
            Some("2026-01-02T03:04:05.5Z"),
            Some("web"),
        )))
        .expect("a trigger time");
        assert_eq!(found.service, key("web"));
        assert_eq!(found.slice, key("web-1"));
        assert_eq!(
            found.time.duration_since(UNIX_EPOCH).expect("after 1970"),
            Duration::from_millis(1_767_323_045_500)
        );
        assert_eq!(
            Trigger::from_slice(&Slice::from(slice(None, Some("web")))),
            None
        );
        assert_eq!(
            Trigger::from_slice(&Slice::from(slice(Some("yesterday"), Some("web")))),
            None
        );
        assert_eq!(
            Trigger::from_slice(&Slice::from(slice(Some("2026-01-02T03:04:05Z"), None))),
            None,
            "a slice of no Service"
        );
    }
}
