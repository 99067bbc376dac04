//! Installs what a fresh machine lacks, idempotently, saying what it does
//! (docs/building.md, "Install").

use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};
use ebpf_proxy_tests::{
    manifest_check::{KUBERNETES_VALIDATE, KUBERNETES_VALIDATE_VENV, KUBERNETES_VALIDATE_VERSION},
    require_root,
};

use crate::run_status;

/// Debian packages: rustc-web and its prebuilt BPF `core` compile the eBPF crate;
/// bpftool inspects maps; iproute2, iptables and nftables build and check the test
/// sandboxes (iptables for kube-proxy's reference rules); ethtool sets the checksum
/// offload and GRO of the two-node sandbox's veths; prometheus brings `promtool`,
/// which checks the agent's metrics exposition; python3-venv holds the pinned
/// `kubernetes-validate` that checks the manifests in deploy/. The packages of
/// the netfilter tools the image carries come from `netfilter_tools::TOOLS` as well.
const APT_PACKAGES: &[&str] = &[
    "rustc-web",
    "libstd-rust-web-dev-bpf",
    // clippy for rustc-web: the only clippy that can check the eBPF crate against
    // that prebuilt `core` (docs/building.md, "Lint").
    "rust-web-clippy",
    "bpftool",
    "iproute2",
    "iptables",
    "nftables",
    "ethtool",
    // `script`: the log tests give the agent a terminal with it.
    "bsdutils",
    "prometheus",
    // `cargo xtask image`: buildah builds the image (objcopy, in binutils, strips
    // the binary's debug info); tests/image.rs runs it with podman on crun, or on
    // runc where the host's cgroups are hybrid (crun refuses those), and
    // tests/capabilities.rs starts the agent under setpriv (util-linux).
    "buildah",
    "binutils",
    // The CA bundle the image carries for the API client.
    "ca-certificates",
    "podman",
    "crun",
    "runc",
    "skopeo",
    "util-linux",
    "python3-venv",
];

const BPF_LINKER: &str = "bpf-linker@0.10.0";
const BPFFS: &str = "/sys/fs/bpf";

/// Checks everything first and acts only on what is missing, so a machine that has
/// it all needs no root for this step (the tests and the demo still do).
pub fn run() -> Result<()> {
    let mut debs: Vec<&str> = APT_PACKAGES.to_vec();
    for tool in crate::netfilter_tools::TOOLS {
        if !debs.contains(&tool.deb) {
            debs.push(tool.deb);
        }
    }
    let missing_debs: Vec<&str> = debs.into_iter().filter(|p| !deb_installed(p)).collect();
    let linker_missing = !bpf_linker_works();
    let bpffs_missing = !bpffs_mounted()?;
    let validator_missing = !Path::new(KUBERNETES_VALIDATE).is_file();
    if missing_debs.is_empty() && !linker_missing && !bpffs_missing && !validator_missing {
        println!("setup: Debian packages, bpf-linker, kubernetes-validate and bpffs are in place");
        return Ok(());
    }
    let mut todo = Vec::new();
    if !missing_debs.is_empty() {
        todo.push(format!("Debian packages {}", missing_debs.join(" ")));
    }
    if linker_missing {
        todo.push(BPF_LINKER.to_owned());
    }
    if bpffs_missing {
        todo.push(format!("a bpffs mount on {BPFFS}"));
    }
    if validator_missing {
        todo.push(format!(
            "kubernetes-validate {KUBERNETES_VALIDATE_VERSION} in {KUBERNETES_VALIDATE_VENV}"
        ));
    }
    require_root().with_context(|| {
        format!(
            "this machine lacks {}; installing that needs root",
            todo.join(", ")
        )
    })?;
    if !missing_debs.is_empty() {
        println!(
            "setup: installing Debian packages: {}",
            missing_debs.join(" ")
        );
        run_status(Command::new("apt-get").arg("update"))?;
        run_status(
            Command::new("apt-get")
                .args(["install", "-y"])
                .args(&missing_debs)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    if linker_missing {
        println!("setup: installing {BPF_LINKER} (about a minute and a half)");
        run_status(crate::cargo().args(["install", BPF_LINKER, "--locked"]))?;
    }
    if validator_missing {
        println!(
            "setup: installing kubernetes-validate {KUBERNETES_VALIDATE_VERSION} (PyPI) into {KUBERNETES_VALIDATE_VENV}"
        );
        run_status(Command::new(crate::DEBIAN_PYTHON).args([
            "-m",
            "venv",
            KUBERNETES_VALIDATE_VENV,
        ]))?;
        run_status(
            Command::new(format!("{KUBERNETES_VALIDATE_VENV}/bin/pip"))
                .args(["install", "--quiet"])
                .arg(format!(
                    "kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}"
                )),
        )?;
    }
    if bpffs_missing {
        println!("setup: mounting bpffs on {BPFFS}");
        if !Path::new(BPFFS).is_dir() {
            bail!("{BPFFS} does not exist; is sysfs mounted?");
        }
        run_status(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
    }
    Ok(())
}

fn deb_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Status}", package])
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout == b"installed")
}

fn bpf_linker_works() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn bpffs_mounted() -> Result<bool> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").context("read /proc/self/mounts")?;
    Ok(mounts.lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1) == Some(&BPFFS) && fields.get(2) == Some(&"bpf")
    }))
}
