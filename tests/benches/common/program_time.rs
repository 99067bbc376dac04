//! What an agent's packet programs cost on real traffic: the kernel's own run count and
//! run time of each program (`BPF_ENABLE_STATS`), summed by hook over the programs that
//! use the agent's pinned maps. Shared by the benches that time a datapath on real
//! packets (`nodeport`, `e2e`).

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::maps::MapData;
use aya_obj::generated::bpf_prog_type;
use proxy_userspace::datapath::PinLayout;

/// Runs and run time of a set of BPF programs, as the kernel counts them.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProgramTime {
    pub runs: u64,
    pub ns: u64,
}

impl ProgramTime {
    pub fn since(self, before: ProgramTime) -> ProgramTime {
        ProgramTime {
            runs: self.runs.saturating_sub(before.runs),
            ns: self.ns.saturating_sub(before.ns),
        }
    }

    pub fn add(&mut self, other: ProgramTime) {
        self.runs += other.runs;
        self.ns += other.ns;
    }
}

/// An agent's packet programs, by hook.
#[derive(Debug, Clone, Copy, Default)]
pub struct HookTimes {
    /// How many packet programs (XDP and tc) were found: those using the agent's maps.
    pub programs: u32,
    pub xdp: ProgramTime,
    pub tc: ProgramTime,
    /// The socket hooks (cgroup programs), which [`HookTimes::runs`] and
    /// [`HookTimes::ns`] leave out: they run for every process under their cgroup,
    /// which a bench's clients may share with the agent's node.
    pub sock: ProgramTime,
}

impl HookTimes {
    pub fn since(self, before: HookTimes) -> HookTimes {
        HookTimes {
            programs: self.programs,
            xdp: self.xdp.since(before.xdp),
            tc: self.tc.since(before.tc),
            sock: self.sock.since(before.sock),
        }
    }

    /// Adds `other`'s runs and run time; the programs found are `other`'s count, the
    /// later sample's, since a count of programs does not add up over samples.
    pub fn add(&mut self, other: HookTimes) {
        self.programs = other.programs;
        self.xdp.add(other.xdp);
        self.tc.add(other.tc);
        self.sock.add(other.sock);
    }

    /// The packet programs' runs (XDP and tc).
    pub fn runs(&self) -> u64 {
        self.xdp.runs + self.tc.runs
    }

    /// The packet programs' run time (XDP and tc).
    pub fn ns(&self) -> u64 {
        self.xdp.ns + self.tc.ns
    }

    /// The packet programs' mean time a run.
    pub fn ns_per_run(&self) -> f64 {
        self.ns() as f64 / self.runs().max(1) as f64
    }
}

/// The programs of the agent pinned under `bpf_root`: those that use any map pinned
/// there (another agent on the machine has maps of its own), by hook. The kernel counts
/// only while its statistics are on (`aya::sys::enable_stats`).
pub fn agent_programs(bpf_root: &Path) -> Result<HookTimes> {
    let mut map_ids = HashSet::new();
    for maps_dir in maps_dirs(bpf_root)? {
        for entry in
            std::fs::read_dir(&maps_dir).with_context(|| format!("list {}", maps_dir.display()))?
        {
            let path = entry?.path();
            let id = MapData::from_pin(&path)
                .and_then(|map| map.info())
                .with_context(|| format!("the id of {}", path.display()))?
                .id();
            map_ids.insert(id);
        }
    }
    if map_ids.is_empty() {
        bail!("no map pinned under {}", bpf_root.display());
    }
    let mut times = HookTimes::default();
    for info in aya::programs::loaded_programs() {
        let info = info.context("list the loaded BPF programs")?;
        let (hook, packets) = match info.program_type() {
            bpf_prog_type::BPF_PROG_TYPE_XDP => (&mut times.xdp, true),
            bpf_prog_type::BPF_PROG_TYPE_SCHED_CLS => (&mut times.tc, true),
            bpf_prog_type::BPF_PROG_TYPE_CGROUP_SOCK_ADDR
            | bpf_prog_type::BPF_PROG_TYPE_CGROUP_SOCK => (&mut times.sock, false),
            _ => continue,
        };
        let uses_agents_maps = info
            .map_ids()
            .context("a program's map ids")?
            .is_some_and(|ids| ids.iter().any(|id| map_ids.contains(id)));
        if uses_agents_maps {
            hook.runs += info.run_count();
            hook.ns += u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX);
            times.programs += u32::from(packets);
        }
    }
    Ok(times)
}

/// The directories of map pins under `bpf_root`: this layout's
/// ([`PinLayout::maps_dir`]), or the `maps` directories of an older agent's layout
/// when a bench measures one.
fn maps_dirs(bpf_root: &Path) -> Result<Vec<PathBuf>> {
    let current = PinLayout::new(bpf_root).maps_dir();
    if current.is_dir() {
        return Ok(vec![current]);
    }
    let mut dirs = Vec::new();
    let mut pending = vec![bpf_root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).with_context(|| format!("list {}", dir.display()))? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                if entry.file_name() == "maps" {
                    dirs.push(entry.path());
                } else {
                    pending.push(entry.path());
                }
            }
        }
    }
    Ok(dirs)
}
