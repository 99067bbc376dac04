//! What the address policy refused of each Service, reported as it
//! changes: a warning in the log, an Event on the Service, the metrics. A
//! refusal is reported once, when it begins (and its end once, in the log),
//! however many syncs see it: a Service refused on every sync would
//! otherwise flood the log and the API server. What is refused now, and
//! the Services the model cannot program at all, are also kept in the
//! pinned `SERVICE_REFUSALS` map for `ebpf-proxy status`; a record that
//! could not be written is tried again at the next report.

use std::collections::{BTreeSet, HashMap};

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::{
    datapath::refusal_records::RefusalRecords,
    metrics::PolicyMetrics,
    model::{ModelError, Reason, Refusal},
    planner::encode,
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
    /// Services the model cannot program, with why.
    invalid: HashMap<ObjectKey, String>,
    metrics: PolicyMetrics,
    events: Option<mpsc::Sender<ServiceEvent>>,
    records: Option<RefusalRecords>,
    /// How many records each Service has in `records`.
    recorded: HashMap<ObjectKey, usize>,
    /// Services whose records could not be written: tried again.
    unrecorded: BTreeSet<ObjectKey>,
}

impl Refusals {
    /// Keeps what is refused in `records` from now on; an earlier agent's
    /// records are forgotten.
    pub fn set_records(&mut self, mut records: RefusalRecords) {
        if let Err(e) = records.clear() {
            warn!(error = %e, "the last agent's refusals are left in `ebpf-proxy status`");
        }
        self.recorded.clear();
        self.unrecorded = self
            .by_service
            .keys()
            .chain(self.invalid.keys())
            .cloned()
            .collect();
        self.records = Some(records);
        self.record_unrecorded();
    }

    /// `key` is a Service the model cannot program, for `error`.
    pub fn invalid(&mut self, key: &ObjectKey, error: &ModelError) {
        let text = match error {
            ModelError::InvalidService { reason, .. } | ModelError::InvalidSlice { reason, .. } => {
                reason.clone()
            }
        };
        if self.invalid.get(key) != Some(&text) {
            self.invalid.insert(key.clone(), text);
            self.unrecorded.insert(key.clone());
        }
        self.record_unrecorded();
    }

    /// Writes the records of the Services in `unrecorded`; those that fail
    /// stay there.
    fn record_unrecorded(&mut self) {
        let Some(records) = &mut self.records else {
            return;
        };
        let mut failed = BTreeSet::new();
        for key in std::mem::take(&mut self.unrecorded) {
            let now: Vec<(&str, String)> = match self.invalid.get(&key) {
                Some(why) => vec![("invalid", why.clone())],
                None => self
                    .by_service
                    .get(&key)
                    .map(|refusals| {
                        refusals
                            .iter()
                            .map(|r| (r.reason.label(), r.to_string()))
                            .collect()
                    })
                    .unwrap_or_default(),
            };
            let before = self.recorded.get(&key).copied().unwrap_or(0);
            match records.write(&key.namespace, &key.name, &now, before) {
                Ok(()) if now.is_empty() => {
                    self.recorded.remove(&key);
                }
                Ok(()) => {
                    self.recorded.insert(key, now.len());
                }
                Err(e) => {
                    if failed.is_empty() {
                        warn!(service = %key, error = %e, "refusal not in `ebpf-proxy status`; tried again at the next sync");
                    }
                    // What was written of it is there to be overwritten.
                    self.recorded.insert(key.clone(), before.max(now.len()));
                    failed.insert(key);
                }
            }
        }
        self.unrecorded = failed;
    }
    pub fn set_metrics(&mut self, metrics: PolicyMetrics) {
        self.metrics = metrics;
    }

    pub fn set_events(&mut self, events: mpsc::Sender<ServiceEvent>) {
        self.events = Some(events);
    }

    /// `key`'s refusals are `now` (none once it is gone): those that began
    /// are reported, those that ended are logged. Returns how many began.
    pub fn report(&mut self, key: &ObjectKey, uid: Option<&str>, now: Vec<Refusal>) -> usize {
        let was_invalid = self.invalid.remove(key).is_some();
        let began = self.report_refusals(key, uid, now, was_invalid);
        self.record_unrecorded();
        began
    }

    fn report_refusals(
        &mut self,
        key: &ObjectKey,
        uid: Option<&str>,
        now: Vec<Refusal>,
        was_invalid: bool,
    ) -> usize {
        if was_invalid
            || self
                .by_service
                .get(key)
                .map_or(!now.is_empty(), |b| *b != now)
        {
            self.unrecorded.insert(key.clone());
        }
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
    let note = match refusal.reason {
        Reason::Budget => format!("Not programmed: {refusal}"),
        _ => format!("Not programmed: {refusal}; the Service's other addresses are served"),
    };
    encode::ellipsized(&note, 1024).into_owned()
}
