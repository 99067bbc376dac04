//! `--bpf-root` refused when the pins there could be replaced by someone
//! else: a root writable by its group or by others, or owned by another
//! user; an agent on such a root exits at start naming the path and the
//! fault, and one on a root of its own serves (docs/security.md,
//! "Privileges and pins").
//!
//! Needs root (namespaces, BPF, chown) and the release binary (`cargo xtask build`).

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use ebpf_proxy_tests::{
    agent::Agent,
    manifest::ManifestDir,
    require_root,
    topology::{Topology, one_node::CLIENT},
};

/// A directory under the bpffs mount, removed on drop.
struct Root(PathBuf);

impl Root {
    fn new(mode: u32, owner: Option<u32>) -> Root {
        let path = Agent::unique_bpf_root();
        std::fs::create_dir(&path).expect("create the root");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        if let Some(uid) = owner {
            std::os::unix::fs::chown(&path, Some(uid), None).expect("chown");
        }
        Root(path)
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start(topology: &Topology, manifests: &Path, root: &Root) -> Result<Agent, String> {
    Agent::start_on_root(&topology.node, manifests, &[], root.0.clone())
        .map_err(|e| format!("{e:#}"))
}

#[test]
fn a_root_others_could_write_is_refused_naming_it() {
    require_root().expect("privileged test");
    let topology = Topology::routed(&[CLIENT]).expect("topology");
    let manifests = ManifestDir::create(topology.stem()).expect("manifest directory");
    for (mode, owner, fault) in [
        (
            0o777,
            None,
            "is writable by its group and others (mode 0777)",
        ),
        (0o775, None, "is writable by its group (mode 0775)"),
        (0o757, None, "is writable by others (mode 0757)"),
        (0o755, Some(65534), "is owned by uid 65534, not root"),
    ] {
        let root = Root::new(mode, owner);
        let err = match start(&topology, manifests.path(), &root) {
            Ok(agent) => panic!(
                "the agent started on {} (mode {mode:o}, owner {owner:?}); its log:\n{}",
                root.0.display(),
                agent.log()
            ),
            Err(e) => e,
        };
        assert!(
            err.contains("exited")
                && err.contains(&format!("refusing --bpf-root {}", root.0.display()))
                && err.contains(&format!("{} {fault}", root.0.display())),
            "mode {mode:o}, owner {owner:?}: the agent exits naming {} and {fault:?}; got: {err}",
            root.0.display()
        );
    }
}

#[test]
fn a_root_of_its_own_is_taken() {
    require_root().expect("privileged test");
    let topology = Topology::routed(&[CLIENT]).expect("topology");
    let manifests = ManifestDir::create(topology.stem()).expect("manifest directory");
    let root = Root::new(0o755, None);
    let mut agent = start(&topology, manifests.path(), &root)
        .unwrap_or_else(|e| panic!("the agent on a 0755 root-owned root: {e}"));
    agent.terminate().expect("stopped");
}
