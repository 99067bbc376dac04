//! Following a path as it changes: a listing at start, then a `Replace` of
//! each kind whose objects changed. inotify wakes it early; a periodic
//! rescan catches what inotify misses.

use std::{
    ffi::{OsStr, OsString},
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{EventKind, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tracing::{Instrument, error, info, info_span, warn};

use super::{
    error::ManifestError,
    events::{ALL_KINDS, Manifests},
    reader::{ManifestReader, Refresh},
};
use crate::source::SourceEvent;

/// How long to wait after a file event for the rest of an editor's save
/// (write temp, rename, chmod...) before reading.
const DEBOUNCE: Duration = Duration::from_millis(50);

/// Check every file this often whatever the watcher says: inotify misses
/// changes on some filesystems and behind some symlink swaps (ConfigMap
/// volumes), and a missed event must not leave stale services forever. A
/// check of an unchanged file is one `stat`.
const RESCAN_PERIOD: Duration = Duration::from_secs(2);

fn log_errors(errors: &[ManifestError]) {
    for e in errors {
        match e {
            ManifestError::Io { .. } | ManifestError::Parse { .. } => {
                error!(error = %e, "manifest");
            }
            _ => warn!(error = %e, "manifest"),
        }
    }
}

/// Watches `path` (a file or a directory of manifests) and sends a complete
/// listing (`Replace` of Services, EndpointSlices and Nodes) at start and,
/// afterwards, a `Replace` of each kind whose objects changed.
///
/// Returns `Ok` when the receiver is dropped, `Err` when the path cannot be
/// read at start or cannot be watched. Later read problems are logged and
/// the last good objects stay.
pub async fn watch(path: PathBuf, tx: mpsc::Sender<SourceEvent>) -> Result<(), ManifestError> {
    let span = info_span!("manifest_source", path = %path.display());
    follow(path, tx).instrument(span).await
}

async fn follow(path: PathBuf, tx: mpsc::Sender<SourceEvent>) -> Result<(), ManifestError> {
    let (watched_dir, file_name) = watched_directory(&path)?;
    let (event_tx, mut event_rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // The receiver only goes away when `watch` returns.
        let _ = event_tx.send(event);
    })
    .map_err(|source| ManifestError::Watch {
        path: watched_dir.clone(),
        source,
    })?;
    // Watch the directory, not the file: editors and `kubectl`-style tools
    // replace a file by renaming another over it, which ends a watch on the
    // old inode.
    watcher
        .watch(&watched_dir, RecursiveMode::NonRecursive)
        .map_err(|source| ManifestError::Watch {
            path: watched_dir.clone(),
            source,
        })?;

    // Reading after the watch starts means no change can fall between the
    // two.
    let (mut reader, first, merged) = refresh_blocking(ManifestReader::new(&path), true).await;
    if let Some(e) = first.root_error {
        return Err(e);
    }
    let (manifests, duplicates) = merged.unwrap_or_default();
    log_errors(&first.errors);
    log_errors(&duplicates);
    info!(
        services = manifests.services.len(),
        endpoint_slices = manifests.endpoint_slices.len(),
        nodes = manifests.nodes.len(),
        files = first.parsed.len(),
        "manifests loaded"
    );
    for event in manifests.into_events() {
        if tx.send(event).await.is_err() {
            return Ok(());
        }
    }
    let mut root_failing = false;

    let mut rescan = tokio::time::interval(RESCAN_PERIOD);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    rescan.tick().await;
    loop {
        tokio::select! {
            () = tx.closed() => return Ok(()),
            _ = rescan.tick() => {}
            event = event_rx.recv() => {
                let Some(event) = event else { return Ok(()) };
                if !relevant(&event, file_name.as_deref()) {
                    continue;
                }
                tokio::time::sleep(DEBOUNCE).await;
                while event_rx.try_recv().is_ok() {}
            }
        }
        let (next, refresh, merged) = refresh_blocking(reader, false).await;
        reader = next;
        // Reported when it starts and stops, not on every re-scan.
        match (&refresh.root_error, root_failing) {
            (Some(e), false) => {
                error!(error = %e, "manifests unreadable; keeping the last good objects");
            }
            (None, true) => info!("manifests readable again"),
            _ => {}
        }
        root_failing = refresh.root_error.is_some();
        log_errors(&refresh.errors);
        let Some((manifests, duplicates)) = merged else {
            continue;
        };
        log_errors(&duplicates);
        if refresh.kinds.is_empty() {
            continue;
        }
        info!(
            kinds = ?refresh.kinds,
            objects = manifests.services.len()
                + manifests.endpoint_slices.len()
                + manifests.nodes.len(),
            parsed = ?refresh.parsed,
            "manifests changed"
        );
        for event in manifests.into_events_of(&refresh.kinds) {
            if tx.send(event).await.is_err() {
                return Ok(());
            }
        }
    }
}

/// The directory to watch (the path itself, or the directory holding it)
/// and, for a single file, its name.
fn watched_directory(path: &Path) -> Result<(PathBuf, Option<OsString>), ManifestError> {
    let metadata = fs::metadata(path).map_err(|source| ManifestError::Io {
        path: path.to_owned(),
        source,
    })?;
    if metadata.is_dir() {
        return Ok((path.to_owned(), None));
    }
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
        _ => PathBuf::from("."),
    };
    Ok((dir, path.file_name().map(ToOwned::to_owned)))
}

/// Whether a watcher event may mean our files changed. Our own reads show up
/// as access events and must not trigger scans; in single-file mode, only
/// events naming the file count (a rename onto it names it as the target).
fn relevant(event: &notify::Result<notify::Event>, file_name: Option<&OsStr>) -> bool {
    let event = match event {
        Ok(event) => event,
        Err(e) => {
            // The watcher may have lost events: rescan to be sure.
            warn!(error = %e, "manifest watcher");
            return true;
        }
    };
    if matches!(event.kind, EventKind::Access(_)) {
        return false;
    }
    match file_name {
        None => true,
        Some(name) => {
            event.need_rescan() || event.paths.iter().any(|p| p.file_name() == Some(name))
        }
    }
}

/// [`ManifestReader::refresh`] off the async threads, and the merged objects
/// (with the duplicates left out) of the kinds that changed, or of every
/// kind when `merge` says so: merging decodes every object of a kind, which
/// an unchanged tree must not cost.
async fn refresh_blocking(
    mut reader: ManifestReader,
    merge: bool,
) -> (
    ManifestReader,
    Refresh,
    Option<(Manifests, Vec<ManifestError>)>,
) {
    let task = tokio::task::spawn_blocking(move || {
        let refresh = reader.refresh();
        let merged = if merge {
            Some(reader.manifests(&ALL_KINDS))
        } else {
            (!refresh.kinds.is_empty()).then(|| reader.manifests(&refresh.kinds))
        };
        (reader, refresh, merged)
    });
    match task.await {
        Ok(done) => done,
        // Only a bug in `refresh` (a panic) or a runtime shutting down gets
        // here; neither leaves a reader to carry on with.
        Err(e) => std::panic::resume_unwind(
            e.try_into_panic()
                .unwrap_or_else(|e| Box::new(format!("manifest scan: {e}"))),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{
        Kind, Object,
        manifest::test_support::{TempDir, service_yaml, slice_yaml},
    };

    async fn next_event(rx: &mut mpsc::Receiver<SourceEvent>, within: Duration) -> SourceEvent {
        tokio::time::timeout(within, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no event within {within:?}"))
            .expect("watcher stopped")
    }

    fn service_ips(event: &SourceEvent) -> Vec<String> {
        match event {
            SourceEvent::Replace {
                kind: Kind::Service,
                objects,
            } => objects
                .iter()
                .map(|o| match o {
                    Object::Service(s) => match s.cluster_ips() {
                        [ip] => ip.to_string(),
                        ips => panic!("a Service with one ClusterIP has {ips:?}"),
                    },
                    other => panic!("not a service in a Service listing: {other:?}"),
                })
                .collect(),
            other => panic!("expected Replace of Services, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn watch_sends_listings_and_follows_edits() {
        let dir = TempDir::new("watch");
        let file = dir.write("web.yaml", &service_yaml("web", "10.96.0.10"));
        let (tx, mut rx) = mpsc::channel(16);
        let task = tokio::spawn(watch(file.clone(), tx));

        let first = next_event(&mut rx, Duration::from_secs(5)).await;
        assert_eq!(
            service_ips(&first),
            ["10.96.0.10"],
            "initial Service listing"
        );
        for want in [Kind::EndpointSlice, Kind::Node] {
            match next_event(&mut rx, Duration::from_secs(1)).await {
                SourceEvent::Replace { kind, objects } => {
                    assert_eq!(kind, want, "initial listings come in order");
                    assert!(objects.is_empty(), "{want:?}: nothing in the file");
                }
                other => panic!("expected the initial {want:?} listing, got {other:?}"),
            }
        }

        // Editor-style save: rename over the file.
        dir.replace("web.yaml", &service_yaml("web", "10.96.0.20"));
        let edited = next_event(&mut rx, Duration::from_secs(1)).await;
        assert_eq!(
            service_ips(&edited),
            ["10.96.0.20"],
            "the edit arrives within 1 s"
        );

        // A broken save sends nothing; the fix is sent.
        fs::write(&file, "kind: [").unwrap();
        let quiet = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
        assert!(
            quiet.is_err(),
            "a broken file must not produce a listing: {quiet:?}"
        );
        fs::write(&file, service_yaml("web", "10.96.0.30")).unwrap();
        let fixed = next_event(&mut rx, Duration::from_secs(1)).await;
        assert_eq!(
            service_ips(&fixed),
            ["10.96.0.30"],
            "in-place write arrives within 1 s"
        );

        // Another file in the same directory is not ours in single-file mode.
        dir.write("other.yaml", &service_yaml("api", "10.96.0.40"));
        let quiet = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
        assert!(quiet.is_err(), "a sibling file is not watched: {quiet:?}");

        drop(rx);
        tokio::time::timeout(Duration::from_secs(3), task)
            .await
            .expect("watch returns once the receiver is gone")
            .expect("watch task")
            .expect("watch ends cleanly");
    }

    #[tokio::test]
    async fn watch_directory_sends_only_changed_kinds() {
        let dir = TempDir::new("watch-dir");
        dir.write("svc.yaml", &service_yaml("web", "10.96.0.10"));
        let (tx, mut rx) = mpsc::channel(16);
        let task = tokio::spawn(watch(dir.0.clone(), tx));
        for _ in 0..3 {
            next_event(&mut rx, Duration::from_secs(5)).await;
        }

        dir.write("slices.yaml", &slice_yaml("web-1", "web", "10.0.0.1"));
        match next_event(&mut rx, Duration::from_secs(1)).await {
            SourceEvent::Replace {
                kind: Kind::EndpointSlice,
                objects,
            } => assert_eq!(objects.len(), 1, "the new slice"),
            other => panic!("expected a Replace of EndpointSlices only, got {other:?}"),
        }
        let quiet = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await;
        assert!(quiet.is_err(), "unchanged kinds are not re-sent: {quiet:?}");

        fs::remove_file(dir.0.join("svc.yaml")).unwrap();
        let gone = next_event(&mut rx, Duration::from_secs(1)).await;
        assert!(
            service_ips(&gone).is_empty(),
            "a deleted file's service goes"
        );

        drop(rx);
        tokio::time::timeout(Duration::from_secs(3), task)
            .await
            .expect("watch returns once the receiver is gone")
            .expect("watch task")
            .expect("watch ends cleanly");
    }

    #[tokio::test]
    async fn watch_of_a_missing_path_fails() {
        let dir = TempDir::new("watch-missing");
        let (tx, _rx) = mpsc::channel(16);
        let err = watch(dir.0.join("nope"), tx)
            .await
            .expect_err("nothing to watch");
        assert!(
            matches!(err, ManifestError::Io { .. }),
            "an I/O error naming the path: {err}"
        );
    }
}
