//! What the address policy refused of each Service, reported as it
//! changes: a warning in the log, an Event on the Service, the metrics. A
//! refusal is reported once, when it begins (and its end once, in the log),
//! however many syncs see it: a Service refused on every sync would
//! otherwise flood the log and the API server.

use std::collections::HashMap;

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::{
    metrics::PolicyMetrics,
    model::{Reason, Refusal},
    source::ObjectKey,
};

/// An Event to post on a Service, for the task that posts them
/// (`agent::events`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceEvent {
    pub service: ObjectKey,
    pub uid: Option<String>,
    /// `reason`, in the API's `PascalCase`.
    pub reason: &'static str,
    /// `note`: what was refused and why.
    pub note: String,
}

/// Events waiting to be posted: past this many the newest are dropped (and
/// logged) rather than kept, so that a slow or failing API server costs
/// the sync nothing.
pub const EVENT_QUEUE: usize = 256;

/// Each Service's refusals as last reported.
#[derive(Debug, Default)]
pub(super) struct Refusals {
    by_service: HashMap<ObjectKey, Vec<Refusal>>,
    metrics: PolicyMetrics,
    events: Option<mpsc::Sender<ServiceEvent>>,
}

impl Refusals {
    pub fn set_metrics(&mut self, metrics: PolicyMetrics) {
        self.metrics = metrics;
    }

    pub fn set_events(&mut self, events: mpsc::Sender<ServiceEvent>) {
        self.events = Some(events);
    }

    /// `key`'s refusals are `now` (none once it is gone): those that began
    /// are reported, those that ended are logged. Returns how many began.
    pub fn report(&mut self, key: &ObjectKey, uid: Option<&str>, now: Vec<Refusal>) -> usize {
        let before = if now.is_empty() {
            self.by_service.remove(key).unwrap_or_default()
        } else {
            self.by_service.insert(key.clone(), now).unwrap_or_default()
        };
        let now = self.by_service.get(key).map_or(&[][..], Vec::as_slice);
        let mut began = 0;
        for refusal in now.iter().filter(|r| !before.contains(r)) {
            began += 1;
            let rest = if refusal.reason == Reason::Budget {
                "none of its frontends is programmed"
            } else {
                "the Service's other addresses are served"
            };
            warn!(
                service = %key,
                reason = refusal.reason.label(),
                "refused {refusal} ({rest})"
            );
            self.metrics.refused(refusal.reason);
            self.post(key, uid, refusal);
        }
        for refusal in before.iter().filter(|r| !now.contains(r)) {
            info!(service = %key, reason = refusal.reason.label(), "no longer refused: {refusal}");
            self.metrics.lifted(refusal.reason);
        }
        began
    }

    fn post(&self, key: &ObjectKey, uid: Option<&str>, refusal: &Refusal) {
        let Some(events) = &self.events else {
            return;
        };
        let event = ServiceEvent {
            service: key.clone(),
            uid: uid.map(str::to_owned),
            reason: refusal.reason.event_reason(),
            note: note(refusal),
        };
        if let Err(e) = events.try_send(event) {
            debug!(service = %key, error = %e, "Event not queued; the log and the metrics have it");
        }
    }

    /// Refused now, by reason (the tests').
    #[cfg(test)]
    pub fn count(&self, reason: Reason) -> usize {
        self.by_service
            .values()
            .flatten()
            .filter(|r| r.reason == reason)
            .count()
    }
}

/// An Event's note: at most 1 kB, as the API allows.
fn note(refusal: &Refusal) -> String {
    let mut note = match refusal.reason {
        Reason::Budget => format!("Not programmed: {refusal}"),
        _ => format!("Not programmed: {refusal}; the Service's other addresses are served"),
    };
    if note.len() > 1024 {
        let mut end = 1021;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push_str("...");
    }
    note
}
