//! Builds the eBPF object (proxy-ebpf) and leaves it in `OUT_DIR` for
//! `include_bytes_aligned!`. aya-build cannot be used here: it needs
//! `-Z build-std`, and no rust-src can be had on these machines. Debian's
//! `rustc-web` ships a prebuilt `core` for bpfel-unknown-none instead
//! (`cargo xtask setup` installs it).

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const BPF_RUSTC: &str = "/usr/bin/rustc";
const TARGET: &str = "bpfel-unknown-none";

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let object = out_dir.join("proxy-ebpf.o");
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let ebpf_dir = manifest_dir.join("../proxy-ebpf");
    let common_dir = manifest_dir.join("../proxy-common");
    for dir in [ebpf_dir.join("src"), common_dir.join("src")] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        ebpf_dir.join("Cargo.toml").display()
    );
    println!("cargo:rerun-if-env-changed=EBPF_PROXY_SKIP_EBPF_BUILD");
    println!("cargo:rerun-if-env-changed=EBPF_PROXY_NO_SERVICE_COUNTERS");

    // For working on pure user-space code on a machine without the BPF
    // toolchain: the agent then fails at load time, saying why.
    if env::var_os("EBPF_PROXY_SKIP_EBPF_BUILD").is_some() {
        std::fs::write(&object, b"").expect("write empty object");
        println!("cargo:warning=EBPF_PROXY_SKIP_EBPF_BUILD set: the agent has no eBPF object");
        return;
    }
    // A fresh machine has neither: `cargo xtask setup`, which installs
    // them, is itself built against this crate, so it must build without
    // them. The object is left empty (the agent then says why at load),
    // and a path that never exists makes cargo run this script again on
    // every build until the toolchain is there.
    if let Some(missing) = missing_toolchain() {
        std::fs::write(&object, b"").expect("write empty object");
        println!(
            "cargo:rerun-if-changed={}",
            out_dir.join("ebpf-toolchain-missing").display()
        );
        println!(
            "cargo:warning={missing} not found: this build carries no eBPF object. Run `cargo \
             xtask setup` (or apt-get install rustc-web libstd-rust-web-dev-bpf; cargo install \
             bpf-linker@0.10.0 --locked), then build again."
        );
        return;
    }

    let target_dir = out_dir.join("ebpf-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&ebpf_dir)
        .args(["build", "--release", "--target", TARGET, "--target-dir"])
        .arg(&target_dir);
    // The Service counters compiled out: for the datapath benchmark's
    // measure of what they cost.
    if env::var_os("EBPF_PROXY_NO_SERVICE_COUNTERS").is_some() {
        cmd.arg("--no-default-features");
    }
    // The outer build's compiler settings must not leak into the BPF build.
    for var in [
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
    ] {
        cmd.env_remove(var);
    }
    for (key, _) in env::vars_os() {
        if key.to_string_lossy().starts_with("CARGO_PROFILE_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("RUSTC", BPF_RUSTC)
        // aya-ebpf uses #![feature(asm_experimental_arch)].
        .env("RUSTC_BOOTSTRAP", "1")
        // BTF for the maps' key and value types (pretty `bpftool map dump`).
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            "-Cdebuginfo=2\x1f-Clink-arg=--btf",
        );
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running cargo for the eBPF crate: {e}"));
    assert!(
        status.success(),
        "building proxy-ebpf for {TARGET} failed ({status}); is bpf-linker installed? \
         (`cargo xtask setup`)"
    );
    let built = target_dir.join(TARGET).join("release").join("proxy-ebpf");
    std::fs::copy(&built, &object)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", built.display(), object.display()));
}

/// The first tool of the eBPF build that is not installed: Debian's
/// rustc-web at `BPF_RUSTC`, or `bpf-linker` on `PATH`.
fn missing_toolchain() -> Option<&'static str> {
    if !Path::new(BPF_RUSTC).exists() {
        return Some(BPF_RUSTC);
    }
    let on_path = env::var_os("PATH")
        .is_some_and(|path| env::split_paths(&path).any(|dir| dir.join("bpf-linker").is_file()));
    (!on_path).then_some("bpf-linker")
}
