//! The manifest source: Services, EndpointSlices and Nodes read from YAML or
//! JSON files, as `kubectl get -o yaml|json` prints them, for demos, tests
//! and `cargo xtask run`.
//!
//! The path is one file or a directory whose `*.yaml`, `*.yml` and `*.json`
//! files are read (not recursively; hidden files, like editors' swap and lock
//! files, are skipped). A file may hold several YAML documents and `kind:
//! List` objects; other kinds are ignored. A bad object is skipped and
//! reported while the rest of its file loads; a file that does not parse at
//! all keeps its last good content, so a half-saved edit never takes
//! services down.
//!
//! At rest a file costs one `stat` per rescan: it is read again only when its
//! device, inode, size, mtime or ctime change (or its mtime is so recent that
//! a write in the same timestamp tick could hide behind it), and parsed again
//! only when what was read differs from what was last parsed.
//!
//! Each file below does one step, reading only those under it: `watch`
//! follows the path with a `reader`, which reads each file again only when
//! its `stamp` changed and keeps its last good objects `encoded`; a file's
//! text is split into `documents`, each made into checked `objects`; the
//! objects found are sent as `events`, and every problem is an `error`.

mod documents;
mod encoded;
mod error;
mod events;
mod objects;
mod reader;
mod stamp;
#[cfg(test)]
mod test_support;
mod watch;

pub use documents::parse_manifest;
pub use error::ManifestError;
pub use events::Manifests;
pub use reader::{ManifestReader, Refresh, Scan, load};
pub use watch::watch;
