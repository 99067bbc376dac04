//! `cargo xtask image`: the agent's OCI image, built with buildah from
//! `scratch`, without a container daemon and without downloading anything.
//!
//! The root filesystem is the release binary (debug info stripped) and exactly
//! the shared libraries `ldd` says it links, glibc's loader among them, and
//! Debian's CA bundle (the API client will not start without one, even when
//! the cluster's own CA comes from the kubeconfig); no Debian root. The agent
//! execs nothing, so a shell or a package manager would only be more to patch
//! and more to exploit in a process that holds `CAP_BPF` and `CAP_NET_ADMIN`; and
//! the libraries come from this machine, where the binary was linked against
//! them, so they cannot drift apart. Name
//! lookups need nothing more: glibc 2.34 and later carry the `files` and `dns`
//! NSS modules inside libc.so.6, and the kubelet mounts /etc/hosts and
//! /etc/resolv.conf.
//!
//! buildah keeps its storage in a directory of its own under the target
//! directory (vfs driver: no overlay mounts to leave behind), removed
//! afterwards; the results are two archives of the image tagged
//! `ebpf-proxy:<version of proxy-userspace>`: an OCI archive for skopeo and
//! podman, and a docker-archive for `ctr images import` and
//! `kind load image-archive` (containerd names an imported image after the
//! tag in a docker-archive's manifest).

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use ebpf_proxy_tests::{image, run_cmd};

use crate::{cargo, run_status, target_dir};

/// Where the agent lives in the image; deploy/daemonset.yaml's `command` names it.
const BIN_IN_IMAGE: &str = "/usr/local/bin/ebpf-proxy";

/// Debian's CA bundle (package ca-certificates), where rustls's native
/// certificate loader looks first.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Builds the image from the agent binary `bin`; returns the OCI archive's path.
pub fn build(bin: &Path) -> Result<PathBuf> {
    let version = agent_version()?;
    let reference = image::reference(&version);
    let target = target_dir();
    let work = image::dir(&target);
    let rootfs = work.join("rootfs");
    let storage = work.join("storage");
    for dir in [&rootfs, &storage] {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
        }
    }
    fs::create_dir_all(&rootfs).with_context(|| format!("create {}", rootfs.display()))?;
    assemble_rootfs(bin, &rootfs)?;

    let buildah = Buildah { storage };
    let result = buildah.build(&rootfs, &reference, &version, &target);
    // The archives are what is kept; buildah's storage and the root filesystem
    // are rebuilt every time.
    buildah.remove_storage();
    let _ = fs::remove_dir_all(&rootfs);
    result?;
    let oci = image::oci_archive(&target, &version);
    println!(
        "image {reference}:\n  {}\n  {}",
        oci.display(),
        image::docker_archive(&target, &version).display()
    );
    Ok(oci)
}

/// proxy-userspace's version, as cargo resolves it (`path+file:///...#0.1.0`).
fn agent_version() -> Result<String> {
    let pkgid = run_cmd(cargo().args(["pkgid", "-p", "proxy-userspace"]))?;
    let version = pkgid
        .trim()
        .rsplit(['#', '@'])
        .next()
        .filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .with_context(|| format!("no version in `cargo pkgid`'s answer {pkgid:?}"))?;
    Ok(version.to_owned())
}

/// The binary at [`BIN_IN_IMAGE`] and each library `ldd` lists at the path the
/// loader looks for it.
fn assemble_rootfs(bin: &Path, rootfs: &Path) -> Result<()> {
    let libs = linked_libraries(bin)?;
    let dest = within(rootfs, Path::new(BIN_IN_IMAGE));
    fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
    run_status(
        Command::new("objcopy")
            .arg("--strip-debug")
            .arg(bin)
            .arg(&dest),
    )?;
    for lib in &libs {
        let dest = within(rootfs, lib);
        fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
        // fs::copy follows symbolic links (ld-linux's /lib64 path is one), so
        // the image holds the file under the name the binary asks for.
        fs::copy(lib, &dest)
            .with_context(|| format!("copy {} to {}", lib.display(), dest.display()))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))?;
    }
    let dest = within(rootfs, Path::new(CA_BUNDLE));
    fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
    fs::copy(CA_BUNDLE, &dest).with_context(|| {
        format!("copy {CA_BUNDLE} (Debian package ca-certificates; `cargo xtask setup`)")
    })?;
    println!(
        "image root: {BIN_IN_IMAGE}, {CA_BUNDLE} and {}",
        libs.iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The shared objects `ldd` resolves for `bin`, the loader included; an error
/// for any it cannot find (the image would not start).
fn linked_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = run_cmd(Command::new("ldd").arg(bin))?;
    parse_ldd(&out)
}

fn parse_ldd(out: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not found") {
            bail!("ldd cannot find a library the agent links: {line}");
        }
        if line == "statically linked" {
            continue;
        }
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)`,
        // `/lib64/ld-linux-x86-64.so.2 (0x...)`, `linux-vdso.so.1 (0x...)`.
        let path = match line.split_once(" => ") {
            Some((_, rest)) => rest,
            None => line,
        };
        let path = path.split(" (").next().unwrap_or(path).trim();
        if path.starts_with('/') {
            libs.push(PathBuf::from(path));
        } else if !path.starts_with("linux-vdso") {
            bail!("unexpected line in ldd's output: {line}");
        }
    }
    if libs.is_empty() {
        bail!("ldd lists no libraries; is the agent linked statically? ldd said:\n{out}");
    }
    Ok(libs)
}

/// `path` (absolute) below `root`.
fn within(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// buildah on a storage directory of its own.
struct Buildah {
    storage: PathBuf,
}

impl Buildah {
    fn command(&self) -> Command {
        let mut cmd = Command::new("buildah");
        cmd.arg("--root")
            .arg(self.storage.join("root"))
            .arg("--runroot")
            .arg(self.storage.join("run"))
            .args(["--storage-driver", "vfs"]);
        cmd
    }

    fn build(&self, rootfs: &Path, reference: &str, version: &str, target: &Path) -> Result<()> {
        let container = format!("ebpf-proxy-image-{}", std::process::id());
        run_status(
            self.command()
                .args(["from", "--name", &container, "scratch"]),
        )?;
        run_status(
            self.command()
                .args(["copy", &container])
                .arg(format!("{}/", rootfs.display()))
                .arg("/"),
        )?;
        run_status(self.command().args([
            "config",
            "--os",
            "linux",
            "--arch",
            "amd64",
            "--entrypoint",
            &format!("[\"{BIN_IN_IMAGE}\"]"),
            "--cmd",
            "run",
            "--label",
            &format!("org.opencontainers.image.version={version}"),
            "--label",
            "org.opencontainers.image.title=ebpf-proxy",
            "--label",
            "org.opencontainers.image.description=eBPF replacement for kube-proxy",
            &container,
        ]))?;
        // Timestamps pinned to the epoch: the same binary makes the same image.
        run_status(self.command().args([
            "commit",
            "--format",
            "oci",
            "--timestamp",
            "0",
            "--rm",
            &container,
            reference,
        ]))?;
        for (transport, path) in [
            ("oci-archive", image::oci_archive(target, version)),
            ("docker-archive", image::docker_archive(target, version)),
        ] {
            if path.exists() {
                fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))?;
            }
            run_status(
                self.command()
                    .args(["push", reference])
                    .arg(format!("{transport}:{}:{reference}", path.display())),
            )?;
        }
        Ok(())
    }

    fn remove_storage(&self) {
        let _ = self.command().args(["rmi", "--all", "--force"]).output();
        if let Err(e) = fs::remove_dir_all(&self.storage) {
            eprintln!(
                "warning: cannot remove buildah's storage {}: {e}",
                self.storage.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_the_files_the_loader_opens() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f1)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        assert_eq!(
            parse_ldd(out).expect("parses"),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let err = parse_ldd("\tlibfoo.so.1 => not found\n").expect_err("refused");
        assert!(err.to_string().contains("libfoo.so.1"), "{err}");
    }
}
