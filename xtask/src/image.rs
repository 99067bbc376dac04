//! `cargo xtask image`: the agent's OCI image, built with buildah from
//! `scratch`, without a container daemon and without downloading anything.
//!
//! The root filesystem is the release binary (debug info stripped) and exactly
//! the shared libraries `ldd` says it links, glibc's loader among them, and
//! Debian's CA bundle (the API client will not start without one, even when
//! the cluster's own CA comes from the kubeconfig), and the netfilter tools the
//! agent runs to take a node over from kube-proxy and to hand it back
//! (proxy-userspace's `adopt::rules`: `netfilter_tools::TOOLS`, iptables' extension modules
//! and every library those link); no Debian root. The agent execs nothing
//! else, so a shell or a package manager would only be more to patch and more
//! to exploit in a process that holds `CAP_BPF` and `CAP_NET_ADMIN`; and the
//! libraries come from this machine, where the binary was linked against
//! them, so they cannot drift apart. Name
//! lookups need nothing more: glibc 2.34 and later carry the `files` and `dns`
//! NSS modules inside libc.so.6, and the kubelet mounts /etc/hosts and
//! /etc/resolv.conf.
//!
//! `/usr/local/bin/kube-proxy` is a symbolic link to the agent, which run
//! under that name behaves as `ebpf-proxy run`: swapping the image in
//! kube-proxy's own DaemonSet (whose command is `/usr/local/bin/kube-proxy
//! --config=...`) is a migration.
//!
//! The image carries the OCI annotations and labels `org.opencontainers.image.*`:
//! title, description, version (proxy-userspace's), licenses (the
//! workspace's SPDX expression), revision (the git commit, `-dirty` when the
//! tree has changes), created (that commit's time, which is also every
//! timestamp in the image: the same commit makes the same image) and source
//! (`--source`, else the `origin` remote's URL; left out, saying so, when
//! there is neither).
//!
//! `--arch arm64` builds the agent for aarch64-unknown-linux-gnu (the eBPF
//! object is the same for every architecture) with Debian's cross gcc as
//! linker, and takes the libraries from Debian's arm64 cross packages, by
//! the ELF's needs (`ldd` cannot run a foreign binary); it needs the Rust
//! target and those packages, and says how to get them when one is missing.
//! The arm64 image has no netfilter tools: Debian has no cross packages of
//! iptables, nftables or iproute2 (only arm64 ones, which would need arm64
//! added to this machine's dpkg architectures), so there the agent's takeover
//! skips each backend with its warning that the tool is missing, and
//! `cleanup --handoff` cannot remove its nft table.
//!
//! buildah keeps its storage in a directory of its own under the target
//! directory (vfs driver: no overlay mounts to leave behind), removed
//! afterwards; the results are two archives of the image tagged
//! `ebpf-proxy:<version of proxy-userspace>`: an OCI archive for skopeo and
//! podman, and a docker-archive for `ctr images import` and
//! `kind load image-archive` (containerd names an imported image after the
//! tag in a docker-archive's manifest). arm64's archive names end in `-arm64`.

use std::{
    fs,
    os::unix::fs::{PermissionsExt, symlink},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use ebpf_proxy_tests::{image, run_cmd};

use crate::{cargo, netfilter_tools::TOOLS, run_status, target_dir, workspace_root};

mod cross;

/// Where the agent lives in the image (deploy/daemonset.yaml's `command`
/// names it), and kube-proxy's path in its own image, a link to the agent
/// (which run as `kube-proxy` is `ebpf-proxy run`).
use image::{BIN_IN_IMAGE, KUBE_PROXY_IN_IMAGE};

/// Debian's CA bundle (package ca-certificates), where rustls's native
/// certificate loader looks first.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// iptables' extension modules (package iptables), one per match and target
/// (`comment`, `statistic`, `recent`, `mark`, `addrtype`, `conntrack`,
/// `MASQUERADE`, `DNAT`, `REJECT`, `MARK`, ... in kube-proxy's rules), which
/// libxtables loads from this compiled-in directory to read and write a rule.
const XTABLES_MODULES: &str = "/usr/lib/x86_64-linux-gnu/xtables";

const TITLE: &str = "ebpf-proxy";
const DESCRIPTION: &str = "eBPF replacement for kube-proxy";

/// The architectures the image is built for, by their OCI names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    /// The OCI (and Debian) name.
    pub fn oci(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }
}

/// What `cargo xtask image` was asked for.
#[derive(Clone, Debug)]
pub struct Options {
    pub arch: Arch,
    /// `org.opencontainers.image.source`; the `origin` remote's URL when None.
    pub source: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            arch: Arch::Amd64,
            source: None,
        }
    }
}

/// Builds the image from the agent binary `bin` (built for `options.arch`);
/// returns the OCI archive's path.
pub fn build(bin: &Path, options: &Options) -> Result<PathBuf> {
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
    let (tools, libs) = match options.arch {
        Arch::Amd64 => {
            let tools = Contents::netfilter_tools()?;
            let mut libs = linked_libraries(bin)?;
            libs.extend(tools.libraries()?);
            (tools, dedup(libs))
        }
        Arch::Arm64 => {
            eprintln!(
                "warning: the arm64 image has no netfilter tools (Debian has no cross packages of them): \
                 the agent's takeover skips kube-proxy's rules there"
            );
            (Contents::default(), cross_libraries(bin, &cross::ARM64)?)
        }
    };
    let objcopy = match options.arch {
        Arch::Amd64 => "objcopy",
        Arch::Arm64 => cross::ARM64.objcopy,
    };
    assemble_rootfs(bin, objcopy, &libs, &tools, &rootfs)?;
    let metadata = Metadata::of_this_tree(&version, options.source.clone())?;

    let buildah = Buildah { storage };
    let oci = image::oci_archive_for(&target, &version, options.arch.oci());
    let docker = image::docker_archive_for(&target, &version, options.arch.oci());
    let result = buildah.build(
        &rootfs,
        &reference,
        options.arch,
        &metadata,
        &[("oci-archive", &oci), ("docker-archive", &docker)],
    );
    // The archives are what is kept; buildah's storage and the root filesystem
    // are rebuilt every time.
    buildah.remove_storage();
    let _ = fs::remove_dir_all(&rootfs);
    result?;
    println!(
        "image {reference} ({}, {}):\n  {}\n  {}",
        options.arch.oci(),
        metadata.revision,
        oci.display(),
        docker.display()
    );
    Ok(oci)
}

/// Builds the agent for `arch` in release; the host's is `crate::build`'s.
pub fn build_agent(arch: Arch) -> Result<PathBuf> {
    match arch {
        Arch::Amd64 => crate::build(),
        Arch::Arm64 => cross::build(&cross::ARM64),
    }
}

/// The `org.opencontainers.image.*` values.
#[derive(Debug)]
struct Metadata {
    version: String,
    revision: String,
    /// RFC 3339, and as seconds since the epoch for buildah's `--timestamp`.
    created: (String, u64),
    source: Option<String>,
    licenses: String,
}

impl Metadata {
    fn of_this_tree(version: &str, source: Option<String>) -> Result<Metadata> {
        let root = workspace_root();
        let git = |args: &[&str]| {
            run_cmd(Command::new("git").arg("-C").arg(&root).args(args))
                .map(|out| out.trim().to_owned())
        };
        let commit = git(&["rev-parse", "HEAD"])?;
        let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])?.is_empty();
        let created_secs: u64 = git(&["log", "-1", "--format=%ct", "HEAD"])?
            .parse()
            .context("the commit's time")?;
        let created = run_cmd(
            Command::new("git")
                .arg("-C")
                .arg(&root)
                .args([
                    "log",
                    "-1",
                    "--date=format-local:%Y-%m-%dT%H:%M:%SZ",
                    "--format=%cd",
                    "HEAD",
                ])
                .env("TZ", "UTC"),
        )?
        .trim()
        .to_owned();
        let source = match source {
            Some(url) => Some(url),
            None => git(&["remote", "get-url", "origin"])
                .ok()
                .and_then(|u| https_url(&u)),
        };
        if source.is_none() {
            eprintln!(
                "warning: no `origin` remote with a URL and no --source: the image has no org.opencontainers.image.source"
            );
        }
        Ok(Metadata {
            version: version.to_owned(),
            revision: if dirty {
                format!("{commit}-dirty")
            } else {
                commit
            },
            created: (created, created_secs),
            source,
            licenses: workspace_license()?,
        })
    }

    /// `(key, value)` for every OCI annotation the image carries.
    fn annotations(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![
            ("org.opencontainers.image.title", TITLE.to_owned()),
            (
                "org.opencontainers.image.description",
                DESCRIPTION.to_owned(),
            ),
            ("org.opencontainers.image.version", self.version.clone()),
            ("org.opencontainers.image.revision", self.revision.clone()),
            ("org.opencontainers.image.created", self.created.0.clone()),
            ("org.opencontainers.image.licenses", self.licenses.clone()),
        ];
        if let Some(source) = &self.source {
            out.push(("org.opencontainers.image.source", source.clone()));
        }
        out
    }
}

/// A git remote as a browsable URL: `git@host:owner/repo.git` is
/// `https://host/owner/repo`. None for a remote that is no URL (a clone of
/// a local directory, as CI's checkout is): a path would mean nothing to
/// whoever reads the label.
fn https_url(remote: &str) -> Option<String> {
    let url = match remote.strip_prefix("git@").and_then(|r| r.split_once(':')) {
        Some((host, path)) => format!("https://{host}/{path}"),
        None if remote.contains("://") && !remote.starts_with("file://") => remote.to_owned(),
        None => return None,
    };
    Some(url.strip_suffix(".git").map_or(url.clone(), str::to_owned))
}

/// The workspace's `license` (an SPDX expression).
fn workspace_license() -> Result<String> {
    let manifest = fs::read_to_string(workspace_root().join("Cargo.toml"))?;
    manifest
        .lines()
        .skip_while(|l| l.trim() != "[workspace.package]")
        .take_while(|l| !l.starts_with("[workspace.") || l.trim() == "[workspace.package]")
        .find_map(|l| {
            let (key, value) = l.split_once('=')?;
            (key.trim() == "license").then(|| value.trim().trim_matches('"').to_owned())
        })
        .context("no license in [workspace.package]")
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

/// Files besides the agent, its libraries and the CA bundle: each tool of
/// `TOOLS` and its links, and the extension modules.
#[derive(Debug, Default)]
struct Contents {
    /// `(where it is here, where it goes in the image)`.
    files: Vec<(PathBuf, PathBuf)>,
    /// `(the link in the image, what it points to)`.
    links: Vec<(PathBuf, PathBuf)>,
}

impl Contents {
    /// `TOOLS` and [`XTABLES_MODULES`]; an error naming the package for any
    /// that is missing.
    fn netfilter_tools() -> Result<Contents> {
        let mut contents = Contents::default();
        for tool in TOOLS {
            let path = Path::new(tool.path);
            if !path.is_file() {
                bail!(
                    "{} is missing (Debian package {}; `cargo xtask setup`)",
                    tool.path,
                    tool.deb
                );
            }
            contents.files.push((path.to_owned(), path.to_owned()));
            let dir = path.parent().expect("an absolute path has a parent");
            let name = path.file_name().expect("a file name");
            for link in tool.links {
                contents.links.push((dir.join(link), PathBuf::from(name)));
            }
        }
        let modules = fs::read_dir(XTABLES_MODULES).with_context(|| {
            format!("read {XTABLES_MODULES} (Debian package iptables; `cargo xtask setup`)")
        })?;
        let mut found = Vec::new();
        for entry in modules {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "so") && path.is_file() {
                found.push(path);
            }
        }
        if found.is_empty() {
            bail!("{XTABLES_MODULES} holds no extension modules");
        }
        found.sort();
        contents
            .files
            .extend(found.into_iter().map(|p| (p.clone(), p)));
        Ok(contents)
    }

    /// What `ldd` says every file links.
    fn libraries(&self) -> Result<Vec<(PathBuf, PathBuf)>> {
        let mut libs = Vec::new();
        for (here, _) in &self.files {
            libs.extend(linked_libraries(here)?);
        }
        Ok(dedup(libs))
    }

    /// Copies the files (permissions kept) and makes the links below `root`.
    fn install(&self, root: &Path) -> Result<()> {
        for (here, in_image) in &self.files {
            let dest = within(root, in_image);
            fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
            fs::copy(here, &dest)
                .with_context(|| format!("copy {} to {}", here.display(), dest.display()))?;
        }
        for (link, target) in &self.links {
            let dest = within(root, link);
            symlink(target, &dest).with_context(|| format!("link {}", dest.display()))?;
        }
        Ok(())
    }
}

/// Each library once, by where it goes in the image, in the order first seen.
fn dedup(libs: Vec<(PathBuf, PathBuf)>) -> Vec<(PathBuf, PathBuf)> {
    let mut out: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(libs.len());
    for lib in libs {
        if !out.iter().any(|(_, in_image)| *in_image == lib.1) {
            out.push(lib);
        }
    }
    out
}

/// Each library in `libs` (`(where it is here, where the loader looks for
/// it)`), below `root`.
fn install_libraries(libs: &[(PathBuf, PathBuf)], root: &Path) -> Result<()> {
    for (lib, in_image) in libs {
        let dest = within(root, in_image);
        fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
        // fs::copy follows symbolic links (ld-linux's /lib64 path is one), so
        // the image holds the file under the name the binary asks for.
        fs::copy(lib, &dest)
            .with_context(|| format!("copy {} to {}", lib.display(), dest.display()))?;
        fs::set_permissions(&dest, fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// The binary at [`BIN_IN_IMAGE`] (stripped by `objcopy`, the one for its
/// architecture), kube-proxy's name linked to it, each library in `libs`
/// (`(where it is here, where the loader looks for it)`) and `tools`.
fn assemble_rootfs(
    bin: &Path,
    objcopy: &str,
    libs: &[(PathBuf, PathBuf)],
    tools: &Contents,
    rootfs: &Path,
) -> Result<()> {
    let dest = within(rootfs, Path::new(BIN_IN_IMAGE));
    fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
    run_status(
        Command::new(objcopy)
            .arg("--strip-debug")
            .arg(bin)
            .arg(&dest),
    )?;
    let link = within(rootfs, Path::new(KUBE_PROXY_IN_IMAGE));
    let agent_name = Path::new(BIN_IN_IMAGE)
        .file_name()
        .expect("the agent's file name");
    symlink(agent_name, &link).with_context(|| format!("link {}", link.display()))?;
    install_libraries(libs, rootfs)?;
    tools.install(rootfs)?;
    // iptables-legacy's lock, /run/xtables.lock (the DaemonSet mounts the
    // host's there, so that every writer on the node takes the same one).
    fs::create_dir_all(within(rootfs, Path::new("/run")))?;
    let dest = within(rootfs, Path::new(CA_BUNDLE));
    fs::create_dir_all(dest.parent().expect("an absolute path has a parent"))?;
    fs::copy(CA_BUNDLE, &dest).with_context(|| {
        format!("copy {CA_BUNDLE} (Debian package ca-certificates; `cargo xtask setup`)")
    })?;
    println!(
        "image root: {BIN_IN_IMAGE}, {KUBE_PROXY_IN_IMAGE} -> {}, {CA_BUNDLE}, {}; {} tool files and {} links",
        agent_name.display(),
        libs.iter()
            .map(|(_, l)| l.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        tools.files.len(),
        tools.links.len(),
    );
    Ok(())
}

/// The shared objects `ldd` resolves for `bin`, the loader included; an error
/// for any it cannot find (the image would not start).
fn linked_libraries(bin: &Path) -> Result<Vec<(PathBuf, PathBuf)>> {
    let out = run_cmd(Command::new("ldd").arg(bin))?;
    Ok(parse_ldd(&out)
        .with_context(|| format!("the libraries of {}", bin.display()))?
        .into_iter()
        .map(|lib| (lib.clone(), lib))
        .collect())
}

/// A foreign binary's libraries, from its ELF (`readelf`): its interpreter
/// and every `NEEDED` library, transitively, found in the cross packages'
/// directory and placed where that architecture's loader looks.
fn cross_libraries(bin: &Path, arch: &cross::Cross) -> Result<Vec<(PathBuf, PathBuf)>> {
    let interpreter = elf_interpreter(&run_cmd(Command::new("readelf").arg("-lW").arg(bin))?)
        .context("the agent names no ELF interpreter; is it linked statically?")?;
    let name = |p: &Path| p.file_name().expect("a file name").to_owned();
    let mut libs = vec![(
        Path::new(arch.sysroot_lib).join(name(&interpreter)),
        interpreter,
    )];
    let mut queue = vec![bin.to_owned()];
    while let Some(object) = queue.pop() {
        let dynamic = run_cmd(Command::new("readelf").arg("-dW").arg(&object))?;
        for needed in elf_needed(&dynamic) {
            let here = Path::new(arch.sysroot_lib).join(&needed);
            if !here.is_file() {
                bail!(
                    "{} needs {needed}, which is not in {} ({})",
                    object.display(),
                    arch.sysroot_lib,
                    arch.packages_hint()
                );
            }
            if libs.iter().any(|(h, _)| *h == here) {
                continue;
            }
            libs.push((here.clone(), Path::new(arch.lib_in_image).join(&needed)));
            queue.push(here);
        }
    }
    Ok(libs)
}

/// `[Requesting program interpreter: /lib/ld-linux-aarch64.so.1]` in
/// `readelf -l`'s output.
fn elf_interpreter(program_headers: &str) -> Option<PathBuf> {
    program_headers.lines().find_map(|l| {
        let rest = l.split_once("Requesting program interpreter: ")?.1;
        Some(PathBuf::from(rest.trim_end().trim_end_matches(']')))
    })
}

/// The `(NEEDED) Shared library: [libc.so.6]` entries of `readelf -d`.
fn elf_needed(dynamic: &str) -> Vec<String> {
    dynamic
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| {
            let rest = l.split_once("Shared library: [")?.1;
            Some(rest.split(']').next()?.to_owned())
        })
        .collect()
}

fn parse_ldd(out: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not found") {
            bail!("ldd cannot find a library: {line}");
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
        bail!("ldd lists no libraries; is it linked statically? ldd said:\n{out}");
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

    fn build(
        &self,
        rootfs: &Path,
        reference: &str,
        arch: Arch,
        metadata: &Metadata,
        archives: &[(&str, &Path)],
    ) -> Result<()> {
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
        let mut config = self.command();
        config.args([
            "config",
            "--os",
            "linux",
            "--arch",
            arch.oci(),
            "--entrypoint",
            &format!("[\"{BIN_IN_IMAGE}\"]"),
            "--cmd",
            "run",
        ]);
        // Labels in the image's configuration (what `podman inspect` and
        // `crictl inspecti` show) and annotations on its manifest (what
        // registries show).
        for (key, value) in metadata.annotations() {
            config
                .arg("--label")
                .arg(format!("{key}={value}"))
                .arg("--annotation")
                .arg(format!("{key}={value}"));
        }
        run_status(config.arg(&container))?;
        // Every timestamp is the commit's: the same commit makes the same image.
        run_status(self.command().args([
            "commit",
            "--format",
            "oci",
            "--timestamp",
            &metadata.created.1.to_string(),
            "--rm",
            &container,
            reference,
        ]))?;
        for (transport, path) in archives {
            if path.exists() {
                fs::remove_file(path).with_context(|| format!("remove {}", path.display()))?;
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
    fn readelf_output_gives_the_interpreter_and_the_needed_libraries() {
        let headers = "  INTERP         0x000238 0x0000000000000238 0x0000000000000238 0x00001b 0x00001b R   0x1\n\
                       \x20     [Requesting program interpreter: /lib/ld-linux-aarch64.so.1]\n";
        assert_eq!(
            elf_interpreter(headers),
            Some(PathBuf::from("/lib/ld-linux-aarch64.so.1"))
        );
        let dynamic = " 0x0000000000000001 (NEEDED)             Shared library: [libgcc_s.so.1]\n\
                        0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]\n\
                        0x000000000000000c (INIT)               0x1234\n";
        assert_eq!(elf_needed(dynamic), ["libgcc_s.so.1", "libc.so.6"]);
    }

    #[test]
    fn remotes_become_browsable_urls() {
        assert_eq!(
            https_url("git@github.com:owner/ebpf-proxy.git").as_deref(),
            Some("https://github.com/owner/ebpf-proxy")
        );
        assert_eq!(
            https_url("https://example.org/owner/ebpf-proxy").as_deref(),
            Some("https://example.org/owner/ebpf-proxy")
        );
        for local in [
            "/work/main",
            "../main",
            "file:///srv/git/ebpf-proxy.git",
            "",
        ] {
            assert_eq!(https_url(local), None, "{local:?} is no URL");
        }
    }

    #[test]
    fn the_licenses_are_the_workspaces() {
        assert_eq!(workspace_license().expect("license"), "MIT OR Apache-2.0");
    }

    #[test]
    fn the_tools_and_their_links_are_found_once_each() {
        let tools = Contents::netfilter_tools().expect("the tools (`cargo xtask setup`)");
        for name in [
            "nft",
            "ip",
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "ip6tables-legacy-save",
            "iptables-nft-save",
            "iptables-nft-restore",
            "ip6tables-nft-restore",
        ] {
            let path = Path::new("/usr/sbin").join(name);
            assert!(
                tools.files.iter().any(|(_, f)| *f == path)
                    || tools.links.iter().any(|(l, _)| *l == path),
                "{name} in the image"
            );
        }
        for module in [
            "libxt_comment.so",
            "libxt_statistic.so",
            "libxt_MASQUERADE.so",
        ] {
            assert!(
                tools
                    .files
                    .iter()
                    .any(|(_, f)| *f == Path::new(XTABLES_MODULES).join(module)),
                "{module}"
            );
        }
        let libs = tools.libraries().expect("ldd");
        for lib in ["libxtables.so.12", "libnftables.so.1", "libc.so.6"] {
            assert_eq!(
                libs.iter()
                    .filter(|(_, l)| l.file_name().is_some_and(|n| n == lib))
                    .count(),
                1,
                "{lib} once in {libs:?}"
            );
        }
    }

    /// kube-proxy's kinds of rules (iptables mode's matches and targets), for
    /// each iptables backend to write and read back.
    const KUBE_PROXY_RULES: &str = "*filter
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-SERVICES -d 10.96.0.20/32 -p tcp -m comment --comment \"ns/svc has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SVC-X - [0:0]
:KUBE-SEP-A - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully
-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-MARK-MASQ
-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment \"ns/svc cluster IP\" -m udp --dport 53 -j KUBE-SVC-X
-A KUBE-SVC-X -m comment --comment a -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-A
-A KUBE-SEP-A -s 10.244.0.2/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-A -p udp -m recent --set --name KUBE-SEP-A --mask 255.255.255.255 --rsource -m udp -j DNAT --to-destination 10.244.0.2:53
COMMIT
";

    /// The tools, alone with their libraries in a root of their own (what
    /// the image holds of them), in a network namespace of their own: each
    /// iptables backend writes kube-proxy's kinds of rules and reads them
    /// back, the ip6tables ones read, `nft` makes and lists a table and `ip`
    /// lists links. Needs root (skipped, saying so, without).
    #[test]
    fn the_tools_run_in_a_root_of_their_own() {
        if ebpf_proxy_tests::require_root().is_err() {
            eprintln!("skipped: needs root (unshare, chroot)");
            return;
        }
        let root = std::env::temp_dir().join(format!("xtask-image-tools-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let tools = Contents::netfilter_tools().expect("the tools");
        install_libraries(&tools.libraries().expect("ldd"), &root).expect("the libraries");
        tools.install(&root).expect("the tools");
        // The image's empty /run, where iptables-legacy takes its lock; /proc
        // for the namespace's own (/proc/net is what the legacy tools read).
        for dir in ["run", "proc"] {
            fs::create_dir_all(root.join(dir)).expect("a directory");
        }
        let rules = std::env::temp_dir().join(format!("xtask-image-rules-{}", std::process::id()));
        fs::write(&rules, KUBE_PROXY_RULES).expect("the rules");
        let r = root.display();
        let script = format!(
            "set -e
             for b in nft legacy; do
               chroot {r} /usr/sbin/iptables-$b-restore --wait=5 < {rules}
               chroot {r} /usr/sbin/iptables-$b-save > {r}/saved
               grep -q 'statistic --mode random --probability 0.5' {r}/saved
               grep -q 'recent --set --name KUBE-SEP-A' {r}/saved
               grep -q 'MASQUERADE --random-fully' {r}/saved
               grep -q 'addrtype --dst-type LOCAL' {r}/saved
               chroot {r} /usr/sbin/ip6tables-$b-save
             done
             chroot {r} /usr/sbin/nft add table ip ebpf-proxy-nat
             chroot {r} /usr/sbin/nft list tables | grep -q ebpf-proxy-nat
             chroot {r} /usr/sbin/ip link show lo",
            rules = rules.display()
        );
        let out = Command::new("unshare")
            .args(["--net", "--pid", "--fork"])
            .arg(format!("--mount-proc={}", root.join("proc").display()))
            .args(["sh", "-c", &script])
            .output()
            .expect("unshare");
        let _ = fs::remove_dir_all(&root);
        let _ = fs::remove_file(&rules);
        assert!(
            out.status.success(),
            "{}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let err = parse_ldd("\tlibfoo.so.1 => not found\n").expect_err("refused");
        assert!(err.to_string().contains("libfoo.so.1"), "{err}");
    }
}
