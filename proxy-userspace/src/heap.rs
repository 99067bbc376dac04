//! How the agent has glibc's allocator hold its heap. The agent allocates
//! most of what it keeps in its first listing and sync, among as much again
//! that lives only as long as the listing; what it holds after that is
//! mostly long-lived, so the settings favour a compact resident heap over
//! the allocator's speed on repeated large blocks.

/// Blocks this large or larger are mappings of their own, returned to the
/// system when freed. glibc's default starts at 128 KiB and grows to the
/// size of each mapped block freed (up to 32 MiB), so the tables that double
/// as the first sync fills them came from the heap once their first
/// predecessor was freed, each doubling leaving a hole there for small
/// objects to pin. Fixed at 1 MiB, the scale bench's first sync of
/// 100,000 Services leaves 8-12 MiB less resident and peaks 9-14 MiB
/// lower, in no more time (bench/README.md, "A fixed mmap threshold"); at
/// 256 KiB the sync's own large buffers cost it time.
const MMAP_THRESHOLD: libc::c_int = 1 << 20;

/// Sets the allocator up for the agent: one arena, and large blocks mapped
/// on their own ([`MMAP_THRESHOLD`]). Called first thing in `main`.
pub fn tune() {
    // One malloc arena: the agent is a handful of threads doing little
    // allocation after the initial listing, and per-thread arenas would keep
    // that listing's freed memory resident several times over.
    // SAFETY: mallopt only changes the allocator's parameters, which the
    // allocator reads under its own lock.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line of /proc/self/maps whose range holds `addr`, if any.
    fn mapping_of(addr: usize) -> Option<String> {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
        maps.lines()
            .find(|line| {
                let range = line.split_whitespace().next().unwrap_or_default();
                let (start, end) = range.split_once('-').unwrap_or_default();
                let start = usize::from_str_radix(start, 16).unwrap_or(usize::MAX);
                let end = usize::from_str_radix(end, 16).unwrap_or(0);
                (start..end).contains(&addr)
            })
            .map(str::to_owned)
    }

    /// Set in the process of its own the test runs its check in.
    const CHILD: &str = "EBPF_PROXY_HEAP_TEST_CHILD";
    const THIS_TEST: &str =
        "heap::tests::a_large_block_goes_back_to_the_system_after_a_larger_one_was_freed";

    /// In a process of its own: in the test binary's, the other tests'
    /// threads leave freed blocks in the arenas, and malloc serves a request
    /// from a free block that fits before it asks the system for one.
    #[test]
    fn a_large_block_goes_back_to_the_system_after_a_larger_one_was_freed() {
        if std::env::var_os(CHILD).is_some() {
            tune();
            large_block_goes_back();
            return;
        }
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = std::process::Command::new(exe)
            .args([THIS_TEST, "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .expect("the test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "the check, in a process of its own, failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn large_block_goes_back() {
        // Under glibc's default, freeing this raises the threshold past the
        // next block's size, which would then come from the arena and stay
        // there once freed.
        drop(std::hint::black_box(vec![1_u8; 8 << 20]));
        let block = std::hint::black_box(vec![1_u8; 2 << 20]);
        let addr = block.as_ptr() as usize;
        assert!(mapping_of(addr).is_some(), "the live block is mapped");
        drop(block);
        if let Some(mapping) = mapping_of(addr) {
            panic!("a freed block of 2 MiB is still mapped, kept by the allocator: {mapping}");
        }
    }
}
