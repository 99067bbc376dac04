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

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::{OsStr, OsString},
    fs,
    hash::{DefaultHasher, Hasher},
    io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use k8s_openapi::{
    api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use notify::{EventKind, RecursiveMode, Watcher};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, error, info, info_span, warn};

use super::{Kind, Object, SourceEvent};

/// How long to wait after a file event for the rest of an editor's save
/// (write temp, rename, chmod...) before reading.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// Check every file this often whatever the watcher says: inotify misses
/// changes on some filesystems and behind some symlink swaps (ConfigMap
/// volumes), and a missed event must not leave stale services forever. A
/// check of an unchanged file is one `stat`.
const RESCAN_PERIOD: Duration = Duration::from_secs(2);
/// A file whose mtime is this close to the moment it was read may have been
/// written again within the same timestamp tick without changing its stamp
/// (filesystems with coarse timestamps: FAT's 2 s, 1 s on some network
/// filesystems), so its content is checked again until it is older.
const RACY_WINDOW: Duration = Duration::from_secs(3);

const ALL_KINDS: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

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

/// Objects read from manifests, each kind in file order (files by path).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Manifests {
    pub services: Vec<Service>,
    pub endpoint_slices: Vec<EndpointSlice>,
    pub nodes: Vec<Node>,
}

impl Manifests {
    /// One `Replace` per kind: together a complete listing.
    pub fn into_events(self) -> Vec<SourceEvent> {
        self.into_events_of(&ALL_KINDS)
    }

    /// A `Replace` of each of `kinds` (in the order Service, EndpointSlice,
    /// Node), the objects moved into them rather than copied.
    pub fn into_events_of(self, kinds: &[Kind]) -> Vec<SourceEvent> {
        let Manifests {
            services,
            endpoint_slices,
            nodes,
        } = self;
        let mut events = Vec::new();
        if kinds.contains(&Kind::Service) {
            events.push(SourceEvent::Replace {
                kind: Kind::Service,
                objects: services.into_iter().map(Object::service).collect(),
            });
        }
        if kinds.contains(&Kind::EndpointSlice) {
            events.push(SourceEvent::Replace {
                kind: Kind::EndpointSlice,
                objects: endpoint_slices
                    .into_iter()
                    .map(|s| Object::slice(&s))
                    .collect(),
            });
        }
        if kinds.contains(&Kind::Node) {
            events.push(SourceEvent::Replace {
                kind: Kind::Node,
                objects: nodes
                    .into_iter()
                    .map(|n| Object::Node(Box::new(n)))
                    .collect(),
            });
        }
        events
    }

    /// A `Replace` for each kind whose objects differ from `sent` (every
    /// kind when nothing was sent yet): listing an unchanged kind again
    /// would only make the consumer compare it.
    pub fn events_since(&self, sent: Option<&Manifests>) -> Vec<SourceEvent> {
        let mut events = Vec::new();
        if sent.is_none_or(|s| s.services != self.services) {
            events.push(SourceEvent::Replace {
                kind: Kind::Service,
                objects: self
                    .services
                    .iter()
                    .map(|s| Object::service(s.clone()))
                    .collect(),
            });
        }
        if sent.is_none_or(|s| s.endpoint_slices != self.endpoint_slices) {
            events.push(SourceEvent::Replace {
                kind: Kind::EndpointSlice,
                objects: self.endpoint_slices.iter().map(Object::slice).collect(),
            });
        }
        if sent.is_none_or(|s| s.nodes != self.nodes) {
            events.push(SourceEvent::Replace {
                kind: Kind::Node,
                objects: self
                    .nodes
                    .iter()
                    .map(|n| Object::Node(Box::new(n.clone())))
                    .collect(),
            });
        }
        events
    }
}

/// Parses one file's text. `Err` means the file as a whole is unreadable;
/// otherwise the good objects come with an error for each bad one.
pub fn parse_manifest(
    path: &Path,
    text: &str,
) -> Result<(Manifests, Vec<ManifestError>), ManifestError> {
    let mut out = Manifests::default();
    let mut errors = Vec::new();
    // Each document becomes objects as soon as it is read, so that only one
    // document's generic tree exists at a time (a file of 10,000 Services
    // would otherwise be held whole, as trees, several times its size).
    let mut add = |index: usize, document: Value| {
        add_document(path, index, &document, &mut out, &mut errors);
    };
    if is_json(path) {
        parse_json_documents(path, text, &mut add)?;
    } else {
        parse_yaml_documents(path, text, &mut add)?;
    }
    Ok((out, errors))
}

/// Reads a file or directory once. `Err` when the path itself cannot be
/// read; per-file and per-object problems come back as errors beside
/// whatever did load.
pub fn load(path: &Path) -> Result<(Manifests, Vec<ManifestError>), ManifestError> {
    let mut reader = ManifestReader::new(path);
    let scan = reader.scan();
    if let Some(error) = scan.root_error {
        return Err(error);
    }
    Ok((scan.manifests, scan.errors))
}

fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

/// Hands each document of a YAML stream to `add`, in order. A syntax error
/// anywhere makes the whole file suspect (it is most likely being edited):
/// the caller then drops whatever `add` built from it.
fn parse_yaml_documents(
    path: &Path,
    text: &str,
    add: &mut impl FnMut(usize, Value),
) -> Result<(), ManifestError> {
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(document).map_err(|e| ManifestError::Parse {
            path: path.to_owned(),
            format: "YAML",
            message: e.to_string(),
        })?;
        add(index, value);
    }
    Ok(())
}

/// [`parse_yaml_documents`] for a stream of JSON values.
fn parse_json_documents(
    path: &Path,
    text: &str,
    add: &mut impl FnMut(usize, Value),
) -> Result<(), ManifestError> {
    for (index, value) in serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .enumerate()
    {
        let value = value.map_err(|e| ManifestError::Parse {
            path: path.to_owned(),
            format: "JSON",
            message: e.to_string(),
        })?;
        add(index, value);
    }
    Ok(())
}

fn add_document(
    path: &Path,
    index: usize,
    document: &Value,
    out: &mut Manifests,
    errors: &mut Vec<ManifestError>,
) {
    let invalid_document = |reason: String| ManifestError::InvalidDocument {
        path: path.to_owned(),
        index,
        reason,
    };
    let map = match document {
        // An empty document, e.g. after a trailing `---`.
        Value::Null => return,
        Value::Object(map) => map,
        _ => {
            errors.push(invalid_document("not a mapping".into()));
            return;
        }
    };
    let field = |name: &str| map.get(name).and_then(Value::as_str);
    let (Some(api_version), Some(kind)) = (field("apiVersion"), field("kind")) else {
        errors.push(invalid_document("apiVersion or kind is missing".into()));
        return;
    };
    match (api_version, kind) {
        ("v1", "Service") => {
            if let Some(service) =
                typed::<Service>(path, "Service", document, errors, |s| &mut s.metadata)
            {
                out.services.push(service);
            }
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            if let Some(slice) =
                typed::<EndpointSlice>(path, "EndpointSlice", document, errors, |s| &mut s.metadata)
            {
                out.endpoint_slices.push(slice);
            }
        }
        ("v1", "Node") => {
            if let Some(node) = typed::<Node>(path, "Node", document, errors, |n| &mut n.metadata) {
                out.nodes.push(node);
            }
        }
        (_, "List") => {
            let Some(items) = map.get("items").and_then(Value::as_array) else {
                errors.push(invalid_document("a List without items".into()));
                return;
            };
            for item in items {
                // Items are numbered with their List: errors name the document.
                add_document(path, index, item, out, errors);
            }
        }
        (api_version, kind) => {
            debug!(path = %path.display(), api_version, kind, "not a kind the proxy uses; ignored");
        }
    }
}

/// Decodes one object of a known kind, defaulting what `kubectl apply`
/// would (the namespace) and checking what we key objects by (the name).
fn typed<T>(
    path: &Path,
    kind: &'static str,
    document: &Value,
    errors: &mut Vec<ManifestError>,
    metadata: impl Fn(&mut T) -> &mut ObjectMeta,
) -> Option<T>
where
    T: serde::de::DeserializeOwned,
{
    let namespaced = kind != "Node";
    let name_of = || {
        let meta = document.get("metadata");
        let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Value::as_str);
        let name = field("name").unwrap_or("<unnamed>");
        match (namespaced, field("namespace")) {
            (false, _) => name.to_owned(),
            (true, namespace) => format!("{}/{name}", namespace.unwrap_or("default")),
        }
    };
    let invalid = |reason: String| ManifestError::InvalidObject {
        path: path.to_owned(),
        kind,
        object: name_of(),
        reason,
    };
    let mut object: T = match T::deserialize(document) {
        Ok(object) => object,
        Err(e) => {
            errors.push(invalid(e.to_string()));
            return None;
        }
    };
    let meta = metadata(&mut object);
    if meta.name.as_deref().is_none_or(str::is_empty) {
        errors.push(invalid("metadata.name is missing".into()));
        return None;
    }
    if namespaced && meta.namespace.as_deref().is_none_or(str::is_empty) {
        meta.namespace = Some("default".into());
    }
    // The API server's bookkeeping: of no use here and often most of the
    // object.
    meta.managed_fields = None;
    Some(object)
}

/// What `stat` says of a file: when none of it changed, neither did the file
/// (unless it was written within the timestamp tick it was read in; see
/// [`RACY_WINDOW`]). A rename over the file changes the inode, an in-place
/// write the mtime, anything else done to it the ctime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(metadata: &fs::Metadata) -> Stamp {
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
    fn racy(&self, read_at: SystemTime) -> bool {
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
fn digest(content: &[u8]) -> (u64, usize) {
    let mut hasher = DefaultHasher::new();
    hasher.write(content);
    (hasher.finish(), content.len())
}

/// A file's last good objects, each kept as its JSON encoding: a fraction
/// of the memory of the decoded objects, which the agent's state already
/// holds once. They are decoded only to send a listing of their kind after
/// some file's objects of that kind changed.
#[derive(Debug, Default, PartialEq)]
struct Encoded {
    services: Vec<Box<[u8]>>,
    endpoint_slices: Vec<Box<[u8]>>,
    nodes: Vec<Box<[u8]>>,
}

impl Encoded {
    fn of(manifests: &Manifests) -> Encoded {
        Encoded {
            services: encode_all(&manifests.services),
            endpoint_slices: encode_all(&manifests.endpoint_slices),
            nodes: encode_all(&manifests.nodes),
        }
    }

    /// The kinds whose objects differ between `self` and `other` (the
    /// encoding of a decoded object is canonical: maps are ordered).
    fn kinds_differing(&self, other: &Encoded) -> Vec<Kind> {
        let mut kinds = Vec::new();
        if self.services != other.services {
            kinds.push(Kind::Service);
        }
        if self.endpoint_slices != other.endpoint_slices {
            kinds.push(Kind::EndpointSlice);
        }
        if self.nodes != other.nodes {
            kinds.push(Kind::Node);
        }
        kinds
    }
}

fn encode_all<T: serde::Serialize>(objects: &[T]) -> Vec<Box<[u8]>> {
    objects
        .iter()
        .filter_map(|object| match serde_json::to_vec(object) {
            Ok(json) => Some(json.into_boxed_slice()),
            // Only a map with keys that are not strings fails, and the
            // Kubernetes types have none.
            Err(e) => {
                error!(error = %e, "manifest object not kept");
                None
            }
        })
        .collect()
}

fn decode<T: serde::de::DeserializeOwned>(json: &[u8]) -> Option<T> {
    match serde_json::from_slice(json) {
        Ok(object) => Some(object),
        // What `encode_all` wrote decodes: the same types both ways.
        Err(e) => {
            error!(error = %e, "manifest object not decoded");
            None
        }
    }
}

/// One file as last seen.
#[derive(Debug)]
struct CachedFile {
    /// Its stamp when last read.
    stamp: Stamp,
    /// The stamp may hide a later write: read again at the next scan.
    racy: bool,
    /// Digest of the bytes last read, good or not: unchanged content is not
    /// parsed or reported again.
    digest: (u64, usize),
    /// Objects of the last content that parsed.
    objects: Encoded,
}

/// What one [`ManifestReader::refresh`] found.
#[derive(Debug, Default)]
pub struct Refresh {
    /// Problems found in files that changed since the previous refresh
    /// (duplicates are found by [`ManifestReader::manifests`]).
    pub errors: Vec<ManifestError>,
    /// The path given could not be read at all (missing, unreadable
    /// directory); every cached file was kept.
    pub root_error: Option<ManifestError>,
    /// Some file was added, removed or changed since the previous refresh.
    pub changed: bool,
    /// The kinds whose objects (of some file) changed.
    pub kinds: Vec<Kind>,
    /// Files whose bytes were read (their stamp changed, or was racy).
    pub read: Vec<PathBuf>,
    /// Files whose content was parsed (it differed from the last parsed).
    pub parsed: Vec<PathBuf>,
}

/// The outcome of one [`ManifestReader::scan`].
#[derive(Debug, Default)]
pub struct Scan {
    /// Every object of every file (a file that no longer parses contributes
    /// its last good objects).
    pub manifests: Manifests,
    /// Problems found in files that changed since the previous scan (and
    /// duplicate objects, whenever anything changed).
    pub errors: Vec<ManifestError>,
    /// The path given could not be read at all (missing, unreadable
    /// directory); every cached file was kept.
    pub root_error: Option<ManifestError>,
    /// Some file was added, removed or changed since the previous scan.
    pub changed: bool,
    /// Files whose bytes were read.
    pub read: Vec<PathBuf>,
    /// Files whose content was parsed.
    pub parsed: Vec<PathBuf>,
}

/// Reads the manifests under a path, remembering each file's stamp, the
/// digest of its last content and its last good objects between scans.
#[derive(Debug)]
pub struct ManifestReader {
    root: PathBuf,
    files: BTreeMap<PathBuf, CachedFile>,
}

impl ManifestReader {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ManifestReader {
            root: root.into(),
            files: BTreeMap::new(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// [`ManifestReader::refresh`], then every object merged (and the
    /// duplicates reported when anything changed).
    pub fn scan(&mut self) -> Scan {
        let refresh = self.refresh();
        let (manifests, duplicates) = self.manifests(&ALL_KINDS);
        let mut errors = refresh.errors;
        // Unchanged files had their duplicates reported when they appeared.
        if refresh.changed {
            errors.extend(duplicates);
        }
        Scan {
            manifests,
            errors,
            root_error: refresh.root_error,
            changed: refresh.changed,
            read: refresh.read,
            parsed: refresh.parsed,
        }
    }

    /// Every object of `kinds` of every file, and the duplicates left out:
    /// of two objects with one kind and key, the one from the first file (by
    /// path) wins.
    pub fn manifests(&self, kinds: &[Kind]) -> (Manifests, Vec<ManifestError>) {
        let mut merged = Manifests::default();
        let mut duplicates = Vec::new();
        let mut seen: BTreeMap<(&'static str, String), &Path> = BTreeMap::new();
        for (path, cached) in &self.files {
            let mut first_time = |kind: &'static str, meta: &ObjectMeta| {
                let object = match &meta.namespace {
                    Some(namespace) => {
                        format!("{namespace}/{}", meta.name.as_deref().unwrap_or(""))
                    }
                    None => meta.name.clone().unwrap_or_default(),
                };
                if let Some(first) = seen.get(&(kind, object.clone())) {
                    duplicates.push(ManifestError::Duplicate {
                        path: path.clone(),
                        kind,
                        object,
                        first: first.to_path_buf(),
                    });
                    return false;
                }
                seen.insert((kind, object), path);
                true
            };
            if kinds.contains(&Kind::Service) {
                for service in cached
                    .objects
                    .services
                    .iter()
                    .filter_map(|j| decode::<Service>(j))
                {
                    if first_time("Service", &service.metadata) {
                        merged.services.push(service);
                    }
                }
            }
            if kinds.contains(&Kind::EndpointSlice) {
                for slice in cached
                    .objects
                    .endpoint_slices
                    .iter()
                    .filter_map(|j| decode::<EndpointSlice>(j))
                {
                    if first_time("EndpointSlice", &slice.metadata) {
                        merged.endpoint_slices.push(slice);
                    }
                }
            }
            if kinds.contains(&Kind::Node) {
                for node in cached
                    .objects
                    .nodes
                    .iter()
                    .filter_map(|j| decode::<Node>(j))
                {
                    if first_time("Node", &node.metadata) {
                        merged.nodes.push(node);
                    }
                }
            }
        }
        (merged, duplicates)
    }

    /// Checks every file: a file whose stamp is unchanged costs one `stat`;
    /// one whose stamp changed is read, and parsed if its bytes changed.
    pub fn refresh(&mut self) -> Refresh {
        let mut refresh = Refresh::default();
        let paths = match self.list() {
            Ok(paths) => paths,
            Err(e) => {
                refresh.root_error = Some(e);
                return refresh;
            }
        };

        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|path| !paths.contains(*path))
            .cloned()
            .collect();
        for path in gone {
            if let Some(cached) = self.files.remove(&path) {
                refresh.changed = true;
                add_kinds(
                    &mut refresh.kinds,
                    cached.objects.kinds_differing(&Encoded::default()),
                );
            }
        }

        for path in paths {
            let stamp = match fs::metadata(&path) {
                Ok(metadata) => Stamp::of(&metadata),
                Err(e) => {
                    // Gone between listing and reading, or unreadable: keep
                    // what we had; the next scan settles it.
                    refresh.errors.push(ManifestError::Io { path, source: e });
                    continue;
                }
            };
            if let Some(cached) = self.files.get(&path)
                && cached.stamp == stamp
                && !cached.racy
            {
                continue;
            }
            let read_at = SystemTime::now();
            let content = match fs::read(&path) {
                Ok(content) => content,
                Err(e) => {
                    refresh.errors.push(ManifestError::Io { path, source: e });
                    continue;
                }
            };
            refresh.read.push(path.clone());
            let digest = digest(&content);
            // The stamp of what was read: taken before the read, a write in
            // between leaves it older than the content, and the next scan
            // reads again.
            let racy = stamp.racy(read_at);
            if let Some(cached) = self.files.get_mut(&path)
                && cached.digest == digest
            {
                cached.stamp = stamp;
                cached.racy = racy;
                continue;
            }
            refresh.changed = true;
            refresh.parsed.push(path.clone());
            debug!(path = %path.display(), bytes = content.len(), "parsing");
            let parsed = match std::str::from_utf8(&content) {
                // An in-place save truncates before it writes; reading in
                // between must not make every object of the file vanish.
                // (A file with only a comment still clears them.)
                Ok("") => Err(ManifestError::Parse {
                    path: path.clone(),
                    format: if is_json(&path) { "JSON" } else { "YAML" },
                    message: "the file is empty (still being written?)".into(),
                }),
                Ok(text) => parse_manifest(&path, text),
                Err(e) => Err(ManifestError::Parse {
                    path: path.clone(),
                    format: if is_json(&path) { "JSON" } else { "YAML" },
                    message: format!("not UTF-8: {e}"),
                }),
            };
            drop(content);
            let previous = self.files.remove(&path).map(|cached| cached.objects);
            let objects = match parsed {
                Ok((objects, errors)) => {
                    refresh.errors.extend(errors);
                    let objects = Encoded::of(&objects);
                    let kinds = objects.kinds_differing(&previous.unwrap_or_default());
                    add_kinds(&mut refresh.kinds, kinds);
                    objects
                }
                Err(e) => {
                    refresh.errors.push(e);
                    previous.unwrap_or_default()
                }
            };
            self.files.insert(
                path,
                CachedFile {
                    stamp,
                    racy,
                    digest,
                    objects,
                },
            );
        }
        refresh
    }

    /// The files to read: the root itself, or the manifest files in it.
    fn list(&self) -> Result<BTreeSet<PathBuf>, ManifestError> {
        let io_error = |source| ManifestError::Io {
            path: self.root.clone(),
            source,
        };
        let metadata = fs::metadata(&self.root).map_err(io_error)?;
        if !metadata.is_dir() {
            return Ok(BTreeSet::from([self.root.clone()]));
        }
        let mut paths = BTreeSet::new();
        for entry in fs::read_dir(&self.root).map_err(io_error)? {
            let path = entry.map_err(io_error)?.path();
            if is_manifest_file(&path) && path.is_file() {
                paths.insert(path);
            }
        }
        Ok(paths)
    }
}

fn is_manifest_file(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    !name.starts_with('.')
        && [".yaml", ".yml", ".json"]
            .iter()
            .any(|ext| name.ends_with(ext))
}

/// Adds `kinds` to `to`, each once, in the order of [`Kind`].
fn add_kinds(to: &mut Vec<Kind>, kinds: Vec<Kind>) {
    to.extend(kinds);
    to.sort();
    to.dedup();
}

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
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::{model::ModelConfig, source::ObjectKey, state::ClusterState};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(test: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "ebpf-proxy-manifest-{test}-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }

        fn write(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            fs::write(&path, text).expect("write manifest");
            path
        }

        /// Replaces a file the way editors do: write a temp file, rename it
        /// over the original.
        fn replace(&self, name: &str, text: &str) {
            let temp = self.0.join(format!(".{name}.tmp"));
            fs::write(&temp, text).expect("write temp file");
            fs::rename(&temp, self.0.join(name)).expect("rename over");
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn service_yaml(name: &str, cluster_ip: &str) -> String {
        format!(
            "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: demo
spec:
  clusterIP: {cluster_ip}
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
"
        )
    }

    fn slice_yaml(name: &str, service: &str, ip: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: demo
  labels:
    kubernetes.io/service-name: {service}
addressType: IPv4
endpoints:
- addresses: [{ip}]
ports:
- name: http
  port: 8080
  protocol: TCP
"
        )
    }

    fn names(m: &Manifests) -> (Vec<String>, Vec<String>, Vec<String>) {
        let key = |meta: &ObjectMeta| {
            format!(
                "{}/{}",
                meta.namespace.as_deref().unwrap_or("-"),
                meta.name.as_deref().unwrap_or("-")
            )
        };
        (
            m.services.iter().map(|s| key(&s.metadata)).collect(),
            m.endpoint_slices.iter().map(|s| key(&s.metadata)).collect(),
            m.nodes.iter().map(|n| key(&n.metadata)).collect(),
        )
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(ToString::to_string).collect()
    }

    fn error_texts(errors: &[ManifestError]) -> Vec<String> {
        errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn multi_document_file() {
        let text = format!(
            "{}---\n{}---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\n---\n{}---\n",
            service_yaml("web", "10.96.0.10"),
            slice_yaml("web-1", "web", "10.0.0.1"),
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n  labels:\n    topology.kubernetes.io/zone: zone-a\n",
        );
        let (m, errors) = parse_manifest(Path::new("multi.yaml"), &text).expect("parses");
        assert!(
            errors.is_empty(),
            "unexpected errors: {:?}",
            error_texts(&errors)
        );
        assert_eq!(
            names(&m),
            (
                strings(&["demo/web"]),
                strings(&["demo/web-1"]),
                strings(&["-/node-a"])
            ),
            "services, slices, nodes (ConfigMap ignored, trailing empty document skipped)"
        );
    }

    #[test]
    fn kind_list_with_items() {
        let indent = |doc: String| {
            let mut lines = doc.lines();
            let first = format!("- {}\n", lines.next().unwrap());
            first + &lines.map(|l| format!("  {l}\n")).collect::<String>()
        };
        let text = format!(
            "apiVersion: v1\nkind: List\nmetadata:\n  resourceVersion: \"\"\nitems:\n{}{}",
            indent(service_yaml("web", "10.96.0.10")),
            indent(slice_yaml("web-1", "web", "10.0.0.1")),
        );
        let (m, errors) = parse_manifest(Path::new("list.yaml"), &text).expect("parses");
        assert!(
            errors.is_empty(),
            "unexpected errors: {:?}",
            error_texts(&errors)
        );
        assert_eq!(
            names(&m),
            (strings(&["demo/web"]), strings(&["demo/web-1"]), vec![]),
            "List items"
        );
    }

    #[test]
    fn json_list_as_kubectl_prints_it() {
        let text = r#"{
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {"apiVersion": "v1", "kind": "Service",
                 "metadata": {"name": "web", "namespace": "demo"},
                 "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]}},
                {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                 "metadata": {"name": "web-1", "namespace": "demo",
                              "labels": {"kubernetes.io/service-name": "web"}},
                 "addressType": "IPv4", "endpoints": null,
                 "ports": [{"name": "http", "port": 8080}]}
            ]
        }"#;
        let (m, errors) = parse_manifest(Path::new("list.json"), text).expect("parses");
        assert!(
            errors.is_empty(),
            "unexpected errors: {:?}",
            error_texts(&errors)
        );
        assert_eq!(
            names(&m),
            (strings(&["demo/web"]), strings(&["demo/web-1"]), vec![]),
            "JSON List items"
        );
        assert!(
            m.endpoint_slices[0].endpoints.is_empty(),
            "endpoints: null is no endpoints"
        );
    }

    #[test]
    fn bad_documents_are_skipped_and_named() {
        let text = format!(
            "{}---\n{}---\n{}---\n{}---\n{}",
            service_yaml("web", "10.96.0.10"),
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: broken\n  namespace: demo\nspec:\n  ports: not-a-list\n",
            "just a string\n",
            "metadata:\n  name: kindless\n",
            slice_yaml("web-1", "web", "10.0.0.1"),
        );
        let (m, errors) = parse_manifest(Path::new("mixed.yaml"), &text).expect("parses");
        assert_eq!(
            names(&m),
            (strings(&["demo/web"]), strings(&["demo/web-1"]), vec![]),
            "the good objects around the bad ones load"
        );
        let texts = error_texts(&errors);
        assert_eq!(texts.len(), 3, "one error per bad document: {texts:?}");
        assert!(
            texts[0].starts_with("mixed.yaml: Service demo/broken: "),
            "error names file, kind and object: {}",
            texts[0]
        );
        assert!(
            texts[1].starts_with("mixed.yaml: document 2: not a mapping"),
            "error names the document: {}",
            texts[1]
        );
        assert!(
            texts[2].starts_with("mixed.yaml: document 3: apiVersion or kind is missing"),
            "error names the document: {}",
            texts[2]
        );
    }

    #[test]
    fn defaults_and_required_fields() {
        let text = "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  managedFields:\n  - manager: kubectl\nspec:\n  clusterIP: 10.96.0.10\n---\napiVersion: v1\nkind: Service\nmetadata:\n  namespace: demo\nspec: {}\n";
        let (m, errors) = parse_manifest(Path::new("d.yaml"), text).expect("parses");
        assert_eq!(
            m.services[0].metadata.namespace.as_deref(),
            Some("default"),
            "a namespaced object without a namespace lands in default, as kubectl apply does"
        );
        assert_eq!(
            m.services[0].metadata.managed_fields, None,
            "managedFields are dropped"
        );
        let texts = error_texts(&errors);
        assert_eq!(
            texts.len(),
            1,
            "the nameless service is an error: {texts:?}"
        );
        assert!(
            texts[0].contains("Service demo/<unnamed>") && texts[0].contains("metadata.name"),
            "error names what is missing: {}",
            texts[0]
        );
    }

    #[test]
    fn unparsable_file_keeps_its_last_good_content() {
        let dir = TempDir::new("last-good");
        let file = dir.write("web.yaml", &service_yaml("web", "10.96.0.10"));
        let mut reader = ManifestReader::new(&dir.0);

        let first = reader.scan();
        assert!(first.changed, "first scan reads the file");
        assert_eq!(
            names(&first.manifests).0,
            strings(&["demo/web"]),
            "first scan"
        );

        dir.write(
            "web.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: [unclosed\n",
        );
        let broken = reader.scan();
        let texts = error_texts(&broken.errors);
        assert_eq!(texts.len(), 1, "one parse error: {texts:?}");
        assert!(
            texts[0].starts_with(&format!("{}: not valid YAML", file.display())),
            "the error names the file: {}",
            texts[0]
        );
        assert_eq!(
            names(&broken.manifests).0,
            strings(&["demo/web"]),
            "the broken file still contributes its last good service"
        );

        let again = reader.scan();
        assert!(!again.changed, "an unchanged broken file is not a change");
        assert!(
            again.errors.is_empty(),
            "an unchanged broken file is reported once"
        );
        assert_eq!(
            names(&again.manifests).0,
            strings(&["demo/web"]),
            "still the last good content"
        );

        dir.write("web.yaml", "");
        let truncated = reader.scan();
        assert_eq!(
            error_texts(&truncated.errors).len(),
            1,
            "an empty file is reported"
        );
        assert_eq!(
            names(&truncated.manifests).0,
            strings(&["demo/web"]),
            "an empty file (a save in progress) keeps the last good content"
        );

        dir.write("web.yaml", &service_yaml("web2", "10.96.0.11"));
        let fixed = reader.scan();
        assert!(
            fixed.errors.is_empty(),
            "fixed file: {:?}",
            error_texts(&fixed.errors)
        );
        assert_eq!(
            names(&fixed.manifests).0,
            strings(&["demo/web2"]),
            "the fixed content replaces the old"
        );
    }

    #[test]
    fn an_unchanged_tree_is_not_read_and_one_changed_file_is_the_only_one_parsed() {
        let dir = TempDir::new("many");
        // Stamps old enough not to be racy, as files are after their first seconds.
        let settle = |path: &Path| {
            let old = SystemTime::now() - 2 * RACY_WINDOW;
            fs::File::options()
                .write(true)
                .open(path)
                .and_then(|f| f.set_modified(old))
                .expect("set mtime");
        };
        let mut files = Vec::new();
        for i in 0..20 {
            let path = dir.write(
                &format!("svc-{i:02}.yaml"),
                &service_yaml(&format!("svc-{i}"), &format!("10.96.1.{i}")),
            );
            settle(&path);
            files.push(path);
        }
        let mut reader = ManifestReader::new(&dir.0);
        let first = reader.scan();
        assert_eq!(first.parsed.len(), 20, "the first scan parses every file");
        assert_eq!(first.manifests.services.len(), 20);

        for round in 0..3 {
            let again = reader.scan();
            assert!(
                again.read.is_empty() && again.parsed.is_empty() && !again.changed,
                "round {round}: an unchanged tree is neither read nor parsed: read {:?}, parsed {:?}",
                again.read,
                again.parsed
            );
            assert_eq!(again.manifests.services.len(), 20, "round {round}");
        }

        // Same size, other content: only the stamp's mtime and ctime tell.
        fs::write(&files[7], service_yaml("svc-7", "10.96.2.7")).expect("rewrite");
        settle(&files[7]);
        let changed = reader.refresh();
        assert_eq!(
            (&changed.read, &changed.parsed),
            (&vec![files[7].clone()], &vec![files[7].clone()]),
            "one changed file of twenty is the only one read and parsed"
        );
        assert_eq!(changed.kinds, [Kind::Service], "only Services changed");
        let (merged, _) = reader.manifests(&ALL_KINDS);
        let ip = |name: &str| {
            merged
                .services
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(name))
                .and_then(|s| s.spec.as_ref()?.cluster_ip.clone())
        };
        assert_eq!(ip("svc-7").as_deref(), Some("10.96.2.7"), "the new content");
        assert_eq!(ip("svc-8").as_deref(), Some("10.96.1.8"), "the others kept");

        // Touched, not changed: read again, not parsed, not a change.
        settle(&files[3]);
        let touched = reader.refresh();
        assert_eq!(
            (&touched.read, touched.parsed.len(), touched.changed),
            (&vec![files[3].clone()], 0, false),
            "a touched file is read but, its bytes the same, not parsed"
        );
    }

    #[test]
    fn a_file_written_moments_ago_is_read_again_until_its_stamp_is_old() {
        let dir = TempDir::new("racy");
        let file = dir.write("web.yaml", &service_yaml("web", "10.96.0.10"));
        let mut reader = ManifestReader::new(&dir.0);
        assert_eq!(reader.refresh().parsed, [file.as_path()], "first read");
        // Its mtime is within the window: a write in the same timestamp tick
        // would leave the stamp as it is, so the content is checked again.
        let again = reader.refresh();
        assert_eq!(
            (&again.read, again.parsed.len()),
            (&vec![file.clone()], 0),
            "a racy file is read again (and, unchanged, not parsed)"
        );
        let old = SystemTime::now() - 2 * RACY_WINDOW;
        fs::File::options()
            .write(true)
            .open(&file)
            .and_then(|f| f.set_modified(old))
            .expect("set mtime");
        assert_eq!(
            reader.refresh().read,
            [file.as_path()],
            "the new stamp is read"
        );
        let settled = reader.refresh();
        assert!(
            settled.read.is_empty(),
            "a file whose mtime is old is trusted to its stamp: read {:?}",
            settled.read
        );
    }

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

    #[test]
    fn kept_objects_decode_to_what_was_parsed() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/demo.yaml");
        let text = fs::read_to_string(&path).expect("demo.yaml");
        let (parsed, _) = parse_manifest(&path, &text).expect("demo.yaml parses");
        let scan = ManifestReader::new(&path).scan();
        assert_eq!(
            scan.manifests, parsed,
            "the objects kept encoded between scans come back as parsed"
        );
    }

    #[test]
    fn directory_of_files() {
        let dir = TempDir::new("dir");
        dir.write("a.yaml", &service_yaml("web", "10.96.0.10"));
        dir.write(
            "b.json",
            r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "namespace": "demo"}, "spec": {"clusterIP": "10.96.0.11"}}"#,
        );
        dir.write("c.yml", &slice_yaml("web-1", "web", "10.0.0.1"));
        dir.write(".a.yaml.swp", "garbage: [");
        dir.write("notes.txt", "not a manifest");
        fs::create_dir(dir.0.join("sub.yaml")).unwrap();
        let mut reader = ManifestReader::new(&dir.0);
        let scan = reader.scan();
        assert!(
            scan.errors.is_empty(),
            "unexpected errors: {:?}",
            error_texts(&scan.errors)
        );
        assert_eq!(
            names(&scan.manifests),
            (
                strings(&["demo/web", "demo/api"]),
                strings(&["demo/web-1"]),
                vec![]
            ),
            "objects of a.yaml, b.json, c.yml in path order; hidden, .txt and directories skipped"
        );

        fs::remove_file(dir.0.join("b.json")).unwrap();
        let scan = reader.scan();
        assert!(scan.changed, "a removed file is a change");
        assert_eq!(
            names(&scan.manifests).0,
            strings(&["demo/web"]),
            "a removed file's objects go"
        );

        let scan = reader.scan();
        assert!(!scan.changed, "nothing changed since");
    }

    #[test]
    fn duplicates_keep_the_first_file() {
        let dir = TempDir::new("dup");
        dir.write("a.yaml", &service_yaml("web", "10.96.0.10"));
        let second = dir.write("b.yaml", &service_yaml("web", "10.96.0.99"));
        let scan = ManifestReader::new(&dir.0).scan();
        assert_eq!(scan.manifests.services.len(), 1, "one copy of demo/web");
        assert_eq!(
            scan.manifests.services[0]
                .spec
                .as_ref()
                .unwrap()
                .cluster_ip
                .as_deref(),
            Some("10.96.0.10"),
            "the copy from a.yaml wins"
        );
        let texts = error_texts(&scan.errors);
        assert_eq!(texts.len(), 1, "one duplicate error: {texts:?}");
        assert!(
            texts[0].starts_with(&format!(
                "{}: Service demo/web is also defined in",
                second.display()
            )),
            "the error names both files: {}",
            texts[0]
        );
    }

    #[test]
    fn missing_path_is_an_error_naming_it() {
        let dir = TempDir::new("missing");
        let path = dir.0.join("nope.yaml");
        let err = load(&path).expect_err("a missing path cannot be loaded");
        assert!(
            err.to_string().starts_with(&path.display().to_string()),
            "error names the path: {err}"
        );
    }

    #[test]
    fn demo_manifest_programs_web() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples/demo.yaml");
        let (m, errors) = load(&path).expect("demo.yaml loads");
        assert!(
            errors.is_empty(),
            "demo.yaml errors: {:?}",
            error_texts(&errors)
        );
        let mut state = ClusterState::new("demo-node");
        for event in m.into_events() {
            state.apply(event);
        }
        let key = ObjectKey {
            namespace: "demo".into(),
            name: "web".into(),
        };
        let frontends = state
            .frontends_for(&key, &ModelConfig::default())
            .expect("demo/web is valid");
        let got: Vec<String> = frontends
            .iter()
            .map(|f| {
                let backends: Vec<String> = f
                    .backends
                    .iter()
                    .map(crate::model::BackendAddr::host_port)
                    .collect();
                format!("{} -> {}", f.key, backends.join(" "))
            })
            .collect();
        assert_eq!(
            got,
            [
                "10.96.0.10:80/TCP -> 10.200.0.11:8080 10.200.0.12:8080 10.200.0.13:8080",
                "10.96.0.10:53/UDP -> 10.200.0.11:5353 10.200.0.12:5353 10.200.0.13:5353",
            ],
            "demo/web frontends"
        );
    }

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
                    Object::Service(s) => s.spec.as_ref().unwrap().cluster_ip.clone().unwrap(),
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
