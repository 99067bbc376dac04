//! Conntrack entries removed for the reaper by the datapath's `ct_reap`
//! program (`proxy_common::ct_reap`), which removes each only if it is
//! still expired when it gets to it. A removal by key from user space
//! cannot say "only if": an entry read as expired may since have been
//! taken by a new flow of the same tuple, and removing its key then
//! removes the new flow's entry.

use aya::programs::{ProgramError, TestRun, TestRunOptions, Xdp};
use bytemuck::{Pod, bytes_of, cast_slice, pod_read_unaligned};
use proxy_common::ct_reap::{HEADER_LEN, Header, MAX_KEYS};

#[derive(Debug, thiserror::Error)]
pub enum CtReapError {
    #[error("the ct_reap program is not loaded")]
    NotLoaded,
    #[error("running ct_reap: {0}")]
    Run(#[from] ProgramError),
}

/// The loaded `ct_reap` program, if it is.
pub struct CtReap<'a>(pub(super) Option<&'a Xdp>);

impl CtReap<'_> {
    /// Removes the entries of `map` (one of `proxy_common::ct_reap::map`,
    /// whose keys `keys` are) that are still expired at `now_ns`; returns
    /// how many it removed. Keys whose entries are gone, or live again
    /// (a new flow's), are left alone.
    pub fn remove_expired<K: Pod>(
        &self,
        map: u32,
        keys: &[K],
        now_ns: u64,
    ) -> Result<usize, CtReapError> {
        let program = self.0.ok_or(CtReapError::NotLoaded)?;
        let mut removed = 0;
        let mut frame = Vec::with_capacity(HEADER_LEN + MAX_KEYS as usize * size_of::<K>());
        let mut out = vec![0u8; frame.capacity()];
        for chunk in keys.chunks(MAX_KEYS as usize) {
            let header = Header {
                now_ns,
                map,
                keys: u32::try_from(chunk.len()).expect("at most MAX_KEYS"),
                ..Header::default()
            };
            frame.clear();
            frame.extend_from_slice(bytes_of(&header));
            frame.extend_from_slice(cast_slice(chunk));
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(&frame);
            opts.data_out = Some(&mut out[..frame.len()]);
            program.test_run(opts)?;
            let written: Header = pod_read_unaligned(&out[..HEADER_LEN]);
            removed += written.removed as usize;
        }
        Ok(removed)
    }
}
