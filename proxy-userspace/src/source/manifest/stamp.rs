//! Whether a file may have changed, from what `stat` says of it, so that a
//! file at rest costs one `stat` a rescan and no read.

use std::{
    fs,
    hash::{DefaultHasher, Hasher},
    os::unix::fs::MetadataExt,
    time::{Duration, SystemTime},
};

/// A file whose mtime is this close to the moment it was read may have been
/// written again within the same timestamp tick without changing its stamp
/// (filesystems with coarse timestamps: FAT's 2 s, 1 s on some network
/// filesystems), so its content is checked again until it is older.
pub(super) const RACY_WINDOW: Duration = Duration::from_secs(3);

/// What `stat` says of a file: when none of it changed, neither did the file
/// (unless it was written within the timestamp tick it was read in; see
/// [`RACY_WINDOW`]). A rename over the file changes the inode, an in-place
/// write the mtime, anything else done to it the ctime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    pub(super) fn of(metadata: &fs::Metadata) -> Stamp {
        Stamp {
            dev: metadata.dev(),
            ino: metadata.ino(),
            size: metadata.size(),
            mtime: (metadata.mtime(), metadata.mtime_nsec()),
            ctime: (metadata.ctime(), metadata.ctime_nsec()),
        }
    }

    /// Whether a write in the same tick as this mtime could still have gone
    /// unseen by a read at `read_at`.
    pub(super) fn racy(&self, read_at: SystemTime) -> bool {
        let mtime = SystemTime::UNIX_EPOCH
            .checked_add(Duration::new(
                self.mtime.0.max(0) as u64,
                self.mtime.1.clamp(0, 999_999_999) as u32,
            ))
            .unwrap_or(SystemTime::UNIX_EPOCH);
        // A clock set back makes every file look new: checked each time,
        // which costs a read, never a missed change.
        read_at
            .duration_since(mtime)
            .map_or(true, |age| age < RACY_WINDOW)
    }
}

/// A digest of a file's bytes: two reads with the same digest are the same
/// content, so a file touched but not changed is not parsed again.
pub(super) fn digest(content: &[u8]) -> (u64, usize) {
    let mut hasher = DefaultHasher::new();
    hasher.write(content);
    (hasher.finish(), content.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn racy_means_written_within_the_window_before_the_read() {
        let at = |secs: i64| Stamp {
            dev: 1,
            ino: 1,
            size: 1,
            mtime: (secs, 0),
            ctime: (secs, 0),
        };
        let read_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let window = RACY_WINDOW.as_secs() as i64;
        assert!(at(1_000_000).racy(read_at), "written at the read");
        assert!(
            at(1_000_000 - window + 1).racy(read_at),
            "inside the window"
        );
        assert!(
            !at(1_000_000 - window - 1).racy(read_at),
            "older than the window"
        );
        assert!(
            at(1_000_010).racy(read_at),
            "an mtime in the future (clock set back)"
        );
    }
}
