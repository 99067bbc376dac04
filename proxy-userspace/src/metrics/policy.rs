//! What the address policy refused (docs/security.md): how many addresses
//! (and Services, for their budget) are refused now, and how many
//! refusals there have been, by reason. The sync loop reports each
//! Service's refusals as they change.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::model::Reason;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// The policy's metrics; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct PolicyMetrics {
    refused: Family<ReasonLabel, Gauge>,
    refusals: Family<ReasonLabel, Counter>,
}

impl PolicyMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "ebpf_proxy_service_addresses_refused",
            "Addresses of Services refused by the address policy (a Service refused \
             as a whole for its frontend budget counts once), by reason, now",
            self.refused.clone(),
        );
        registry.register(
            "ebpf_proxy_service_address_refusals",
            "Addresses of Services refused by the address policy (a Service refused \
             as a whole for its frontend budget counts once), by reason, since the start",
            self.refusals.clone(),
        );
        // Every reason from the start, so that a query of one finds 0
        // rather than nothing.
        for reason in Reason::ALL {
            let label = ReasonLabel {
                reason: reason.label(),
            };
            let _ = self.refused.get_or_create(&label);
            let _ = self.refusals.get_or_create(&label);
        }
    }

    /// A refusal for `reason` began.
    pub fn refused(&self, reason: Reason) {
        let label = ReasonLabel {
            reason: reason.label(),
        };
        self.refused.get_or_create(&label).inc();
        self.refusals.get_or_create(&label).inc();
    }

    /// A refusal for `reason` ended (the address became legal, or its
    /// Service changed or went).
    pub fn lifted(&self, reason: Reason) {
        self.refused
            .get_or_create(&ReasonLabel {
                reason: reason.label(),
            })
            .dec();
    }

    /// Refused now for `reason`.
    pub fn current(&self, reason: Reason) -> i64 {
        self.refused
            .get_or_create(&ReasonLabel {
                reason: reason.label(),
            })
            .get()
    }

    /// Refusals for `reason` since the start.
    pub fn total(&self, reason: Reason) -> u64 {
        self.refusals
            .get_or_create(&ReasonLabel {
                reason: reason.label(),
            })
            .get()
    }
}
