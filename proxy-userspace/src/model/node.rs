//! The node the agent runs on, as the model and the health answers read it:
//! its name and zone for topology and traffic policies, and kube-proxy's
//! rule for whether it takes traffic at all. The cluster state reads both
//! from the Node; /healthz reports the second.

use k8s_openapi::api::core::v1::Node;

/// The taint the cluster autoscaler puts on a node it is about to remove.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// What the model needs to know about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone` label of the Node, once known.
    pub zone: Option<String>,
}

/// Whether a node takes traffic, by kube-proxy's rule: not being deleted,
/// and not tainted for deletion by the cluster autoscaler.
pub fn node_eligible(node: &Node) -> bool {
    let deleting = node.metadata.deletion_timestamp.is_some();
    let tainted = node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.as_ref())
        .is_some_and(|taints| taints.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    !deleting && !tainted
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{NodeSpec, Taint},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
        jiff::Timestamp,
    };

    use super::*;

    fn node(deleting: bool, taints: &[&str]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("node-a".into()),
                deletion_timestamp: deleting.then_some(Time(Timestamp::UNIX_EPOCH)),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: Some(
                    taints
                        .iter()
                        .map(|key| Taint {
                            key: (*key).into(),
                            effect: "NoSchedule".into(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_node_being_deleted_or_tainted_for_deletion_is_not_eligible() {
        assert!(node_eligible(&node(false, &[])), "a plain node");
        assert!(
            node_eligible(&node(false, &["node.kubernetes.io/unschedulable"])),
            "other taints do not count"
        );
        assert!(
            !node_eligible(&node(false, &["a", TO_BE_DELETED_TAINT])),
            "the autoscaler's taint"
        );
        assert!(!node_eligible(&node(true, &[])), "a deletionTimestamp");
        assert!(node_eligible(&Node::default()), "no spec at all");
    }
}
