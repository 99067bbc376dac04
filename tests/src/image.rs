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

/// The OCI archive (`skopeo copy oci-archive:...`, `podman load`).
pub fn oci_archive(target: &Path, version: &str) -> PathBuf {
    dir(target).join(format!("{REPOSITORY}-{version}.oci.tar"))
}

/// The docker-archive (`ctr images import`, `kind load image-archive`, `docker load`):
/// its manifest names the tag, which containerd imports under that name.
pub fn docker_archive(target: &Path, version: &str) -> PathBuf {
    dir(target).join(format!("{REPOSITORY}-{version}.docker.tar"))
}
