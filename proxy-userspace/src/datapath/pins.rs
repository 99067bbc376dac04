//! Where the datapath lives on bpffs.
//!
//! ```text
//! <root>/v<LAYOUT_VERSION>/maps/<MAP>            pinned maps
//! <root>/v<LAYOUT_VERSION>/links/tc-ingress-<if> pinned tc links
//! <root>/v<LAYOUT_VERSION>/tail_calls/<MAP>-of-tc_ingress-<id>
//!                                                the program arrays (`TC_NEXT`,
//!                                                `TC_DSR`) the `tc_ingress` of
//!                                                that program id reads, kept
//!                                                while it is linked
//! <root>/v<LAYOUT_VERSION>/links/cgroup-<hook>  the socket hooks' links
//! <root>/v<LAYOUT_VERSION>/iters/SOCK_NOTES      reading it lists the socket
//!                                                hooks' notes (`sock_notes`)
//! <root>/v<LAYOUT_VERSION>/iters/SOCK_NOTES6     the same, of IPv6 backends
//! ```
//! The layout version is in the path because aya reuses a pin without
//! checking its key and value sizes.

use std::path::{Path, PathBuf};

use proxy_common::LAYOUT_VERSION;

/// Between a program array's name and the id of the `tc_ingress` that
/// reads it, in its pin's name (`PinLayout::tail_call`).
const TAIL_CALL_READER: &str = "-of-tc_ingress-";

/// Default `--bpf-root`.
pub const DEFAULT_BPF_ROOT: &str = "/sys/fs/bpf/ebpf-proxy";

#[derive(Clone, Debug)]
pub struct PinLayout {
    root: PathBuf,
}

impl PinLayout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn versioned(&self) -> PathBuf {
        self.root.join(format!("v{LAYOUT_VERSION}"))
    }

    /// The layout directories under the root other than this version's:
    /// left by agents of other versions.
    pub fn other_layouts(&self) -> Vec<PathBuf> {
        let current = self.versioned();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|dir| Self::layout_version(dir).is_some() && *dir != current)
            .collect()
    }

    /// The layout version a `v<N>` directory is named for.
    pub fn layout_version(dir: &Path) -> Option<u32> {
        dir.file_name()?.to_str()?.strip_prefix('v')?.parse().ok()
    }

    /// Where the layout directory `layout` keeps its maps.
    pub fn maps_in(layout: &Path) -> PathBuf {
        layout.join("maps")
    }

    /// Where the layout directory `layout` keeps its links.
    pub fn links_in(layout: &Path) -> PathBuf {
        layout.join("links")
    }

    pub fn maps_dir(&self) -> PathBuf {
        Self::maps_in(&self.versioned())
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.maps_dir().join(name)
    }

    pub fn links_dir(&self) -> PathBuf {
        Self::links_in(&self.versioned())
    }

    /// This version's directories of pins, links first: what the agent
    /// makes at load and `cleanup` empties.
    pub fn dirs(&self) -> [PathBuf; 4] {
        [
            self.links_dir(),
            self.maps_dir(),
            self.iters_dir(),
            self.tail_calls_dir(),
        ]
    }

    /// Where the pinned `TC_NEXT` and `TC_DSR` arrays are (`tail_calls`).
    pub fn tail_calls_dir(&self) -> PathBuf {
        self.versioned().join("tail_calls")
    }

    /// The pin of the program array `map` (`TC_NEXT`, `TC_DSR`) that the
    /// `tc_ingress` of id `tc_ingress` reads.
    pub fn tail_call(&self, map: &str, tc_ingress: u32) -> PathBuf {
        self.tail_calls_dir()
            .join(format!("{map}{TAIL_CALL_READER}{tc_ingress}"))
    }

    /// The id of the `tc_ingress` that reads the program array pinned as
    /// `name` in `tail_calls_dir` (`tail_call`); None for a name of another
    /// form, such as an earlier release's `TC_NEXT-<array id>`.
    pub fn tail_call_reader(name: &str) -> Option<u32> {
        name.split_once(TAIL_CALL_READER)?.1.parse().ok()
    }

    pub fn iters_dir(&self) -> PathBuf {
        self.versioned().join("iters")
    }

    /// The pinned iterator over the socket hooks' notes (`sock_notes`).
    pub fn sock_notes(&self) -> PathBuf {
        self.iters_dir().join(proxy_common::map_names::SOCK_NOTES)
    }

    /// The pinned iterator over the socket hooks' notes of IPv6 backends.
    pub fn sock_notes6(&self) -> PathBuf {
        self.iters_dir().join(proxy_common::map_names::SOCK_NOTES6)
    }

    /// The link of socket hook `hook` (`connect4`, ...) on the cgroup root.
    pub fn cgroup_link(&self, hook: &str) -> PathBuf {
        self.links_dir().join(format!("cgroup-{hook}"))
    }

    pub fn tc_ingress_link(&self, ifname: &str) -> PathBuf {
        self.links_dir().join(format!("tc-ingress-{ifname}"))
    }

    /// Where earlier releases linked `tc_ingress6` on `ifname`, after
    /// `tc_ingress_link`'s: removed where found (`Datapath::attach`).
    pub fn tc_ingress6_link(&self, ifname: &str) -> PathBuf {
        self.links_dir().join(format!("tc-ingress6-{ifname}"))
    }

    pub fn xdp_link(&self, ifname: &str) -> PathBuf {
        self.links_dir().join(format!("xdp-{ifname}"))
    }

    /// Interface name of a link pin, if `file_name` is one.
    pub fn ifname_of_link(file_name: &str) -> Option<&str> {
        file_name.strip_prefix("tc-ingress-")
    }
}

/// True when `path` is on a bpf filesystem (pins elsewhere fail, and a
/// plain directory at /sys/fs/bpf is a common setup mistake).
pub fn is_bpffs(path: &Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_call_pin_names_the_tc_ingress_that_reads_it() {
        let pins = PinLayout::new("/sys/fs/bpf/x");
        let pin = pins.tail_call("TC_DSR", 4242);
        let name = pin
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a file name");
        assert_eq!(name, "TC_DSR-of-tc_ingress-4242");
        assert_eq!(pin.parent(), Some(pins.tail_calls_dir().as_path()));
        assert_eq!(PinLayout::tail_call_reader(name), Some(4242));
        // An earlier release named the array itself: no reader to ask about.
        assert_eq!(PinLayout::tail_call_reader("TC_NEXT-117961"), None);
    }
}
