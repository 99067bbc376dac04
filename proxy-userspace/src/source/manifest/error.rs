//! Everything that can go wrong with a manifest, named by its file: the
//! source logs these and goes on, so each says what was kept or skipped.

use std::{io, path::PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: not valid {format}: {message}; keeping its last good content", path.display())]
    Parse {
        path: PathBuf,
        format: &'static str,
        message: String,
    },
    #[error("{}: document {index}: {reason}; skipped", path.display())]
    InvalidDocument {
        path: PathBuf,
        index: usize,
        reason: String,
    },
    #[error("{}: {kind} {object}: {reason}; skipped", path.display())]
    InvalidObject {
        path: PathBuf,
        kind: &'static str,
        object: String,
        reason: String,
    },
    #[error("{}: {kind} {object} is also defined in {}; this copy is ignored", path.display(), first.display())]
    Duplicate {
        path: PathBuf,
        kind: &'static str,
        object: String,
        first: PathBuf,
    },
    #[error("watching {}: {source}", path.display())]
    Watch {
        path: PathBuf,
        #[source]
        source: notify::Error,
    },
}
