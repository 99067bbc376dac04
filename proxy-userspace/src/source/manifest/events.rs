//! The objects read from manifests, and the listings they are sent as:
//! a manifest tree has no watch history, so every change is a `Replace` of
//! the kinds it touched.

use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};

use crate::source::{Kind, Object, SourceEvent};

pub(super) const ALL_KINDS: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

/// Objects read from manifests, each kind in file order (files by path).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Manifests {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
}

impl Manifests {
    /// One `Replace` per kind: together a complete listing.
    pub fn into_events(self) -> Vec<SourceEvent> {
        self.into_events_of(&ALL_KINDS)
    }

    /// A `Replace` of each of `kinds` (in the order Service, EndpointSlice,
    /// Node), the objects moved into them rather than copied.
    pub fn into_events_of(self, kinds: &[Kind]) -> Vec<SourceEvent> {
        let Manifests {
            services,
            endpoint_slices,
            nodes,
        } = self;
        let mut events = Vec::new();
        if kinds.contains(&Kind::Service) {
            events.push(SourceEvent::Replace {
                kind: Kind::Service,
                objects: services.iter().map(Object::service).collect(),
            });
        }
        if kinds.contains(&Kind::EndpointSlice) {
            events.push(SourceEvent::Replace {
                kind: Kind::EndpointSlice,
                objects: endpoint_slices
                    .into_iter()
                    .map(|s| Object::slice(&s))
                    .collect(),
            });
        }
        if kinds.contains(&Kind::Node) {
            events.push(SourceEvent::Replace {
                kind: Kind::Node,
                objects: nodes
                    .into_iter()
                    .map(|n| Object::Node(Box::new(n)))
                    .collect(),
            });
        }
        events
    }

    /// A `Replace` for each kind whose objects differ from `sent` (every
    /// kind when nothing was sent yet): listing an unchanged kind again
    /// would only make the consumer compare it.
    pub fn events_since(&self, sent: Option<&Manifests>) -> Vec<SourceEvent> {
        let mut events = Vec::new();
        if sent.is_none_or(|s| s.services != self.services) {
            events.push(SourceEvent::Replace {
                kind: Kind::Service,
                objects: self.services.iter().map(Object::service).collect(),
            });
        }
        if sent.is_none_or(|s| s.endpoint_slices != self.endpoint_slices) {
            events.push(SourceEvent::Replace {
                kind: Kind::EndpointSlice,
                objects: self.endpoint_slices.iter().map(Object::slice).collect(),
            });
        }
        if sent.is_none_or(|s| s.nodes != self.nodes) {
            events.push(SourceEvent::Replace {
                kind: Kind::Node,
                objects: self
                    .nodes
                    .iter()
                    .map(|n| Object::Node(Box::new(n.clone())))
                    .collect(),
            });
        }
        events
    }
}
