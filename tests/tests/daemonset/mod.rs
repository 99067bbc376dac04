//! deploy/daemonset.yaml as the tests read it: the agent's container, typed by
//! k8s-openapi, so that a test runs the agent the way the manifest says.

use std::path::PathBuf;

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};

pub fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml")
}

pub fn load() -> DaemonSet {
    let path = path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_yaml::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not a DaemonSet: {e}", path.display()))
}

/// The `ebpf-proxy` container of the DaemonSet's pod template.
pub fn container(ds: &DaemonSet) -> &Container {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.iter().find(|c| c.name == "ebpf-proxy"))
        .unwrap_or_else(|| panic!("{} has no container ebpf-proxy", path().display()))
}

/// The capabilities the container is granted, as the manifest spells them
/// (`BPF`); panics unless it drops ALL first, as the tests assume.
pub fn added_capabilities(container: &Container) -> Vec<String> {
    let caps = container
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .unwrap_or_else(|| panic!("{}: no securityContext.capabilities", path().display()));
    assert_eq!(
        caps.drop.as_deref(),
        Some(&["ALL".to_owned()][..]),
        "{}: capabilities.drop is not [ALL]",
        path().display()
    );
    let added = caps.add.clone().unwrap_or_default();
    assert!(
        !added.is_empty(),
        "{}: capabilities.add is empty",
        path().display()
    );
    added
}
