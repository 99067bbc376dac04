//! The agent built for an architecture other than the host's, for
//! `cargo xtask image --arch`: rustup's standard library for the target,
//! Debian's cross gcc as linker (and as C compiler for ring), Debian's cross
//! glibc to link against and to put in the image. The eBPF object is the same
//! for every architecture: proxy-userspace's build script builds it as for
//! the host.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Result, bail};
use ebpf_proxy_tests::run_cmd;

use crate::{cargo, run_status, target_dir};

/// A cross toolchain and where its pieces are.
#[derive(Debug)]
pub struct Cross {
    pub rust_target: &'static str,
    /// The C compiler, which also links.
    pub gcc: &'static str,
    pub ar: &'static str,
    /// Strips the agent's debug info.
    pub objcopy: &'static str,
    /// Where the cross packages put the target's glibc and `libgcc_s`.
    pub sysroot_lib: &'static str,
    /// Where the target's loader looks for them in the image (Debian's
    /// multiarch directory, the first of its built-in paths).
    pub lib_in_image: &'static str,
    /// The Debian packages that bring `gcc`, `objcopy` and `sysroot_lib`.
    pub debs: &'static [&'static str],
}

pub const ARM64: Cross = Cross {
    rust_target: "aarch64-unknown-linux-gnu",
    gcc: "/usr/bin/aarch64-linux-gnu-gcc",
    ar: "/usr/bin/aarch64-linux-gnu-ar",
    objcopy: "/usr/bin/aarch64-linux-gnu-objcopy",
    sysroot_lib: "/usr/aarch64-linux-gnu/lib",
    lib_in_image: "/lib/aarch64-linux-gnu",
    debs: &["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross"],
};

impl Cross {
    pub fn packages_hint(&self) -> String {
        format!("apt-get install {}", self.debs.join(" "))
    }

    /// What this machine lacks of the toolchain, each with how to get it.
    fn missing(&self) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        let sysroot = run_cmd(Command::new(rustc()).args(["--print", "sysroot"]))?;
        let std = Path::new(sysroot.trim())
            .join("lib/rustlib")
            .join(self.rust_target);
        if !std.is_dir() {
            missing.push(format!(
                "Rust's standard library for {} (`rustup target add {}`)",
                self.rust_target, self.rust_target
            ));
        }
        for path in [self.gcc, self.ar, self.objcopy, self.sysroot_lib] {
            if !Path::new(path).exists() {
                missing.push(format!("{path} (`{}`)", self.packages_hint()));
            }
        }
        Ok(missing)
    }
}

/// The compiler cargo runs.
fn rustc() -> std::ffi::OsString {
    std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into())
}

/// `cargo build --release -p proxy-userspace --target ...` with the cross
/// linker; the binary's path.
pub fn build(cross: &Cross) -> Result<PathBuf> {
    crate::setup::run()?;
    let missing = cross.missing()?;
    if !missing.is_empty() {
        bail!(
            "building for {} needs {}",
            cross.rust_target,
            missing.join("; ")
        );
    }
    let env_target = cross.rust_target.replace('-', "_");
    run_status(
        cargo()
            .args(["build", "--release", "-p", "proxy-userspace", "--target"])
            .arg(cross.rust_target)
            .env(
                format!("CARGO_TARGET_{}_LINKER", env_target.to_uppercase()),
                cross.gcc,
            )
            .env(format!("CC_{env_target}"), cross.gcc)
            .env(format!("AR_{env_target}"), cross.ar),
    )?;
    let bin = target_dir()
        .join(cross.rust_target)
        .join("release/ebpf-proxy");
    if !bin.is_file() {
        bail!(
            "the build succeeded but {} does not exist; has the binary another name?",
            bin.display()
        );
    }
    println!("agent binary ({}): {}", cross.rust_target, bin.display());
    Ok(bin)
}
