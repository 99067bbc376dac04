//! A file's text as a stream of YAML or JSON documents. A syntax error
//! anywhere in it fails the whole file, which is then most likely being
//! edited; its objects are checked one by one in `objects`.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::{error::ManifestError, events::Manifests, objects::add_document};

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

pub(super) fn is_json(path: &Path) -> bool {
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::source::manifest::test_support::{
        error_texts, names, service_yaml, slice_yaml, strings,
    };

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
}
