//! The agent's container image (`cargo xtask image`) run with Debian's podman
//! exactly as deploy/daemonset.yaml specifies it: its command and args, its
//! environment, only the capabilities it adds after dropping ALL, its seccomp,
//! `AppArmor` and `SELinux` settings and privilege escalation setting, a
//! read-only root filesystem, the bpffs and host cgroup mounts, kubeadm's
//! `kube-proxy` ConfigMap (the example's `config.conf`, and a kubeconfig naming
//! the fake API server in tests/apiserver/, as a cluster's names its own), and
//! the host network of a test node (the node's network namespace). The startup
//! probe is polled as the kubelet would, then the readiness and liveness
//! probes. The image's OCI labels name its version, commit and licences, it
//! holds `/usr/local/bin/kube-proxy` as a link to the agent, and the netfilter
//! tools the agent runs to take a node over from kube-proxy work in it, run as
//! the DaemonSet runs the agent in a network namespace of their own. A pod's
//! connections through a ClusterIP are served, and keep being served after
//! `podman rm -f`: the datapath lives in the pins.
//!
//! Needs root, the image (`cargo xtask image`, which `cargo xtask test` runs)
//! and podman with crun or runc.

use ebpf_proxy_apiserver as apiserver;
mod daemonset;

use std::{
    fs,
    io::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, SystemTime},
};

use apiserver::{node, service, slice};
use ebpf_proxy_tests::{
    agent::{self, files_below, http_status},
    client::tcp_tally,
    describe, image,
    netns::{NetNs, command_in, unique_stem},
    require_root, run_cmd,
    sandbox::Sandbox,
    topology::one_node::{self, CLIENT, CLUSTER_IP, TCP_PORT, UDP_PORT, VIP},
};
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Container, HTTPGetAction, Probe},
};

/// Two of the one-node world's backends.
const BACKENDS: [(&str, Ipv4Addr); 2] = [one_node::BACKENDS[0], one_node::BACKENDS[1]];
use ebpf_proxy_tests::client::TIMEOUT;
const CONNECTIONS: usize = 40;
/// Where the DaemonSet mounts the host's bpffs, and the host's cgroup root.
const BPFFS_HOST_PATH: &str = "/sys/fs/bpf";
const CGROUP_HOST_PATH: &str = "/sys/fs/cgroup";
/// iptables' lock, which the DaemonSet mounts from the host as kube-proxy's does.
const XTABLES_LOCK_HOST_PATH: &str = "/run/xtables.lock";

/// The cargo target directory, where `cargo xtask image` writes the archives.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    )
}

/// The OCI archive of the image the DaemonSet names; fails when it is missing or
/// older than the agent binary under test (it would test another agent).
fn image_archive(version: &str) -> PathBuf {
    let archive = image::oci_archive(&target_dir(), version);
    let built = fs::metadata(&archive)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| {
            panic!(
                "no image archive {}: {e}; run `cargo xtask image` (`cargo xtask test` does)",
                archive.display()
            )
        });
    let bin = agent::binary().expect("the agent binary");
    let bin_built = fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    assert!(
        built >= bin_built,
        "{} is older than {}: run `cargo xtask image` again",
        archive.display(),
        bin.display()
    );
    archive
}

/// The OCI runtime Debian gives podman that works on this host: crun needs a
/// cgroup v2 only host; runc also runs on a hybrid one.
fn runtime() -> &'static str {
    if proxy_userspace::datapath::host::is_cgroup2(Path::new(CGROUP_HOST_PATH)) {
        "crun"
    } else {
        "runc"
    }
}

/// podman on a storage of its own, removed on drop: nothing is shared with
/// other runs or with the machine's own containers.
struct Podman {
    dir: PathBuf,
}

impl Podman {
    fn new(stem: &str) -> Podman {
        let dir = std::env::temp_dir().join(format!("{stem}-podman"));
        fs::create_dir_all(&dir).expect("podman's directory");
        Podman { dir }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .args(["--storage-driver", "vfs"])
            .args(["--cgroup-manager", "cgroupfs"])
            .args(["--events-backend", "file"])
            .args(["--runtime", runtime()]);
        cmd
    }

    fn run(&self, args: &[&str]) -> String {
        let mut cmd = self.command();
        cmd.args(args);
        run_cmd(&mut cmd).unwrap_or_else(|e| panic!("{e:#}"))
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.command().args(["rm", "--all", "--force"]).output();
        let _ = self.command().args(["rmi", "--all", "--force"]).output();
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("warning: cannot remove {}: {e}", self.dir.display());
        }
    }
}

/// The test node's bpffs: a directory of its own on the host's, which the
/// container sees at the DaemonSet's mount path. Its pins are removed on drop
/// (`ebpf-proxy cleanup`, in the node's namespace for its attachments).
struct NodeBpffs {
    host_dir: PathBuf,
    netns: PathBuf,
    /// The agent's pin root as seen from the host.
    pin_root: PathBuf,
}

impl Drop for NodeBpffs {
    fn drop(&mut self) {
        if let Ok(bin) = agent::binary() {
            let mut cmd = command_in(&self.netns, bin);
            cmd.arg("cleanup").arg("--bpf-root").arg(&self.pin_root);
            if let Err(e) = run_cmd(&mut cmd) {
                eprintln!("warning: {e:#}");
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.host_dir) {
            eprintln!("warning: cannot remove {}: {e}", self.host_dir.display());
        }
    }
}

/// A container, removed (`podman rm -f`) on drop; its log shown if the test
/// panics.
struct Running<'a> {
    podman: &'a Podman,
    name: String,
    removed: bool,
}

impl Running<'_> {
    fn logs(&self) -> String {
        let mut cmd = self.podman.command();
        cmd.args(["logs", &self.name]);
        match cmd.output() {
            Ok(out) => format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => format!("({}: {e})", describe(&cmd)),
        }
    }

    fn state(&self) -> String {
        let mut cmd = self.podman.command();
        cmd.args(["inspect", "--format", "{{.State.Status}}", &self.name]);
        run_cmd(&mut cmd).map_or_else(|e| format!("{e:#}"), |s| s.trim().to_owned())
    }

    fn remove(&mut self) {
        self.podman.run(&["rm", "--force", &self.name]);
        self.removed = true;
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "----- container {} ({}) -----\n{}----- end -----",
                self.name,
                self.state(),
                self.logs()
            );
        }
        if !self.removed {
            let _ = self
                .podman
                .command()
                .args(["rm", "--force", &self.name])
                .output();
        }
    }
}

/// Removes a test directory or file, also when the test fails.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = if self.0.is_dir() {
            fs::remove_dir_all(&self.0)
        } else {
            fs::remove_file(&self.0)
        };
    }
}

/// What the pod volume `name` holds: its `hostPath`, or `configMap:NAME`.
fn host_path(ds: &DaemonSet, name: &str) -> String {
    let volume = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.volumes.as_ref())
        .and_then(|v| v.iter().find(|v| v.name == name))
        .unwrap_or_else(|| panic!("the DaemonSet has no volume {name}"));
    match (&volume.host_path, &volume.config_map) {
        (Some(h), None) => h.path.clone(),
        (None, Some(c)) => format!("configMap:{}", c.name),
        _ => panic!("volume {name} is of a kind this test does not know"),
    }
}

/// The `kube-proxy` ConfigMap's files as a cluster would hold them: the
/// example's `config.conf`, and a `kubeconfig.conf` naming this test's API
/// server (plain HTTP, no credentials: the loopback server asks for none).
fn write_kube_proxy_configmap(dir: &Path, server: &str) {
    let text = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/kube-proxy-configmap.yaml"),
    )
    .expect("the example ConfigMap");
    let configmap: k8s_openapi::api::core::v1::ConfigMap =
        serde_yaml::from_str(&text).expect("the example ConfigMap parses");
    let data = configmap.data.expect("the ConfigMap's data");
    fs::create_dir_all(dir).expect("the ConfigMap's directory");
    fs::write(dir.join("config.conf"), &data["config.conf"]).expect("config.conf");
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: default\n  cluster:\n    server: {server}\ncontexts:\n- name: default\n  context:\n    cluster: default\n    user: default\ncurrent-context: default\nusers:\n- name: default\n  user: {{}}\n"
    );
    fs::write(dir.join("kubeconfig.conf"), kubeconfig).expect("kubeconfig.conf");
}

/// `podman run` flags for `container` as the DaemonSet specifies it, on this
/// test node: `host_dirs` maps the DaemonSet's hostPaths to this node's.
fn podman_flags(
    ds: &DaemonSet,
    container: &Container,
    node_name: &str,
    netns: &Path,
    host_dirs: &[(&str, &Path)],
) -> Vec<String> {
    let mut flags = vec![
        format!("--network=ns:{}", netns.display()),
        "--cap-drop=ALL".to_owned(),
    ];
    for cap in daemonset::added_capabilities(container) {
        flags.push(format!("--cap-add={cap}"));
    }
    let security = container
        .security_context
        .as_ref()
        .expect("securityContext");
    if security.read_only_root_filesystem == Some(true) {
        flags.push("--read-only".to_owned());
    }
    if security.allow_privilege_escalation == Some(false) {
        flags.push("--security-opt=no-new-privileges".to_owned());
    }
    match security.seccomp_profile.as_ref().map(|p| p.type_.as_str()) {
        Some("Unconfined") => flags.push("--security-opt=seccomp=unconfined".to_owned()),
        None | Some("RuntimeDefault") => {}
        Some(other) => panic!("seccompProfile {other} is not something this test knows"),
    }
    // podman leaves both out on a host without the module, as the kubelet's
    // runtimes do.
    match security
        .app_armor_profile
        .as_ref()
        .map(|p| p.type_.as_str())
    {
        Some("Unconfined") => flags.push("--security-opt=apparmor=unconfined".to_owned()),
        None | Some("RuntimeDefault") => {}
        Some(other) => panic!("appArmorProfile {other} is not something this test knows"),
    }
    if let Some(selinux) = &security.se_linux_options {
        for (key, value) in [
            ("type", &selinux.type_),
            ("level", &selinux.level),
            ("user", &selinux.user),
            ("role", &selinux.role),
        ] {
            if let Some(value) = value {
                flags.push(format!("--security-opt=label={key}:{value}"));
            }
        }
    }
    assert!(
        !(security.privileged == Some(true) || security.run_as_user.is_some_and(|u| u != 0)),
        "privileged or non-root containers are not something this test knows"
    );
    for mount in container.volume_mounts.iter().flatten() {
        let host = host_path(ds, &mount.name);
        let host = host_dirs.iter().find(|(h, _)| *h == host).map_or_else(
            || panic!("no test directory stands for the volume {host}"),
            |(_, d)| d.display().to_string(),
        );
        let mut options = vec![if mount.read_only == Some(true) {
            "ro"
        } else {
            "rw"
        }];
        match mount.mount_propagation.as_deref() {
            Some("HostToContainer") => options.push("rslave"),
            Some("Bidirectional") => options.push("rshared"),
            None | Some("None") => options.push("rprivate"),
            Some(other) => panic!("mountPropagation {other}"),
        }
        flags.push(format!(
            "--volume={host}:{}:{}",
            mount.mount_path,
            options.join(",")
        ));
    }
    for env in container.env.iter().flatten() {
        let value = match (&env.value, &env.value_from) {
            (Some(v), None) => v.clone(),
            (None, Some(from))
                if from
                    .field_ref
                    .as_ref()
                    .is_some_and(|f| f.field_path == "spec.nodeName") =>
            {
                node_name.to_owned()
            }
            _ => panic!("env {} is set in a way this test does not know", env.name),
        };
        flags.push(format!("--env={}={value}", env.name));
    }
    // Kubernetes sets no rlimits; podman would set its defaults, above this
    // machine's hard limits, which it cannot raise without CAP_SYS_RESOURCE.
    // The container gets limits below them: the test's own open files, and a
    // process count runc can apply under conmon.
    let files = open_files_limit();
    flags.push(format!("--ulimit=nofile={files}:{files}"));
    flags.push("--ulimit=nproc=32768:32768".to_owned());
    let command = container.command.as_ref().expect("the container's command");
    flags.push(format!(
        "--entrypoint={}",
        serde_json::to_string(command).expect("JSON")
    ));
    flags
}

/// This process's soft limit on open files, from /proc/self/limits.
fn open_files_limit() -> u64 {
    let limits = fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|soft| soft.parse().ok())
        .unwrap_or_else(|| panic!("no open files limit in /proc/self/limits:\n{limits}"))
}

/// Polls the probe's httpGet from the node's namespace as the kubelet does:
/// every periodSeconds, up to failureThreshold failures.
fn probe_until_healthy(netns: &NetNs, probe: &Probe, container: &Running) -> u32 {
    let get: &HTTPGetAction = probe.http_get.as_ref().expect("an httpGet probe");
    let host: Ipv4Addr = get
        .host
        .as_deref()
        .unwrap_or("127.0.0.1")
        .parse()
        .expect("the probe's host is an IPv4 address");
    let port = match &get.port {
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => *p as u16,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(other) => {
            panic!("probe port {other:?}: only numbers are known here")
        }
    };
    let path = get.path.clone().unwrap_or_else(|| "/".to_owned());
    let period = Duration::from_secs(probe.period_seconds.unwrap_or(10) as u64);
    let threshold = probe.failure_threshold.unwrap_or(3) as u32;
    let addr = SocketAddrV4::new(host, port);
    let mut last = String::new();
    for attempt in 1..=threshold {
        match netns.run(|| http_status(addr, &path)) {
            Ok(Ok(200)) => return attempt,
            Ok(Ok(code)) => last = format!("HTTP {code}"),
            Ok(Err(e)) | Err(e) => last = format!("{e:#}"),
        }
        let state = container.state();
        assert!(
            state == "running" || state == "created" || state == "configured",
            "the container is {state} before its probe {path} passed (last: {last})"
        );
        // The point: the probe is asked as the kubelet asks it, once a period, at
        // most its failure threshold times; what is tested is that it passes so.
        thread::sleep(period);
    }
    panic!("the probe {addr}{path} failed {threshold} times (last: {last})");
}

/// The image's OCI labels (`org.opencontainers.image.*`) say what it is and
/// which commit it was built from.
fn check_image_metadata(podman: &Podman, image_ref: &str, version: &str) {
    let labels = podman.run(&[
        "image",
        "inspect",
        "--format",
        "{{json .Labels}}",
        image_ref,
    ]);
    let labels: serde_json::Value =
        serde_json::from_str(labels.trim()).unwrap_or_else(|e| panic!("labels {labels:?}: {e}"));
    let label = |key: &str| {
        labels[format!("org.opencontainers.image.{key}")]
            .as_str()
            .unwrap_or_else(|| panic!("no label org.opencontainers.image.{key}: {labels}"))
            .to_owned()
    };
    assert_eq!(label("title"), "ebpf-proxy");
    assert!(!label("description").is_empty());
    assert_eq!(label("version"), version);
    assert_eq!(label("licenses"), env!("CARGO_PKG_LICENSE"));
    let revision = label("revision");
    let commit = revision.strip_suffix("-dirty").unwrap_or(&revision);
    assert!(
        commit.len() == 40 && commit.chars().all(|c| c.is_ascii_hexdigit()),
        "revision {revision:?} is a git commit"
    );
    let created = label("created");
    assert!(
        created.len() >= 20 && created.as_bytes()[10] == b'T',
        "created {created:?} is an RFC 3339 time"
    );
    if let Some(source) = labels["org.opencontainers.image.source"].as_str() {
        assert!(source.contains("://"), "source {source:?} is a URL");
    }
}

/// `/usr/local/bin/kube-proxy` is a link to the agent, so that the image
/// swapped into kube-proxy's own DaemonSet runs it.
fn check_kube_proxy_link(podman: &Podman, image_ref: &str, stem: &str) {
    let name = format!("{stem}-export");
    podman.run(&["create", "--name", &name, image_ref]);
    let tar = podman.dir.join("export.tar");
    podman.run(&["export", "--output", &tar.display().to_string(), &name]);
    podman.run(&["rm", &name]);
    let link = image::KUBE_PROXY_IN_IMAGE.trim_start_matches('/');
    let listing = run_cmd(Command::new("tar").arg("-tvf").arg(&tar).arg(link))
        .unwrap_or_else(|e| panic!("{link} in the image: {e:#}"));
    let _ = fs::remove_file(&tar);
    let agent = Path::new(image::BIN_IN_IMAGE)
        .file_name()
        .expect("a file name")
        .to_string_lossy()
        .into_owned();
    assert!(
        listing.starts_with('l') && listing.trim_end().ends_with(&format!("{link} -> {agent}")),
        "{link} is not a link to {agent}: {listing}"
    );
}

/// The netfilter tools the agent's takeover and hand-back run are in the image
/// and work as the DaemonSet runs it (`flags`: its capabilities, read-only root
/// and mounts, iptables' lock among them), in a network namespace of the
/// container's own: each iptables backend reads IPv4 and IPv6, and writes
/// (iptables-legacy-restore takes the lock), and `nft` lists the tables.
fn check_netfilter_tools(podman: &Podman, image_ref: &str, flags: &[String]) {
    let flags: Vec<&str> = flags
        .iter()
        .map(String::as_str)
        .filter(|f| !f.starts_with("--network=") && !f.starts_with("--entrypoint="))
        .collect();
    for (tool, args, stdin) in [
        ("iptables-nft-save", &[][..], None),
        ("ip6tables-nft-save", &[], None),
        ("iptables-legacy-save", &[], None),
        ("ip6tables-legacy-save", &[], None),
        (
            "iptables-legacy-restore",
            &["--noflush", "--wait=5"],
            Some("*filter\n:EBPF-PROXY-TEST - [0:0]\nCOMMIT\n"),
        ),
        (
            "iptables-nft-restore",
            &["--noflush"],
            Some("*filter\n:EBPF-PROXY-TEST - [0:0]\nCOMMIT\n"),
        ),
        ("nft", &["list", "tables"], None),
    ] {
        let mut cmd = podman.command();
        cmd.args(["run", "--rm", "--interactive", "--network=none"])
            .args(&flags)
            .arg(format!("--entrypoint=/usr/sbin/{tool}"))
            .arg(image_ref)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("podman run");
        {
            let mut pipe = child.stdin.take().expect("stdin");
            pipe.write_all(stdin.unwrap_or("").as_bytes())
                .expect("the tool's input");
        }
        let out = child.wait_with_output().expect("podman run");
        assert!(
            out.status.success(),
            "{tool} {args:?} in the image: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
fn the_image_runs_as_the_daemonset_says_and_its_datapath_outlives_it() {
    require_root().expect("privileged test");
    let ds = daemonset::load();
    let container = daemonset::container(&ds).clone();
    let image_ref = container.image.clone().expect("the container's image");
    let version = image_ref
        .strip_prefix(&format!("{}:", image::REPOSITORY))
        .unwrap_or_else(|| panic!("the DaemonSet's image {image_ref} is not ebpf-proxy:<tag>"));
    assert_eq!(
        version,
        env!("CARGO_PKG_VERSION"),
        "the DaemonSet's image tag is the crate version"
    );
    let archive = image_archive(version);

    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let node_name = node_ns.name().to_owned();
    let (_runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, None));
    server.apply(service("test", "web", &CLUSTER_IP.to_string()));
    let ips: Vec<String> = BACKENDS.iter().map(|b| b.1.to_string()).collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    server.apply(slice("test", "web-1", "web", &node_name, &ips));

    let stem = unique_stem();
    let podman = Podman::new(&stem);
    let loaded = podman.run(&["load", "--input", &archive.display().to_string()]);
    assert!(
        loaded.contains(&image_ref),
        "loading {} gives {image_ref}: {loaded}",
        archive.display()
    );

    check_image_metadata(&podman, &image_ref, version);
    check_kube_proxy_link(&podman, &image_ref, &stem);

    let bpffs_dir = PathBuf::from(format!("{BPFFS_HOST_PATH}/ebpf-proxy-test-{stem}"));
    fs::create_dir(&bpffs_dir).expect("the node's bpffs directory");
    let bpf_root_arg = container
        .args
        .iter()
        .flatten()
        .find_map(|a| a.strip_prefix("--bpf-root="))
        .expect("the DaemonSet's --bpf-root=")
        .to_owned();
    let bpffs_mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| host_path(&ds, &m.name) == BPFFS_HOST_PATH)
        .expect("a mount of the host's bpffs")
        .mount_path
        .clone();
    let pin_root = bpffs_dir.join(
        Path::new(&bpf_root_arg)
            .strip_prefix(&bpffs_mount)
            .expect("--bpf-root is on the bpffs mount"),
    );
    let bpffs = NodeBpffs {
        host_dir: bpffs_dir.clone(),
        netns: node_ns.path(),
        pin_root: pin_root.clone(),
    };
    // The host's cgroup v2 hierarchy: on a hybrid host, its `unified` directory,
    // as the DaemonSet's comment tells operators.
    let cgroup_host = proxy_userspace::datapath::host::default_cgroup_root()
        .expect("this host has a cgroup v2 hierarchy");

    // kubeadm's ConfigMap, which the DaemonSet mounts: the agent's --config
    // and the API server's address.
    let configmap_dir = PathBuf::from(format!("/tmp/ebpf-proxy-test-{stem}-kube-proxy"));
    write_kube_proxy_configmap(&configmap_dir, server.url());
    let _configmap_cleanup = RemoveOnDrop(configmap_dir.clone());
    // The node's iptables lock, which the DaemonSet mounts from the host: a
    // file of this test's, as the kubelet's FileOrCreate makes it.
    let xtables_lock = PathBuf::from(format!("/tmp/ebpf-proxy-test-{stem}-xtables.lock"));
    fs::write(&xtables_lock, "").expect("the xtables lock");
    let _lock_cleanup = RemoveOnDrop(xtables_lock.clone());
    let host_dirs = [
        (BPFFS_HOST_PATH, bpffs_dir.as_path()),
        (CGROUP_HOST_PATH, cgroup_host.as_path()),
        ("configMap:kube-proxy", configmap_dir.as_path()),
        (XTABLES_LOCK_HOST_PATH, xtables_lock.as_path()),
    ];
    check_netfilter_tools(
        &podman,
        &image_ref,
        &podman_flags(&ds, &container, &node_name, &node_ns.path(), &host_dirs),
    );

    let name = format!("{stem}-ebpf-proxy");
    let mut run_args = vec![
        "run".to_owned(),
        "--detach".to_owned(),
        format!("--name={name}"),
    ];
    run_args.extend(podman_flags(
        &ds,
        &container,
        &node_name,
        &node_ns.path(),
        &host_dirs,
    ));
    run_args.push(image_ref.clone());
    run_args.extend(container.args.iter().flatten().cloned());
    let run_args: Vec<&str> = run_args.iter().map(String::as_str).collect();
    eprintln!("podman {}", run_args.join(" "));
    podman.run(&run_args);
    let mut running = Running {
        podman: &podman,
        name: name.clone(),
        removed: false,
    };

    let startup = container.startup_probe.as_ref().expect("a startupProbe");
    let attempts = probe_until_healthy(node_ns, startup, &running);
    eprintln!("startup probe passed at attempt {attempts}");
    let readiness = container
        .readiness_probe
        .as_ref()
        .expect("a readinessProbe");
    assert_eq!(
        probe_until_healthy(node_ns, readiness, &running),
        1,
        "the readiness probe passes at once after startup"
    );
    let liveness = container.liveness_probe.as_ref().expect("a livenessProbe");
    assert_eq!(
        probe_until_healthy(node_ns, liveness, &running),
        1,
        "the liveness probe passes at once after startup"
    );

    let served = |when: &str| {
        let tally = tcp_tally(&sb.client().ns, VIP, CONNECTIONS, TIMEOUT).expect("connections");
        let names: Vec<&str> = BACKENDS.iter().map(|b| b.0).collect();
        assert!(
            tally.failures.is_empty(),
            "{when}: {} of {CONNECTIONS} connections to {VIP} failed: {:?}",
            tally.failures.len(),
            tally.failures
        );
        assert_eq!(
            tally.counts_for(&names).iter().sum::<u64>(),
            CONNECTIONS as u64,
            "{when}: every connection served by a backend: {:?}",
            tally.counts
        );
        tally.counts
    };
    let before = served("with the container running");
    eprintln!("served with the container running: {before:?}");

    let pins_before = files_below(&pin_root);
    assert!(
        !pins_before.is_empty(),
        "the container pinned nothing under {}",
        pin_root.display()
    );
    running.remove();
    let mut ps = podman.command();
    ps.args([
        "ps",
        "--all",
        "--quiet",
        "--filter",
        &format!("name={name}"),
    ]);
    assert_eq!(
        run_cmd(&mut ps).expect("podman ps").trim(),
        "",
        "the container is gone"
    );
    assert_eq!(
        files_below(&pin_root),
        pins_before,
        "the pins outlive the container"
    );
    let after = served("after podman rm -f");
    eprintln!("served after the container was removed: {after:?}");
    drop(running);
    drop(bpffs);
}
