//! One document as the objects of the kinds the proxy uses, each checked
//! on its own: a bad object is skipped and named, and the rest of its file
//! still loads.

use std::path::Path;

use k8s_openapi::{
    api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde_json::Value;
use tracing::debug;

use super::{error::ManifestError, events::Manifests};

pub(super) fn add_document(
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::source::manifest::{
        documents::parse_manifest,
        test_support::{error_texts, names, service_yaml, slice_yaml, strings},
    };

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
}
