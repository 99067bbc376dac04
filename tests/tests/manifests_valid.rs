//! Every manifest in deploy/ (examples included) against the Kubernetes API's
//! schemas, offline, with `kubernetes-validate --strict` (an unknown field is
//! an error, as `kubectl apply --validate=strict` makes it), the migration's
//! patch as applied to kubeadm's kube-proxy DaemonSet; the example
//! `kube-proxy` ConfigMap against what the agent and the DaemonSet expect of
//! it; and the DaemonSet and the patch against what the kubelet and the
//! per-node rollout need of them (docs/operations.md, "Deploying"). Needs
//! `cargo xtask setup` (which installs the validator), not root.

mod daemonset;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use ebpf_proxy_tests::manifest_check::KUBERNETES_VALIDATE;
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{Container, NodeSelectorRequirement, PodSpec, Probe},
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use serde_yaml::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every YAML file below `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            out.extend(yaml_files(&path));
        } else if path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml")
        {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// A patch (`*-patch.yaml`) is part of an object, validated once applied
/// (`the_kube_proxy_patch_makes_a_valid_kubeadm_daemonset`).
fn is_patch(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().ends_with("-patch.yaml"))
}

/// Every manifest below `dir`: the YAML files that are whole objects.
fn manifests(dir: &Path) -> Vec<PathBuf> {
    yaml_files(dir)
        .into_iter()
        .filter(|p| !is_patch(p))
        .collect()
}

/// The validator's verdict on `path`: its complaint when it refuses it.
fn validate(path: &Path) -> Result<(), String> {
    let output = Command::new(KUBERNETES_VALIDATE)
        .args(["--strict", "--quiet"])
        .arg(path)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {KUBERNETES_VALIDATE} ({e}): `cargo xtask setup` installs it")
        });
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

#[test]
fn every_manifest_in_deploy_is_valid_for_the_api() {
    let files = manifests(&deploy_dir());
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for expected in ["daemonset.yaml", "rbac.yaml", "kube-proxy-configmap.yaml"] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} not found among {names:?}"
        );
    }
    let patches: Vec<PathBuf> = yaml_files(&deploy_dir())
        .into_iter()
        .filter(|p| is_patch(p))
        .collect();
    assert_eq!(
        patches,
        [kube_proxy_patch_path()],
        "every patch in deploy/ is validated applied (this file knows one)"
    );
    let failures: Vec<String> = files
        .iter()
        .filter_map(|file| {
            validate(file)
                .err()
                .map(|why| format!("{}: {why}", file.display()))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "manifests the API server would refuse:\n{}",
        failures.join("\n")
    );
}

/// The check has teeth: a misspelled field and a wrong type are refused,
/// naming the file and the field.
#[test]
fn a_broken_manifest_is_refused_naming_the_field() {
    let daemonset = fs::read_to_string(deploy_dir().join("daemonset.yaml")).expect("daemonset");
    let dir = std::env::temp_dir().join(format!("manifests-valid-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("temporary directory");
    for (from, to, complaint) in [
        (
            "hostNetwork: true",
            "hostNetwrok: true",
            "'hostNetwrok' was unexpected",
        ),
        (
            "containerPort: 10256",
            "containerPort: \"10256x\"",
            "containerPort",
        ),
    ] {
        assert!(daemonset.contains(from), "the DaemonSet has no {from:?}");
        let broken = dir.join("broken-daemonset.yaml");
        fs::write(&broken, daemonset.replacen(from, to, 1)).expect("write");
        let why = validate(&broken).expect_err("a broken DaemonSet passed");
        assert!(
            why.contains(complaint) && why.contains("broken-daemonset.yaml"),
            "{to:?}: the complaint names neither the field nor the file: {why}"
        );
    }
    fs::remove_dir_all(&dir).expect("remove the temporary directory");
}

/// The ConfigMap's `config.conf` is a configuration the agent reads without
/// a warning, its kubeconfig where the DaemonSet mounts `kubeconfig.conf`,
/// and the DaemonSet passes `--config` at the mounted `config.conf`.
#[test]
fn the_kube_proxy_configmap_fits_the_agent_and_the_daemonset() {
    let text = fs::read_to_string(deploy_dir().join("examples/kube-proxy-configmap.yaml"))
        .expect("the example ConfigMap");
    let configmap: Value = serde_yaml::from_str(&text).expect("YAML");
    let data = |key: &str| {
        configmap["data"][key]
            .as_str()
            .unwrap_or_else(|| panic!("no data.{key}"))
            .to_owned()
    };
    let config = proxy_userspace::config::parse(&data("config.conf"), "config.conf")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        config.ignored,
        [],
        "config.conf sets nothing that does not apply"
    );
    let kubeconfig = config
        .settings
        .kubeconfig
        .expect("clientConnection.kubeconfig");
    let kubeconfig_doc: Value = serde_yaml::from_str(&data("kubeconfig.conf")).expect("kubeconfig");
    assert!(
        kubeconfig_doc["clusters"][0]["cluster"]["server"]
            .as_str()
            .is_some_and(|s| s.starts_with("https://")),
        "kubeconfig.conf names the API server"
    );

    let daemonset: Value = serde_yaml::from_str(
        &fs::read_to_string(deploy_dir().join("daemonset.yaml")).expect("daemonset"),
    )
    .expect("YAML");
    let pod = &daemonset["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["configMap"]["name"] == "kube-proxy")
        .expect("a volume of the kube-proxy ConfigMap");
    let container = &pod["containers"][0];
    let mount = container["volumeMounts"]
        .as_sequence()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the ConfigMap mounted");
    let mount_path = Path::new(mount["mountPath"].as_str().expect("mountPath"));
    assert_eq!(
        kubeconfig,
        mount_path.join("kubeconfig.conf"),
        "clientConnection.kubeconfig is where the DaemonSet mounts kubeconfig.conf"
    );
    let config_arg = format!("--config={}", mount_path.join("config.conf").display());
    assert!(
        container["args"]
            .as_sequence()
            .expect("args")
            .iter()
            .any(|a| a.as_str() == Some(config_arg.as_str())),
        "the DaemonSet passes {config_arg}"
    );
    assert!(
        !serde_yaml::to_string(container)
            .unwrap()
            .contains("--master"),
        "no --master: the kubeconfig names the API server"
    );
}

/// The node label that moves a node from kube-proxy to ebpf-proxy.
const REPLACEMENT_LABEL: &str = "ebpf-proxy.io/kube-proxy-replacement";

fn kube_proxy_patch_path() -> PathBuf {
    deploy_dir().join("migration/kube-proxy-patch.yaml")
}

fn read_yaml(path: &Path) -> Value {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// kube-proxy's DaemonSet as kubeadm creates it (tests/testdata/).
fn kubeadm_kube_proxy() -> Value {
    read_yaml(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/kubeadm-kube-proxy-daemonset.yaml"),
    )
}

/// The key a list of `field` is merged by in a strategic merge patch (the
/// API's `patchMergeKey`), for the lists a DaemonSet patch touches; other
/// lists are replaced whole, as the API does for those without one.
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "containers" | "initContainers" | "volumes" | "env" => Some("name"),
        "volumeMounts" => Some("mountPath"),
        "ports" => Some("containerPort"),
        _ => None,
    }
}

/// `patch` applied to `target` as `kubectl patch` (strategic merge) does for
/// what the patches here hold: maps merged key by key (`null` deletes), lists
/// with a merge key merged item by item, anything else replaced.
fn strategic_merge(target: &mut Value, patch: &Value, field: &str) {
    match (target, patch) {
        (Value::Mapping(target), Value::Mapping(patch)) => {
            for (key, value) in patch {
                let name = key.as_str().unwrap_or_default();
                if value.is_null() {
                    target.remove(key);
                } else if let Some(existing) = target.get_mut(key) {
                    strategic_merge(existing, value, name);
                } else {
                    target.insert(key.clone(), value.clone());
                }
            }
        }
        (Value::Sequence(target), Value::Sequence(patch)) if merge_key(field).is_some() => {
            let key = merge_key(field).expect("a merge key");
            for item in patch {
                match target.iter_mut().find(|t| t[key] == item[key]) {
                    Some(existing) => strategic_merge(existing, item, field),
                    None => target.push(item.clone()),
                }
            }
        }
        (target, patch) => *target = patch.clone(),
    }
}

/// kubeadm's kube-proxy DaemonSet with deploy/migration/kube-proxy-patch.yaml.
fn patched_kube_proxy() -> Value {
    let mut daemonset = kubeadm_kube_proxy();
    strategic_merge(&mut daemonset, &read_yaml(&kube_proxy_patch_path()), "");
    daemonset
}

fn typed(daemonset: &Value) -> DaemonSet {
    serde_yaml::from_value(daemonset.clone()).expect("a DaemonSet")
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("a pod template")
}

/// `requirement` holds for a node labelled `labels` (the scheduler's rule).
fn requirement_holds(requirement: &NodeSelectorRequirement, labels: &BTreeMap<&str, &str>) -> bool {
    let value = labels.get(requirement.key.as_str());
    let values = requirement.values.as_deref().unwrap_or_default();
    match requirement.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|w| w == v)),
        "NotIn" => !value.is_some_and(|v| values.iter().any(|w| w == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        other => panic!("operator {other} is not something this test knows"),
    }
}

/// Whether a DaemonSet's pod goes on a node labelled `labels`: its
/// nodeSelector and its required node affinity (one of the terms).
fn schedules_on(pod: &PodSpec, labels: &BTreeMap<&str, &str>) -> bool {
    let selector = pod
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k.as_str()) == Some(&v.as_str()));
    let affinity = pod
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .is_none_or(|required| {
            required.node_selector_terms.iter().any(|term| {
                term.match_fields.is_none()
                    && term
                        .match_expressions
                        .iter()
                        .flatten()
                        .all(|r| requirement_holds(r, labels))
            })
        });
    selector && affinity
}

fn container<'a>(pod: &'a PodSpec, name: &str) -> &'a Container {
    pod.containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn probe_path(probe: Option<&Probe>, what: &str) -> (String, IntOrString) {
    let get = probe
        .and_then(|p| p.http_get.as_ref())
        .unwrap_or_else(|| panic!("no httpGet {what}"));
    (get.path.clone().unwrap_or_default(), get.port.clone())
}

fn host_ports(container: &Container) -> Vec<i32> {
    container
        .ports
        .iter()
        .flatten()
        .filter_map(|p| p.host_port)
        .collect()
}

/// The patch applied to kubeadm's DaemonSet is a DaemonSet the API takes,
/// and kube-proxy's own container comes out of it whole.
#[test]
fn the_kube_proxy_patch_makes_a_valid_kubeadm_daemonset() {
    let patched = patched_kube_proxy();
    let dir = std::env::temp_dir().join(format!("manifests-patched-{}", std::process::id()));
    fs::create_dir_all(&dir).expect("temporary directory");
    let file = dir.join("kube-proxy-patched.yaml");
    fs::write(&file, serde_yaml::to_string(&patched).expect("YAML")).expect("write");
    let verdict = validate(&file);
    fs::remove_dir_all(&dir).expect("remove the temporary directory");
    verdict.unwrap_or_else(|why| panic!("the patched kube-proxy DaemonSet is refused: {why}"));

    let before = typed(&kubeadm_kube_proxy());
    let after = typed(&patched);
    let (before, after) = (pod_spec(&before), pod_spec(&after));
    let kube_proxy = container(after, "kube-proxy");
    let original = container(before, "kube-proxy");
    assert_eq!(kube_proxy.command, original.command, "kube-proxy's command");
    assert_eq!(kube_proxy.image, original.image, "kube-proxy's image");
    assert_eq!(
        kube_proxy.volume_mounts, original.volume_mounts,
        "kube-proxy's mounts"
    );
    assert_eq!(
        after.volumes.as_ref().map(Vec::len),
        before.volumes.as_ref().map(|v| v.len() + 1),
        "kube-proxy's volumes and the bpffs"
    );
    assert_eq!(after.tolerations, before.tolerations);
    assert_eq!(after.host_network, Some(true));
}

/// The label splits the nodes: exactly one of ebpf-proxy's DaemonSet and
/// the patched kube-proxy's runs on each, whatever the label says.
#[test]
fn the_daemonset_and_the_patched_kube_proxy_split_the_nodes_by_one_label() {
    let ebpf_proxy = daemonset::load();
    let kube_proxy = typed(&patched_kube_proxy());
    let ebpf_pod = pod_spec(&ebpf_proxy);
    let kube_pod = pod_spec(&kube_proxy);
    assert_eq!(
        ebpf_pod
            .node_selector
            .as_ref()
            .and_then(|s| s.get(REPLACEMENT_LABEL))
            .map(String::as_str),
        Some("true"),
        "the DaemonSet selects the nodes labelled {REPLACEMENT_LABEL}=true"
    );
    for value in [None, Some("true"), Some("false"), Some("")] {
        let mut labels = BTreeMap::from([("kubernetes.io/os", "linux")]);
        if let Some(value) = value {
            labels.insert(REPLACEMENT_LABEL, value);
        }
        let (ebpf, kube) = (
            schedules_on(ebpf_pod, &labels),
            schedules_on(kube_pod, &labels),
        );
        assert!(
            ebpf != kube,
            "{REPLACEMENT_LABEL}={value:?}: ebpf-proxy {ebpf}, kube-proxy {kube}: one proxy, always"
        );
        assert_eq!(ebpf, value == Some("true"), "{value:?}");
    }
    assert!(
        !schedules_on(kube_pod, &BTreeMap::from([("kubernetes.io/os", "windows")])),
        "the patch keeps kubeadm's nodeSelector"
    );

    // The two never run on a node at once: both hold kube-proxy's /healthz
    // port on the host, which the scheduler gives one pod at a time.
    let agent = daemonset::container(&ebpf_proxy);
    assert_eq!(host_ports(agent), [10256]);
    assert_eq!(host_ports(container(kube_pod, "kube-proxy")), [10256]);
}

/// The handoff is this project's image on the agent's pins, with no more
/// than the agent's capabilities.
#[test]
fn the_handoff_runs_the_daemonsets_image_on_its_pins() {
    let ebpf_proxy = daemonset::load();
    let agent = daemonset::container(&ebpf_proxy);
    let kube_proxy = typed(&patched_kube_proxy());
    let pod = pod_spec(&kube_proxy);
    let handoff = container(pod, "ebpf-proxy-handoff");
    assert!(
        pod.init_containers
            .iter()
            .flatten()
            .any(|c| c.name == handoff.name),
        "the handoff is an init container: kube-proxy starts after it"
    );
    assert_eq!(handoff.image, agent.image, "the DaemonSet's image");
    let command = handoff.command.clone().expect("a command");
    let bpf_root = agent
        .args
        .iter()
        .flatten()
        .find(|a| a.starts_with("--bpf-root="))
        .expect("the agent's --bpf-root");
    assert_eq!(
        command,
        [
            agent.command.as_ref().expect("the agent's command")[0].as_str(),
            "cleanup",
            "--handoff",
            bpf_root
        ],
        "cleanup --handoff on the agent's pin root"
    );

    let agent_caps = daemonset::added_capabilities(agent);
    let caps = handoff
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let added = caps.add.clone().unwrap_or_default();
    for cap in ["BPF", "NET_ADMIN"] {
        assert!(added.iter().any(|c| c == cap), "the handoff needs {cap}");
    }
    assert!(
        added.iter().all(|c| agent_caps.contains(c)),
        "{added:?}: nothing the agent lacks"
    );

    // The host's bpffs, at the agent's mount path.
    let bpffs_volume = |pod: &PodSpec| {
        pod.volumes
            .iter()
            .flatten()
            .find(|v| {
                v.host_path
                    .as_ref()
                    .is_some_and(|h| h.path == "/sys/fs/bpf")
            })
            .map(|v| v.name.clone())
            .expect("a volume of the host's /sys/fs/bpf")
    };
    let mount_path = |container: &Container, volume: &str| {
        container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume)
            .map(|m| m.mount_path.clone())
            .expect("the bpffs mounted")
    };
    assert_eq!(
        mount_path(handoff, &bpffs_volume(pod)),
        mount_path(agent, &bpffs_volume(pod_spec(&ebpf_proxy))),
        "the handoff sees the pins where the agent made them"
    );
}

/// A fresh node resolves names through its own resolv.conf; the kubelet's
/// probes ask what a restart fixes: startup and readiness /readyz (first
/// sync done, a drained node left out), liveness /livez; never /healthz.
#[test]
fn the_daemonset_resolves_by_the_node_and_probes_what_a_restart_fixes() {
    let ds = daemonset::load();
    let pod = pod_spec(&ds);
    assert_eq!(pod.dns_policy.as_deref(), Some("Default"));
    let agent = daemonset::container(&ds);
    let healthz_port = agent
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("healthz"))
        .map(|p| IntOrString::Int(p.container_port))
        .expect("the healthz port");
    for (probe, what, path) in [
        (agent.startup_probe.as_ref(), "startupProbe", "/readyz"),
        (agent.readiness_probe.as_ref(), "readinessProbe", "/readyz"),
        (agent.liveness_probe.as_ref(), "livenessProbe", "/livez"),
    ] {
        assert_eq!(
            probe_path(probe, what),
            (path.to_owned(), healthz_port.clone()),
            "{what}"
        );
    }
}

/// The agent shares iptables' lock with every other writer on the node: the
/// host's `/run/xtables.lock` (created when missing), writable at the same path
/// in the container, as kubeadm's kube-proxy DaemonSet mounts it. Without it
/// iptables-legacy-restore cannot take a lock on the read-only root and fails.
#[test]
fn the_agent_shares_the_nodes_xtables_lock_as_kube_proxy_does() {
    const LOCK: &str = "/run/xtables.lock";
    let lock_mount = |pod: &PodSpec, container: &Container| {
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.host_path.as_ref().is_some_and(|h| h.path == LOCK))
            .unwrap_or_else(|| panic!("a volume of the host's {LOCK}"));
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume.name)
            .unwrap_or_else(|| panic!("{} mounts the volume {}", container.name, volume.name));
        (
            volume.host_path.as_ref().and_then(|h| h.type_.clone()),
            mount.mount_path.clone(),
            mount.read_only.unwrap_or(false),
        )
    };
    let ds = daemonset::load();
    let agent = lock_mount(pod_spec(&ds), daemonset::container(&ds));
    assert_eq!(
        agent,
        (Some("FileOrCreate".to_owned()), LOCK.to_owned(), false),
        "the host's lock, created when missing, writable at its own path"
    );
    let kube_proxy = typed(&kubeadm_kube_proxy());
    let pod = pod_spec(&kube_proxy);
    assert_eq!(
        agent,
        lock_mount(pod, container(pod, "kube-proxy")),
        "mounted as kube-proxy mounts it"
    );
}

/// The agent and the handoff run unconfined by `AppArmor` and as
/// `SELinux`'s `spc_t`, which hosts with default profiles need for `bpf()`
/// and mounts.
#[test]
fn the_agent_and_the_handoff_are_unconfined_by_apparmor_and_selinux() {
    let ds = daemonset::load();
    let kube_proxy = typed(&patched_kube_proxy());
    for container in [
        daemonset::container(&ds),
        container(pod_spec(&kube_proxy), "ebpf-proxy-handoff"),
    ] {
        let security = container
            .security_context
            .as_ref()
            .expect("securityContext");
        assert_eq!(
            security
                .app_armor_profile
                .as_ref()
                .map(|p| p.type_.as_str()),
            Some("Unconfined"),
            "{}: appArmorProfile",
            container.name
        );
        let selinux = security.se_linux_options.as_ref().expect("seLinuxOptions");
        assert_eq!(
            (selinux.type_.as_deref(), selinux.level.as_deref()),
            (Some("spc_t"), Some("s0")),
            "{}: seLinuxOptions",
            container.name
        );
        assert_eq!(
            security.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
            Some("Unconfined"),
            "{}: seccompProfile",
            container.name
        );
        assert_ne!(security.privileged, Some(true), "{}", container.name);
    }
}

/// The strategic merge above merges lists by their key and replaces the
/// others, as the API server does.
#[test]
fn the_strategic_merge_merges_by_key_and_replaces_the_rest() {
    let mut target: Value = serde_yaml::from_str(
        "containers: [{name: a, image: x, ports: [{containerPort: 1}]}]\ntolerations: [{operator: Exists}]\nkeep: 1\ndrop: 2\n",
    )
    .unwrap();
    let patch: Value = serde_yaml::from_str(
        "containers: [{name: a, ports: [{containerPort: 2}]}, {name: b}]\ntolerations: [{key: k}]\ndrop: null\n",
    )
    .unwrap();
    strategic_merge(&mut target, &patch, "");
    let want: Value = serde_yaml::from_str(
        "containers: [{name: a, image: x, ports: [{containerPort: 1}, {containerPort: 2}]}, {name: b}]\ntolerations: [{key: k}]\nkeep: 1\n",
    )
    .unwrap();
    assert_eq!(target, want);
}
