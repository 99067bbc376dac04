//! The kernel side as the agent sees it: loading the eBPF object with its
//! maps pinned, attaching it to interfaces through pinned links, and the map
//! handles the planner writes through, and what must run around the load: a
//! conntrack map of another size set aside before and its flows carried over
//! after (`resize`), the socket notes' iterators pinned after (`iter_link`).
//! What is done with the maps' flows and the node's sockets beyond that is
//! policy, in `housekeeping`, above this.

mod attach;
pub mod batch;
mod btf_names;
mod btf_section;
mod btf_wire;
pub mod clock;
pub mod ct_reap;
pub(crate) mod detach;
pub mod event_log;
pub mod host;
pub mod interfaces;
pub mod ip_summed;
mod iter_link;
pub mod kernel_btf;
pub mod kernel_version;
pub mod maps;
pub mod netfilter_ct;
#[cfg(test)]
mod packet_calls;
pub mod pin_root;
pub mod pins;
pub mod prefilter;
pub mod prefilter_flows;
pub mod prefilter_rebuild;
pub mod program_load;
pub mod refusal_records;
pub mod reject_limit;
pub mod resize;
pub mod service_counters;
pub mod sys;
mod tail_calls;
mod write_behind;

use std::{os::unix::fs::DirBuilderExt, path::Path, time::Instant};

pub use attach::{AttachError, XdpModeSetting};
use aya::{
    Ebpf, EbpfLoader,
    programs::{CgroupSockAddr, LinkOrder, SchedClassifier, Xdp},
};
use proxy_common::{DEFAULT_SERVICE_COUNTERS, MAX_CONNTRACK, MAX_CT_NEW, map_names, program_names};

pub use self::tail_calls::TailCallError;
use self::tail_calls::TailCalls;
pub use self::{maps::Maps, pins::PinLayout, program_load::ProgramLoad};

/// The eBPF object built by build.rs from proxy-ebpf.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o"));

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "this binary carries no eBPF object (built without the eBPF toolchain, or with EBPF_PROXY_SKIP_EBPF_BUILD): run `cargo xtask setup`, then rebuild with `cargo xtask build`"
    )]
    NoObject,
    #[error(
        "{0} is not on a bpf filesystem: mount one (`mount -t bpf bpf /sys/fs/bpf`) or pick another --bpf-root"
    )]
    NotBpffs(String),
    #[error("creating pin directory {path}: {source}")]
    PinDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    PinRoot(#[from] pin_root::PinRootError),
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error(transparent)]
    Maps(#[from] maps::MapsError),
    #[error("completing the eBPF object for this kernel: {0}")]
    Patch(#[from] ip_summed::PatchError),
    #[error("completing the eBPF object's conntrack questions for this kernel: {0}")]
    NetfilterPatch(#[from] netfilter_ct::PatchError),
    #[error(transparent)]
    Resize(#[from] resize::ResizeError),
    #[error("completing the eBPF object's BTF: {0}")]
    BtfNames(#[from] btf_names::BtfNamesError),
    #[error(transparent)]
    Kernel(#[from] kernel_version::KernelVersionError),
}

/// Makes the pin directories, writable by the agent alone whatever the
/// umask, and checks them, the root and what is above it (`pin_root`) once
/// they exist, so that one made by someone else in their place meanwhile is
/// seen too.
fn make_pin_dirs(pins: &PinLayout) -> Result<(), DatapathError> {
    let mut kept = pins.dirs().to_vec();
    for dir in &kept {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|source| DatapathError::PinDir {
                path: dir.display().to_string(),
                source,
            })?;
    }
    kept.push(pins.versioned());
    pin_root::check(pins.root(), &kept)?;
    Ok(())
}

/// The sizes the agent gives the maps it sizes at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    /// Entries of a conntrack map created anew (`--conntrack-max`, two a
    /// connection).
    pub conntrack_entries: u32,
    /// Entries of `SERVICE_COUNTERS` (`--service-counters`): service ids
    /// below it are counted.
    pub service_counters: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes {
            conntrack_entries: MAX_CONNTRACK,
            service_counters: DEFAULT_SERVICE_COUNTERS,
        }
    }
}

/// Loads the object with its `ip_summed` reads completed as `read` says and
/// its questions to netfilter's conntrack as `lookup` says, maps
/// pinned at `paths` and sized as `sizes` says, and its programs, noting
/// each program's load in `loads`.
fn load_object(
    paths: &[(&'static str, std::path::PathBuf)],
    read: ip_summed::Read,
    lookup: netfilter_ct::Lookup,
    sizes: MapSizes,
    loads: &mut Vec<ProgramLoad>,
) -> Result<Ebpf, DatapathError> {
    let conntrack_entries = sizes.conntrack_entries;
    let (mut object, _) = ip_summed::complete(EBPF_OBJECT, read)?;
    netfilter_ct::complete(object.bytes_mut(), lookup)?;
    btf_names::sanitize(object.bytes_mut())?;
    // What bpftool prints, nothing the programs do: a failure is said, and
    // the maps dump as declared.
    if let Err(e) = btf_wire::retype(object.bytes_mut()) {
        tracing::warn!(error = %e, "`bpftool map dump` prints addresses and ports as numbers");
    }
    let mut loader = EbpfLoader::new();
    for (name, path) in paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader.map_max_entries(map_names::CONNTRACK, conntrack_entries);
    loader.map_max_entries(map_names::CT_NEW, MAX_CT_NEW);
    loader.map_max_entries(map_names::CONNTRACK6, conntrack_entries);
    loader.map_max_entries(map_names::CT_NEW6, MAX_CT_NEW);
    // An array must have an entry; with one, only the unused id 0 has one.
    loader.map_max_entries(map_names::SERVICE_COUNTERS, sizes.service_counters.max(1));
    let mut ebpf = loader.load(object.bytes())?;
    loaded::<SchedClassifier>(&mut ebpf, program_names::TC_INGRESS, loads)?;
    loaded::<SchedClassifier>(&mut ebpf, program_names::TC_INGRESS6, loads)?;
    loaded::<Xdp>(&mut ebpf, program_names::XDP_INGRESS, loads)?;
    loaded::<Xdp>(&mut ebpf, program_names::CLOCK_PROBE, loads)?;
    loaded::<Xdp>(&mut ebpf, program_names::CT_REAP, loads)?;
    for (name, _) in SOCKET_HOOKS {
        loaded::<CgroupSockAddr>(&mut ebpf, name, loads)?;
    }
    Ok(ebpf)
}

/// The socket hooks of the node's own connections (proxy-ebpf `sock`), and
/// the names their links are pinned under: each family's four.
const SOCKET_HOOKS: [(&str, &str); 8] = [
    (program_names::SOCK_CONNECT4, "connect4"),
    (program_names::SOCK_SENDMSG4, "sendmsg4"),
    (program_names::SOCK_RECVMSG4, "recvmsg4"),
    (program_names::SOCK_GETPEERNAME4, "getpeername4"),
    (program_names::SOCK_CONNECT6, "connect6"),
    (program_names::SOCK_SENDMSG6, "sendmsg6"),
    (program_names::SOCK_RECVMSG6, "recvmsg6"),
    (program_names::SOCK_GETPEERNAME6, "getpeername6"),
];

/// A loaded datapath: program ready to attach, maps pinned.
pub struct Datapath {
    ebpf: Ebpf,
    pins: PinLayout,
    pub maps: Maps,
    attached: std::collections::BTreeMap<String, attach::Attachment>,
    /// Interfaces tc could not be attached to: name -> ifindex, tried
    /// again by `retry_attaches`.
    tc_pending: std::collections::BTreeMap<String, u32>,
    /// Interfaces with XDP: name -> (ifindex, mode).
    xdp_attached: std::collections::BTreeMap<String, (u32, &'static str)>,
    /// Interfaces XDP is not tried on again: name -> ifindex (`decline_xdp`).
    xdp_declined: std::collections::BTreeMap<String, u32>,
    /// Interfaces XDP failed on for a reason that may pass: name ->
    /// (ifindex, mode), tried again by `retry_xdp` (`xdp_failed`).
    xdp_pending: std::collections::BTreeMap<String, (u32, XdpModeSetting)>,
    ip_summed: ip_summed::Read,
    /// How tc asks netfilter's conntrack about flows kube-proxy translated.
    netfilter_ct: netfilter_ct::Lookup,
    /// A conntrack map of another size, until its flows are all over.
    resize: Option<resize::Resize>,
    /// The same for `CONNTRACK6`.
    resize6: Option<resize::Resize>,
    tail_calls: TailCalls,
    /// What each program's load cost, in load order (see `program_load`).
    program_loads: Vec<ProgramLoad>,
}

impl Datapath {
    /// Loads the object. Maps already pinned under `pins` (from an earlier
    /// run) are reused as they are, entries included; missing ones are
    /// created and pinned. Conntrack holds `MAX_CONNTRACK` entries.
    pub fn load(pins: PinLayout) -> Result<Self, DatapathError> {
        Self::load_with_sizes(pins, MapSizes::default())
    }

    /// `load`, with a conntrack map of `conntrack_entries` entries: a pinned
    /// one of another size is replaced, and its flows carried over (see
    /// `resize`; `finish_resize` completes that once this datapath is
    /// attached).
    pub fn load_sized(pins: PinLayout, conntrack_entries: u32) -> Result<Self, DatapathError> {
        Self::load_with_sizes(
            pins,
            MapSizes {
                conntrack_entries,
                ..MapSizes::default()
            },
        )
    }

    /// `load_sized`, with every size the agent sets (`MapSizes`).
    pub fn load_with_sizes(pins: PinLayout, sizes: MapSizes) -> Result<Self, DatapathError> {
        let read = ip_summed::Read::for_this_kernel().unwrap_or_else(|e| {
            tracing::warn!(
                error = %e,
                "tc cannot read socket buffers' checksum state: it updates every L4 checksum through the kernel's helper"
            );
            ip_summed::Read::Unknown
        });
        Self::load_with(pins, read, sizes)
    }

    /// `load`, with tc's reads of the checksum state completed as `read`
    /// says: tests run the helper path with `Read::Unknown`.
    pub fn load_reading(pins: PinLayout, read: ip_summed::Read) -> Result<Self, DatapathError> {
        Self::load_with(pins, read, MapSizes::default())
    }

    fn load_with(
        pins: PinLayout,
        read: ip_summed::Read,
        sizes: MapSizes,
    ) -> Result<Self, DatapathError> {
        let conntrack_entries = sizes.conntrack_entries;
        if EBPF_OBJECT.is_empty() {
            return Err(DatapathError::NoObject);
        }
        kernel_version::check()?;
        let parent = pins.root().parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(parent).ok();
        if !pins::is_bpffs(parent) && !pins::is_bpffs(pins.root()) {
            return Err(DatapathError::NotBpffs(parent.display().to_string()));
        }
        make_pin_dirs(&pins)?;
        let paths: Vec<(&'static str, std::path::PathBuf)> = map_names::ALL
            .iter()
            .map(|name| (*name, pins.map(name)))
            .collect();
        let resize = resize::set_aside(&pins.map(map_names::CONNTRACK), conntrack_entries)?;
        let resize6 = resize::set_aside6(&pins.map(map_names::CONNTRACK6), conntrack_entries)?;
        // The report is of the load that succeeded: a refused first attempt
        // is said in its own warning.
        let mut loads = Vec::new();
        let lookup = netfilter_ct::Lookup::for_this_kernel().unwrap_or_else(|e| {
            tracing::warn!(
                error = %e,
                "tc cannot ask the kernel's conntrack: flows kube-proxy translated are not told apart from new ones"
            );
            netfilter_ct::Lookup::Absent
        });
        let (mut ebpf, read, lookup) = match load_object(&paths, read, lookup, sizes, &mut loads) {
            // A kernel whose verifier refuses the kfunc call (no JIT, say).
            Err(e @ DatapathError::Program { name, .. })
                if (name == program_names::TC_INGRESS || name == program_names::TC_INGRESS6)
                    && (read != ip_summed::Read::Unknown
                        || lookup != netfilter_ct::Lookup::Absent) =>
            {
                tracing::warn!(
                    error = %e,
                    "loading with kfunc calls failed: loading again without them"
                );
                loads.clear();
                (
                    load_object(
                        &paths,
                        ip_summed::Read::Unknown,
                        netfilter_ct::Lookup::Absent,
                        sizes,
                        &mut loads,
                    )?,
                    ip_summed::Read::Unknown,
                    netfilter_ct::Lookup::Absent,
                )
            }
            loaded => (loaded?, read, lookup),
        };
        tracing::info!("tc's read of socket buffers' checksum state: {read}");
        tracing::info!("tc's questions to the kernel's conntrack: {lookup}");
        let tail_calls = TailCalls::fill(&mut ebpf, &mut loads, &pins);
        reject_limit::write_node_limits(&mut ebpf);
        unpin_retired(&pins);
        let mut maps = Maps::take(&mut ebpf)?;
        pin_sock_notes(&mut ebpf, &maps, &pins, &mut loads);
        pin_service_counters(&maps, &pins);
        for resize in resize.iter().chain(&resize6) {
            match resize.carry(&mut maps) {
                Ok(flows) => tracing::info!(
                    from = ?resize.from,
                    to = resize.to,
                    flows,
                    "conntrack resized; its flows carried over"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "conntrack resized; its flows not carried over");
                }
            }
        }
        // Before anything is attached: the programs pass whatever the
        // prefilter does not know.
        prefilter_rebuild::write_at_load(&maps);
        let probe: &Xdp = ebpf
            .program(program_names::CLOCK_PROBE)
            .and_then(|p| p.try_into().ok())
            .expect("clock_probe was loaded above");
        // Programs read the coarse clock until a scale is in force: correct,
        // a helper call per packet slower. So a failed calibration is only
        // worth a warning.
        match clock::calibrate(probe, &mut maps.clock) {
            Ok(scale) => tracing::debug!(tick_ns = scale.tick_ns, "datapath clock calibrated"),
            Err(e) => tracing::warn!(
                error = %e,
                "datapath clock not calibrated: the datapath reads the kernel's coarse clock instead"
            ),
        }
        Ok(Self {
            ebpf,
            pins,
            maps,
            attached: std::collections::BTreeMap::default(),
            tc_pending: std::collections::BTreeMap::default(),
            xdp_attached: std::collections::BTreeMap::default(),
            xdp_declined: std::collections::BTreeMap::default(),
            xdp_pending: std::collections::BTreeMap::default(),
            ip_summed: read,
            netfilter_ct: lookup,
            resize,
            resize6,
            tail_calls,
            program_loads: loads,
        })
    }

    /// What loading each of the datapath's programs cost at `load`, in load
    /// order: the programs `load_floors` adds are not among them.
    pub fn program_loads(&self) -> &[ProgramLoad] {
        &self.program_loads
    }

    /// Holds rejects to `per_sec` a second after a burst of `burst`, in
    /// place of the node's ICMP error budget written at `load`.
    pub fn limit_rejects(
        &mut self,
        per_sec: u32,
        burst: u32,
    ) -> Result<(), reject_limit::RejectLimitError> {
        reject_limit::write(&mut self.ebpf, per_sec, burst)
    }

    /// Once this datapath's programs have taken over the links: copies the
    /// flows the older programs made into a resized conntrack since the load,
    /// and lets the older map go. None when nothing was resized.
    pub fn finish_resize(&mut self) -> Option<Result<usize, resize::ResizeError>> {
        let v6 = self.resize6.take().map(|r| r.finish(&mut self.maps));
        let v4 = self.resize.take().map(|r| r.finish(&mut self.maps));
        match (v4, v6) {
            (Some(a), Some(b)) => Some(a.and_then(|a| b.map(|b| a + b))),
            (one, other) => one.or(other),
        }
    }

    /// A reader of the datapath's log records (see `event_log`), from the
    /// pinned ring buffer the programs write to (Linux 5.8). Once only: it takes the
    /// map out of the object.
    pub fn event_logger(
        &mut self,
    ) -> Result<aya_log::EbpfLogger<event_log::ToTracing>, aya_log::Error> {
        aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, event_log::ToTracing)
    }

    /// How tc asks the kernel's conntrack about flows kube-proxy translated.
    pub fn netfilter_ct_lookup(&self) -> netfilter_ct::Lookup {
        self.netfilter_ct
    }

    /// How tc reads socket buffers' checksum state on this kernel.
    pub fn ip_summed_read(&self) -> ip_summed::Read {
        self.ip_summed
    }

    pub fn pins(&self) -> &PinLayout {
        &self.pins
    }

    /// The loaded tc program, for `BPF_PROG_TEST_RUN` in tests and benchmarks.
    pub fn tc_program(&self) -> &SchedClassifier {
        self.ebpf
            .program(program_names::TC_INGRESS)
            .and_then(|p| p.try_into().ok())
            .expect("tc program is loaded in Datapath::load")
    }

    /// Loads the programs benchmarks measure the datapath against: the
    /// do-nothing tc and XDP programs, the floors of per-packet cost (see
    /// `floors`), and the conntrack work of a new flow alone (see
    /// `ct_pairs`).
    pub fn load_floors(&mut self) -> Result<(), DatapathError> {
        // Not the agent's programs: their cost is no part of its start.
        let loads = &mut Vec::new();
        loaded::<SchedClassifier>(&mut self.ebpf, program_names::TC_PASS, loads)?;
        loaded::<Xdp>(&mut self.ebpf, program_names::XDP_PASS, loads)?;
        loaded::<SchedClassifier>(&mut self.ebpf, program_names::TC_CT_PAIR, loads)?;
        loaded::<Xdp>(&mut self.ebpf, program_names::XDP_CT_PAIR, loads)?;
        Ok(())
    }

    /// The loaded IPv6 tc program, for `BPF_PROG_TEST_RUN` in tests.
    pub fn tc6_program(&self) -> &SchedClassifier {
        self.ebpf
            .program(program_names::TC_INGRESS6)
            .and_then(|p| p.try_into().ok())
            .expect("tc6 program is loaded in Datapath::load")
    }

    fn tc_program_mut(&mut self) -> &mut SchedClassifier {
        self.ebpf
            .program_mut(program_names::TC_INGRESS)
            .and_then(|p| p.try_into().ok())
            .expect("tc program is loaded in Datapath::load")
    }

    /// Names of the interfaces the program is attached to.
    pub fn attached(&self) -> impl Iterator<Item = &str> {
        self.attached.keys().map(String::as_str)
    }

    /// Attaches at tc ingress of `ifname` (ifindex `ifindex`), taking over a
    /// pinned link from an earlier run when there is one, so traffic is never
    /// without a program.
    pub fn attach(&mut self, ifname: &str, ifindex: u32) -> Result<(), AttachError> {
        if self
            .attached
            .get(ifname)
            .is_some_and(|a| a.ifindex == ifindex)
        {
            return Ok(());
        }
        let path = self.pins.tc_ingress_link(ifname);
        let attachment = attach::attach_tc_ingress(
            self.tc_program_mut(),
            ifname,
            ifindex,
            &path,
            LinkOrder::default(),
        )
        .inspect_err(|_| {
            self.tc_pending.insert(ifname.to_string(), ifindex);
        })?;
        self.tc_pending.remove(ifname);
        // An earlier release linked tc_ingress6 after it, where it would now
        // run on every packet tc_ingress hands on, IPv6 ones a second time.
        attach::detach_older_link(&self.pins.tc_ingress6_link(ifname));
        self.attached.insert(ifname.to_string(), attachment);
        Ok(())
    }

    /// Unpins the program arrays of earlier agents whose `tc_ingress` is
    /// linked nowhere any more (see `tail_calls`); `attached`, whether this
    /// agent's programs are. How many went.
    pub fn retire_unread_tail_calls(&self, attached: bool) -> Result<usize, TailCallError> {
        self.tail_calls.retire_unread(&self.pins, attached)
    }

    /// Names of the interfaces tc could not be attached to, waiting for
    /// `retry_attaches`.
    pub fn tc_pending(&self) -> impl Iterator<Item = &str> {
        self.tc_pending.keys().map(String::as_str)
    }

    /// Attaches tc again to each interface an attach failed on (`attach`),
    /// which only an interface pass would try again otherwise: the pass
    /// comes when the interfaces change. Each one's outcome.
    pub fn retry_attaches(&mut self) -> Vec<(String, Result<(), AttachError>)> {
        // `attach` puts back each one that fails again.
        std::mem::take(&mut self.tc_pending)
            .into_iter()
            .map(|(name, index)| {
                let outcome = self.attach(&name, index);
                (name, outcome)
            })
            .collect()
    }

    /// Forgets an interface that is gone; its links died with it, and their
    /// pins are removed.
    pub fn forget(&mut self, ifname: &str) {
        self.attached.remove(ifname);
        self.tc_pending.remove(ifname);
        let _ = std::fs::remove_file(self.pins.tc_ingress_link(ifname));
        let _ = std::fs::remove_file(self.pins.tc_ingress6_link(ifname));
        self.xdp_declined.remove(ifname);
        self.forget_xdp(ifname);
    }

    /// The loaded XDP program, for `BPF_PROG_TEST_RUN` in tests and benchmarks.
    pub fn xdp_program(&self) -> &Xdp {
        self.ebpf
            .program(program_names::XDP_INGRESS)
            .and_then(|p| p.try_into().ok())
            .expect("XDP program is loaded in Datapath::load")
    }

    /// Whether `xdp_ingress6` is in `xdp_ingress`'s hand-on slot.
    pub fn xdp6_loaded(&self) -> bool {
        self.tail_calls.xdp_ingress6()
    }

    /// Whether `tc_ingress6` is in `tc_ingress`'s hand-on slot (else IPv6
    /// Services are not served at tc).
    pub fn tc6_handed_on(&self) -> bool {
        self.tail_calls.tc_ingress6()
    }

    /// Whether `tc_dsr` and `tc_dsr6` are in their slots: flows other
    /// nodes send here by direct server return are served.
    pub fn dsr_loaded(&self) -> bool {
        self.tail_calls.dsr()
    }

    /// The floor programs once `load_floors` has loaded them, for use next
    /// to the real ones.
    pub fn floors(&self) -> Option<(&SchedClassifier, &Xdp)> {
        self.loaded_pair(program_names::TC_PASS, program_names::XDP_PASS)
    }

    /// The tc program `tc` and the XDP program `xdp`, when both are loaded.
    fn loaded_pair(&self, tc: &str, xdp: &str) -> Option<(&SchedClassifier, &Xdp)> {
        let tc: &SchedClassifier = self.ebpf.program(tc)?.try_into().ok()?;
        let xdp: &Xdp = self.ebpf.program(xdp)?.try_into().ok()?;
        (tc.fd().is_ok() && xdp.fd().is_ok()).then_some((tc, xdp))
    }

    /// The maps, and the program that removes conntrack entries still
    /// expired (`ct_reap`), for the reaper to use together.
    pub fn conntrack_reaping(&mut self) -> (&mut Maps, ct_reap::CtReap<'_>) {
        let program = self
            .ebpf
            .program(program_names::CT_REAP)
            .and_then(|p| p.try_into().ok());
        (&mut self.maps, ct_reap::CtReap(program))
    }

    /// The programs that only create a flow's two conntrack entries
    /// (`program_names::TC_CT_PAIR`), once `load_floors` has loaded them.
    /// They write the live conntrack map: for benchmarks on a datapath of
    /// their own.
    pub fn ct_pairs(&self) -> Option<(&SchedClassifier, &Xdp)> {
        self.loaded_pair(program_names::TC_CT_PAIR, program_names::XDP_CT_PAIR)
    }

    /// Interfaces with XDP, and the mode it runs in.
    pub fn xdp_attached(&self) -> impl Iterator<Item = (&str, &'static str)> {
        self.xdp_attached.iter().map(|(n, (_, m))| (n.as_str(), *m))
    }

    /// Attaches XDP to an uplink (`setting` says in which mode). Returns the
    /// mode it runs in. When this fails, tc ingress (attached to every
    /// interface) handles the same traffic.
    pub fn attach_xdp(
        &mut self,
        ifname: &str,
        ifindex: u32,
        setting: XdpModeSetting,
    ) -> Result<&'static str, AttachError> {
        if let Some((index, mode)) = self.xdp_attached.get(ifname)
            && *index == ifindex
        {
            return Ok(mode);
        }
        let path = self.pins.xdp_link(ifname);
        let program: &mut Xdp = self
            .ebpf
            .program_mut(program_names::XDP_INGRESS)
            .and_then(|p| p.try_into().ok())
            .expect("XDP program is loaded in Datapath::load");
        let mode = attach::attach_xdp(program, ifname, ifindex, setting, &path)?;
        self.xdp_attached
            .insert(ifname.to_string(), (ifindex, mode));
        // Landed, at an interface pass or a retry: nothing is owed.
        self.xdp_pending.remove(ifname);
        Ok(mode)
    }

    /// Attaches the socket hooks (`SOCKET_HOOKS`) to the cgroup v2 directory
    /// `cgroup`, so that the node's own connections to frontends reach
    /// backends; `set_host_netns` says which sockets are the node's.
    pub fn attach_cgroup(&mut self, cgroup: &Path) -> Result<(), AttachError> {
        for (name, hook) in SOCKET_HOOKS {
            let path = self.pins.cgroup_link(hook);
            let program: &mut CgroupSockAddr = self
                .ebpf
                .program_mut(name)
                .and_then(|p| p.try_into().ok())
                .expect("the socket hooks are loaded in Datapath::load");
            attach::attach_cgroup_hook(program, cgroup, &path)?;
        }
        Ok(())
    }

    /// Takes XDP off an interface that is no longer an uplink.
    ///
    /// Also detaches the XDP link an earlier run pinned for `ifname`, when this
    /// run has not taken it over: an interface that is not to have XDP
    /// (any more, or in that mode) loses it.
    pub fn forget_xdp(&mut self, ifname: &str) {
        self.xdp_pending.remove(ifname);
        let path = self.pins.xdp_link(ifname);
        if self.xdp_attached.remove(ifname).is_some() || path.exists() {
            if let Err(e) = detach::detach_pinned_link(&path) {
                tracing::debug!(pin = %path.display(), error = %e, "detaching XDP");
            }
            let _ = std::fs::remove_file(path);
            tracing::info!(interface = ifname, "XDP detached");
        }
    }

    /// Whether this run attached (or took over) XDP on `ifname`.
    pub fn has_xdp(&self, ifname: &str) -> bool {
        self.xdp_attached.contains_key(ifname)
    }

    /// Notes that XDP is not to be tried again on `ifname` (ifindex
    /// `ifindex`): it failed, or its mode leaves it to tc. True the first
    /// time, so that it is logged once; an interface created anew under the
    /// same name (another ifindex) is tried again.
    pub fn decline_xdp(&mut self, ifname: &str, ifindex: u32) -> bool {
        // Declined is never owed.
        self.xdp_pending.remove(ifname);
        self.xdp_declined.insert(ifname.to_string(), ifindex) != Some(ifindex)
    }

    /// Whether XDP was declined on `ifname` at `ifindex` ([`Datapath::decline_xdp`]).
    pub fn xdp_declined(&self, ifname: &str, ifindex: u32) -> bool {
        self.xdp_declined.get(ifname) == Some(&ifindex)
    }

    /// Notes an XDP attach on `ifname` (ifindex `ifindex`, in mode
    /// `setting`) that failed with `error`: declined for good where the
    /// interface cannot take XDP in that mode (`AttachError::unsupported`),
    /// else owed, for `retry_xdp` to try again. The one place either is
    /// decided, for an interface pass and a retry alike. True the first
    /// time for this ifindex, so that it is logged once.
    pub fn xdp_failed(
        &mut self,
        ifname: &str,
        ifindex: u32,
        setting: XdpModeSetting,
        error: &AttachError,
    ) -> bool {
        if error.unsupported() {
            return self.decline_xdp(ifname, ifindex);
        }
        self.xdp_pending
            .insert(ifname.to_string(), (ifindex, setting))
            .is_none_or(|(index, _)| index != ifindex)
    }

    /// Tries XDP again on each interface `xdp_failed` left owed: what
    /// landed, in which mode, or failed again, by interface, each failure
    /// noted again (`xdp_failed`).
    pub fn retry_xdp(&mut self) -> Vec<(String, Result<&'static str, AttachError>)> {
        std::mem::take(&mut self.xdp_pending)
            .into_iter()
            .map(|(name, (index, setting))| {
                let outcome = self.attach_xdp(&name, index, setting);
                if let Err(e) = &outcome {
                    self.xdp_failed(&name, index, setting, e);
                }
                (name, outcome)
            })
            .collect()
    }
}

/// Pins the iterators the socket hooks' notes are read back through, for the
/// families whose notes map the object has, noting their loads in `loads`.
fn pin_sock_notes(ebpf: &mut Ebpf, maps: &Maps, pins: &PinLayout, loads: &mut Vec<ProgramLoad>) {
    for (program, notes, path) in [
        (
            program_names::SOCK_NOTES_DUMP,
            &maps.sock_notes,
            pins.sock_notes(),
        ),
        (
            program_names::SOCK_NOTES6_DUMP,
            &maps.sock_notes6,
            pins.sock_notes6(),
        ),
    ] {
        if notes.is_none() {
            continue;
        }
        let started = Instant::now();
        match iter_link::pin_iterator(ebpf, program, &path) {
            Ok(()) => loads.push(ProgramLoad {
                name: program,
                took: started.elapsed(),
                verified_insns: ebpf.program(program).and_then(|p| verified_insns(p.info())),
            }),
            Err(e) => tracing::warn!(
                error = %e,
                iterator = program,
                "the socket hooks' notes cannot be read back: the node's UDP sockets connected to departed backends are not closed"
            ),
        }
    }
}

/// Pins this agent's `SERVICE_COUNTERS` in place of the last agent's, for
/// `ebpf-proxy status`: the last agent's programs, while still attached,
/// count into theirs, which the kernel frees with them.
fn pin_service_counters(maps: &Maps, pins: &PinLayout) {
    use aya::maps::IterableMap;
    let Some(counters) = &maps.service_counters else {
        return;
    };
    let path = pins.map(map_names::SERVICE_COUNTERS);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(pin = %path.display(), error = %e, "unpinning the last agent's per-Service counters");
        }
    }
    if let Err(e) = counters.map().pin(&path) {
        tracing::warn!(
            pin = %path.display(),
            error = %e,
            "per-Service counters not pinned: `ebpf-proxy status` shows none (the metrics have them)"
        );
    }
}

/// Unpins the maps of `map_names::RETIRED` an earlier agent of this layout
/// left. Programs still attached that use one keep it until this agent's
/// replace them; nothing reads it after.
fn unpin_retired(pins: &PinLayout) {
    for name in map_names::RETIRED {
        let path = pins.map(name);
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(map = name, "unpinned a map this release no longer has"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(pin = %path.display(), error = %e, "unpinning a retired map"),
        }
    }
}

/// A program type `loaded` can load.
trait Load {
    fn is_loaded(&self) -> bool;
    fn load_now(&mut self) -> Result<(), aya::programs::ProgramError>;
    fn info(&self) -> Result<aya::programs::ProgramInfo, aya::programs::ProgramError>;
    fn fd(&self) -> Result<&aya::programs::ProgramFd, aya::programs::ProgramError>;
}

/// aya gives each program type its own `load` and `info`, with no trait over
/// them.
macro_rules! impl_load {
    ($($program:ty),*) => {$(
        impl Load for $program {
            fn is_loaded(&self) -> bool {
                self.fd().is_ok()
            }

            fn load_now(&mut self) -> Result<(), aya::programs::ProgramError> {
                self.load()
            }

            fn info(&self) -> Result<aya::programs::ProgramInfo, aya::programs::ProgramError> {
                <$program>::info(self)
            }

            fn fd(&self) -> Result<&aya::programs::ProgramFd, aya::programs::ProgramError> {
                <$program>::fd(self)
            }
        }
    )*};
}

impl_load!(SchedClassifier, Xdp, CgroupSockAddr);

/// Loads `program` (`name`) unless it is loaded, and notes in `loads` what
/// that cost.
fn load_noting<P: Load>(
    program: &mut P,
    name: &'static str,
    loads: &mut Vec<ProgramLoad>,
) -> Result<(), aya::programs::ProgramError> {
    if program.is_loaded() {
        return Ok(());
    }
    let started = Instant::now();
    program.load_now()?;
    let took = started.elapsed();
    loads.push(ProgramLoad {
        name,
        took,
        verified_insns: verified_insns(program.info()),
    });
    Ok(())
}

/// The kernel's count of the instructions it verified in a program, from the
/// program's `info`, where it keeps one.
fn verified_insns(
    info: Result<aya::programs::ProgramInfo, aya::programs::ProgramError>,
) -> Option<u32> {
    info.ok()?.verified_instruction_count()
}

/// The object's program `name` as a `P`, loaded into the kernel (once); the
/// load noted in `loads`.
fn loaded<'a, P: Load>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
    loads: &mut Vec<ProgramLoad>,
) -> Result<&'a mut P, DatapathError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let err = |source| DatapathError::Program { name, source };
    let program: &mut P = ebpf
        .program_mut(name)
        .ok_or(err(aya::programs::ProgramError::UnexpectedProgramType))?
        .try_into()
        .map_err(err)?;
    load_noting(program, name, loads).map_err(err)?;
    Ok(program)
}

/// Detaches and unpins everything under `pins` (`ebpf-proxy cleanup`).
/// Returns what was removed.
pub fn cleanup(pins: &PinLayout) -> std::io::Result<Vec<String>> {
    let mut removed = Vec::new();
    if !pins.root().exists() {
        return Ok(removed);
    }
    // Links are detached before their pins go, so that no packet is
    // translated once this returns (see detach.rs).
    detach::detach_links_in(&pins.links_dir());
    for dir in pins.dirs() {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                std::fs::remove_file(entry.path())?;
                removed.push(entry.path().display().to_string());
            }
        }
    }
    // Older layout versions and the directories themselves.
    std::fs::remove_dir_all(pins.root())?;
    Ok(removed)
}
