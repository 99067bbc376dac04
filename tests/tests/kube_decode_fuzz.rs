//! The Kubernetes API source on mutated objects, served by the fake API
//! server (tests/apiserver/) through the real list/watch protocol and the
//! real kube-rs client: each object is either delivered, and then modelled
//! without a panic and with errors naming it, or skipped with an error that
//! names it; the source keeps going. No BPF and no root.

use ebpf_proxy_apiserver as apiserver;
// Shared with proxy-userspace's manifest test, which also uses its Node.
#[expect(
    dead_code,
    reason = "the module is shared with proxy-userspace's manifest test, which alone uses its Node mutations"
)]
#[path = "../../proxy-userspace/tests/object_mutation/mod.rs"]
mod object_mutation;

use std::time::Duration;

use apiserver::{ApiServer, Logs};
use ebpf_proxy_tests::fuzz::Rng;
use proxy_userspace::{
    model::{ModelConfig, ModelError, NodeInfo},
    source::{Object, SourceEvent, kube as kube_source},
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::instrument::WithSubscriber;

const NODE: &str = "node-a";
const PROMPT: Duration = Duration::from_secs(10);
/// Objects of each kind served.
const OBJECTS: usize = 150;

/// `template` mutated one to four times, with the name, namespace and kind
/// the fake server files it under.
fn mutated(template: Value, name: &str, rng: &mut Rng) -> Value {
    let mut object = template;
    for _ in 0..=rng.below(4) {
        let (place, op, pick) = (rng.next_u64(), rng.byte(), rng.next_u64());
        object_mutation::mutate(&mut object, place, op, pick);
    }
    let kind = if name.starts_with("svc") {
        "Service"
    } else {
        "EndpointSlice"
    };
    if !object.is_object() {
        object = json!({});
    }
    if !object["metadata"].is_object() {
        object["metadata"] = json!({});
    }
    object["kind"] = json!(kind);
    object["metadata"]["name"] = json!(name);
    object["metadata"]["namespace"] = json!("demo");
    // A slice belongs to the Service of its number, where it still says.
    let service = name.replace("slice", "svc");
    if let Some(label) = object["metadata"]["labels"].get_mut("kubernetes.io/service-name") {
        *label = json!(service);
    }
    object
}

/// A good object of the same kind: each kind has its own watch, so only
/// one of the same kind arrives after the mutated one.
fn marker(kind: &str, name: &str) -> Value {
    if kind == "Service" {
        apiserver::service("demo", name, "10.96.0.99")
    } else {
        apiserver::slice("demo", name, "marked", NODE, &["10.0.0.99"])
    }
}

#[tokio::test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the API server it sets up"
)]
async fn mutated_api_objects_are_delivered_or_skipped_by_name() {
    let seed = std::env::var("EBPF_PROXY_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let mut rng = Rng::new(seed);
    let server = ApiServer::start().await;
    server.apply(apiserver::node(NODE, Some("z1")));
    let client = kube_source::client(None, Some(server.url().to_owned()))
        .await
        .expect("a kube client");
    let logs = Logs::default();
    let (tx, mut rx) = mpsc::channel(4096);
    let task = tokio::spawn(
        kube_source::watch(client, NODE.to_owned(), tx).with_subscriber(logs.subscriber()),
    );
    // Services, EndpointSlices, the Node and ServiceCIDRs.
    for _ in 0..4 {
        tokio::time::timeout(PROMPT, rx.recv())
            .await
            .expect("the initial listings")
            .expect("the source runs");
    }

    let node = NodeInfo {
        name: NODE.into(),
        zone: Some("z1".into()),
    };
    let config = ModelConfig::default();
    let (mut delivered, mut skipped, mut frontends, mut model_errors) = (0, 0, 0, 0);
    let mut slices = Vec::new();
    for i in 0..2 * OBJECTS {
        // A slice, then the Service it belongs to.
        let (name, template) = if i % 2 == 0 {
            (format!("slice-{}", i / 2), object_mutation::slice())
        } else {
            (format!("svc-{}", i / 2), object_mutation::service())
        };
        let object = mutated(template, &name, &mut rng);
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        server.apply(object.clone());
        // A good object after it: once that arrives, the mutated one has
        // been delivered or skipped.
        let mark = format!("mark-{i}");
        server.apply(marker(&kind, &mark));
        let mut got = None;
        loop {
            let event = tokio::time::timeout(PROMPT, rx.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "seed {seed}: nothing after {kind} demo/{name}: {object}\nlog:\n{}",
                        logs.text()
                    )
                })
                .unwrap_or_else(|| panic!("seed {seed}: the source stopped\n{}", logs.text()));
            match event {
                SourceEvent::Apply(Object::Service(s)) if s.name() == Some(mark.as_str()) => {
                    break;
                }
                SourceEvent::Apply(Object::EndpointSlice(s)) if *s.name == *mark => {
                    break;
                }
                SourceEvent::Apply(o) => got = Some(o),
                other => panic!("seed {seed}: unexpected event {other:?}"),
            }
        }
        let named = format!("{kind} demo/{name}: ");
        match got {
            None => {
                // The error is logged before the marker is received.
                assert!(
                    logs.text().contains(&named),
                    "seed {seed}: {kind} demo/{name} was neither delivered nor named in an error: \
                     {object}\nlog:\n{}",
                    logs.text()
                );
                skipped += 1;
            }
            Some(Object::EndpointSlice(s)) => {
                slices.push(*s);
                delivered += 1;
            }
            Some(Object::Service(s)) => {
                delivered += 1;
                let refs: Vec<_> = slices.iter().collect();
                let modelled = std::panic::catch_unwind(|| {
                    (
                        s.frontends(&refs, &node, &config),
                        s.health_check(&refs, &node, &config),
                    )
                })
                .unwrap_or_else(|_| panic!("seed {seed}: the model panicked on {object}"));
                frontends += modelled.0.as_ref().map_or(0, Vec::len);
                for e in [modelled.0.err(), modelled.1.err()].into_iter().flatten() {
                    model_errors += 1;
                    let names_it = match &e {
                        ModelError::InvalidService { service, .. } => {
                            *service == format!("demo/{name}")
                        }
                        ModelError::InvalidSlice { slice, .. } => {
                            slices.iter().any(|s| *slice == format!("demo/{}", s.name))
                        }
                    };
                    assert!(names_it, "seed {seed}: {e} does not name its object");
                }
            }
            Some(other) => panic!("seed {seed}: {other:?} delivered for {kind} demo/{name}"),
        }
    }
    eprintln!(
        "seed {seed}: {} mutated objects: {delivered} delivered, {skipped} skipped by name; \
         the Services made {frontends} frontends and {model_errors} model errors",
        2 * OBJECTS
    );
    assert!(!task.is_finished(), "the source stopped:\n{}", logs.text());
    assert!(
        delivered > OBJECTS / 2 && skipped > OBJECTS / 10 && model_errors > 0,
        "seed {seed}: the mutations did not reach every outcome"
    );
    drop(rx);
    let _ = tokio::time::timeout(PROMPT, task).await;
}
