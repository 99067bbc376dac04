// Rebuild when bpf-linker changes: it is the linker of this crate.
fn main() {
    if let Some(path) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("bpf-linker"))
            .find(|p| p.exists())
    }) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
