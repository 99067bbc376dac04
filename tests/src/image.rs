//! Where `cargo xtask image` writes the agent's container image, so that the
//! image test finds what the build wrote.

use std::path::{Path, PathBuf};

/// The image's repository name; deploy/daemonset.yaml names `ebpf-proxy:<version>`.
pub const REPOSITORY: &str = "ebpf-proxy";

/// `ebpf-proxy:<version>`.
pub fn reference(version: &str) -> String {
    format!("{REPOSITORY}:{version}")
}

/// The directory under the cargo target directory that holds the archives.
pub fn dir(target: &Path) -> PathBuf {
    target.join("image")
}

/// The architecture the image is built for by default, the host's.
pub const HOST_ARCH: &str = "amd64";

/// The binary's name in the image, as deploy/daemonset.yaml's `command`
/// names it, and kube-proxy's name, a link to it.
pub const BIN_IN_IMAGE: &str = "/usr/local/bin/ebpf-proxy";
pub const KUBE_PROXY_IN_IMAGE: &str = "/usr/local/bin/kube-proxy";

/// The OCI archive (`skopeo copy oci-archive:...`, `podman load`).
pub fn oci_archive(target: &Path, version: &str) -> PathBuf {
    oci_archive_for(target, version, HOST_ARCH)
}

/// The docker-archive (`ctr images import`, `kind load image-archive`, `docker load`):
/// its manifest names the tag, which containerd imports under that name.
pub fn docker_archive(target: &Path, version: &str) -> PathBuf {
    docker_archive_for(target, version, HOST_ARCH)
}

/// `ebpf-proxy-<version>[-<arch>]`: the host's architecture has no suffix.
fn stem(version: &str, arch: &str) -> String {
    if arch == HOST_ARCH {
        format!("{REPOSITORY}-{version}")
    } else {
        format!("{REPOSITORY}-{version}-{arch}")
    }
}

/// The OCI archive of the image for `arch` (amd64, arm64).
pub fn oci_archive_for(target: &Path, version: &str, arch: &str) -> PathBuf {
    dir(target).join(format!("{}.oci.tar", stem(version, arch)))
}

/// The docker-archive of the image for `arch`.
pub fn docker_archive_for(target: &Path, version: &str, arch: &str) -> PathBuf {
    dir(target).join(format!("{}.docker.tar", stem(version, arch)))
}
