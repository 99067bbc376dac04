//! The files under a path, read again only when their stamp changed and
//! parsed again only when their bytes did; a file that no longer parses
//! keeps its last good objects. Of two objects with one kind and key, the
//! first file's wins.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    time::SystemTime,
};

use k8s_openapi::{
    api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use tracing::debug;

use super::{
    documents::{is_json, parse_manifest},
    encoded::{Encoded, decode},
    error::ManifestError,
    events::{ALL_KINDS, Manifests},
    stamp::{Stamp, digest},
};
use crate::source::Kind;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::manifest::stamp::RACY_WINDOW;
    use crate::{
        model::ModelConfig,
        source::{
            ObjectKey,
            manifest::test_support::{
                TempDir, error_texts, names, service_yaml, slice_yaml, strings,
            },
        },
        state::ClusterState,
    };

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
}
