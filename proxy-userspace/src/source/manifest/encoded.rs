//! A file's last good objects kept as JSON between scans: the agent's
//! state already holds them decoded, so the reader keeps the smaller form.

use tracing::error;

use super::events::Manifests;
use crate::source::Kind;

/// A file's last good objects, each kept as its JSON encoding: a fraction
/// of the memory of the decoded objects, which the agent's state already
/// holds once. They are decoded only to send a listing of their kind after
/// some file's objects of that kind changed.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Encoded {
    pub(super) services: Vec<Box<[u8]>>,
    pub(super) endpoint_slices: Vec<Box<[u8]>>,
    pub(super) nodes: Vec<Box<[u8]>>,
}

impl Encoded {
    pub(super) fn of(manifests: &Manifests) -> Encoded {
        Encoded {
            services: encode_all(&manifests.services),
            endpoint_slices: encode_all(&manifests.endpoint_slices),
            nodes: encode_all(&manifests.nodes),
        }
    }

    /// The kinds whose objects differ between `self` and `other` (the
    /// encoding of a decoded object is canonical: maps are ordered).
    pub(super) fn kinds_differing(&self, other: &Encoded) -> Vec<Kind> {
        let mut kinds = Vec::new();
        if self.services != other.services {
            kinds.push(Kind::Service);
        }
        if self.endpoint_slices != other.endpoint_slices {
            kinds.push(Kind::EndpointSlice);
        }
        if self.nodes != other.nodes {
            kinds.push(Kind::Node);
        }
        kinds
    }
}

fn encode_all<T: serde::Serialize>(objects: &[T]) -> Vec<Box<[u8]>> {
    objects
        .iter()
        .filter_map(|object| match serde_json::to_vec(object) {
            Ok(json) => Some(json.into_boxed_slice()),
            // Only a map with keys that are not strings fails, and the
            // Kubernetes types have none.
            Err(e) => {
                error!(error = %e, "manifest object not kept");
                None
            }
        })
        .collect()
}

pub(super) fn decode<T: serde::de::DeserializeOwned>(json: &[u8]) -> Option<T> {
    match serde_json::from_slice(json) {
        Ok(object) => Some(object),
        // What `encode_all` wrote decodes: the same types both ways.
        Err(e) => {
            error!(error = %e, "manifest object not decoded");
            None
        }
    }
}
