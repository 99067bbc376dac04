//! Every manifest in deploy/ (examples included) against the Kubernetes API's
//! schemas, offline, with `kubernetes-validate --strict` (an unknown field is
//! an error, as `kubectl apply --validate=strict` makes it); and the example
//! `kube-proxy` ConfigMap against what the agent and the DaemonSet expect of
//! it. Needs `cargo xtask setup` (which installs the validator), not root.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use ebpf_proxy_tests::manifest_check::KUBERNETES_VALIDATE;
use serde_yaml::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every YAML file below `dir`, sorted.
fn manifests(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            out.extend(manifests(&path));
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
