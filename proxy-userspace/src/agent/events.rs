//! Events on Services, posted on a task of their own (events.k8s.io/v1,
//! through kube-rs's `Recorder`), so that `kubectl describe service` tells
//! the Service's author what the address policy refused. A failure to post
//! one (an API server that refuses, RBAC without `events` `create`, an
//! outage) is logged and the Event forgotten: the sync never waits for one,
//! and the log and the metrics say the same.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::sync::{EVENT_QUEUE, ServiceEvent};

/// `reportingController` of the Events: kube-proxy's are `kube-proxy`.
pub const CONTROLLER: &str = "ebpf-proxy";

/// How long one post may take before it is given up.
const POST_TIMEOUT: Duration = Duration::from_secs(10);

/// Every this many failures one is logged as a warning (the others at
/// debug), so that an API server refusing every Event does not flood the
/// log.
const WARN_EVERY: u64 = 100;

/// Starts the task posting the Events sent to the returned sender, as
/// `node_name`'s agent.
pub fn spawn(client: Client, node_name: String) -> mpsc::Sender<ServiceEvent> {
    let (tx, mut rx) = mpsc::channel::<ServiceEvent>(EVENT_QUEUE);
    tokio::spawn(async move {
        let reporter = Reporter {
            controller: CONTROLLER.into(),
            instance: Some(node_name),
        };
        let mut failures: u64 = 0;
        while let Some(event) = rx.recv().await {
            // A recorder for each: one that remembers an Event patches its
            // series on the next of the same reason, keeping the first
            // note, which names another address.
            let recorder = Recorder::new(client.clone(), reporter.clone());
            let service = event.service.to_string();
            let posted = tokio::time::timeout(
                POST_TIMEOUT,
                recorder.publish(&kube_event(&event), &reference(&event)),
            )
            .await;
            let error = match posted {
                Ok(Ok(())) => {
                    debug!(%service, reason = event.reason, "Event posted");
                    continue;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {POST_TIMEOUT:?}"),
            };
            failures += 1;
            if failures % WARN_EVERY == 1 {
                warn!(%service, reason = event.reason, %error, failures, "Event not posted; the log and the metrics say the same");
            } else {
                debug!(%service, reason = event.reason, %error, failures, "Event not posted");
            }
        }
    });
    tx
}

fn kube_event(event: &ServiceEvent) -> Event {
    Event {
        type_: EventType::Warning,
        reason: event.reason.into(),
        note: Some(event.note.clone()),
        action: "ProgramFrontends".into(),
        secondary: None,
    }
}

fn reference(event: &ServiceEvent) -> ObjectReference {
    let namespace = if event.service.namespace.is_empty() {
        "default"
    } else {
        &event.service.namespace
    };
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        namespace: Some(namespace.into()),
        name: Some(event.service.name.clone()),
        uid: event.uid.clone(),
        ..ObjectReference::default()
    }
}
