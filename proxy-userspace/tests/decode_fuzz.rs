//! Manifest decoding and the model on mutated objects: whatever a file or
//! the API holds (fields deleted, wrong types, huge or negative numbers, bad
//! addresses and protocols, unicode, deep nesting, truncated text), reading
//! it never panics, and every error names the object: the file, the kind
//! and namespace/name where those are known.

use std::path::Path;

mod object_mutation;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use object_mutation::{mutate, node, service, slice};
use proptest::prelude::*;
use proxy_userspace::{
    model::{self, ModelConfig, NodeInfo},
    source::manifest::{ManifestError, parse_manifest},
};
use serde_json::{Value, json};

/// `namespace/name` as the document states them (what an error must name),
/// or `None` when the name is not a string.
fn object_name(document: &Value) -> Option<String> {
    let meta = document.get("metadata")?;
    let name = meta.get("name")?.as_str()?;
    let namespace = meta
        .get("namespace")
        .and_then(Value::as_str)
        .unwrap_or("default");
    Some(match document.get("kind").and_then(Value::as_str) {
        Some("Node") => name.to_owned(),
        _ => format!("{namespace}/{name}"),
    })
}

/// What one reading reached, so that a run shows it went past the parser.
#[derive(Default)]
struct Reached {
    manifest_errors: usize,
    services: usize,
    frontends: usize,
    model_errors: usize,
}

/// Reads `text` as file `path` and runs the model on what loads; panics
/// with what went wrong when an error does not name its object.
fn read_and_model(path: &Path, text: &str, documents: &[Value]) -> Reached {
    let mut reached = Reached::default();
    let parsed = std::panic::catch_unwind(|| parse_manifest(path, text))
        .unwrap_or_else(|_| panic!("parse_manifest panicked on:\n{}", preview(text)));
    let file = path.display().to_string();
    let (manifests, errors) = match parsed {
        Ok(loaded) => loaded,
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.starts_with(&file),
                "a file-level error does not name the file: {text}"
            );
            reached.manifest_errors += 1;
            return reached;
        }
    };
    reached.manifest_errors += errors.len();
    for e in &errors {
        let text = e.to_string();
        assert!(
            text.starts_with(&file),
            "an error does not name the file: {text}"
        );
        if let ManifestError::InvalidObject { kind, object, .. } = e {
            assert!(
                text.contains(kind) && text.contains(object.as_str()),
                "an error does not name its object's kind and name: {text}"
            );
            let stated: Vec<String> = documents.iter().filter_map(object_name).collect();
            // `<unnamed>` only for a document whose name is not a string.
            let unnamed =
                object.contains("<unnamed>") && documents.iter().any(|d| object_name(d).is_none());
            assert!(
                documents.is_empty() || unnamed || stated.iter().any(|s| s == object),
                "an error names {object}, which no document is ({stated:?}): {text}"
            );
        }
    }
    let node = NodeInfo {
        name: "node-a".into(),
        zone: Some("z1".into()),
    };
    let config = ModelConfig::default();
    let slices: Vec<model::Slice> = manifests
        .endpoint_slices
        .iter()
        .map(model::Slice::from)
        .collect();
    let slices: Vec<&model::Slice> = slices.iter().collect();
    for service in &manifests.services {
        let name = service_name(service);
        let modelled = std::panic::catch_unwind(|| {
            (
                model::service_frontends(service, &slices, &node, &config),
                model::service_health_check(service, &slices, &node, &config),
            )
        })
        .unwrap_or_else(|_| panic!("the model panicked on Service {name}: {service:?}"));
        reached.services += 1;
        reached.frontends += modelled.0.as_ref().map_or(0, Vec::len);
        reached.model_errors += usize::from(modelled.0.is_err()) + usize::from(modelled.1.is_err());
        for e in [modelled.0.err(), modelled.1.err()].into_iter().flatten() {
            let text = e.to_string();
            let names_it = match &e {
                model::ModelError::InvalidService { service, .. } => *service == name,
                model::ModelError::InvalidSlice { slice, .. } => manifests
                    .endpoint_slices
                    .iter()
                    .any(|s| *slice == slice_name(s)),
            };
            assert!(
                names_it,
                "a model error for Service {name} does not name the object: {text}"
            );
        }
    }
    reached
}

fn service_name(s: &Service) -> String {
    format!(
        "{}/{}",
        s.metadata.namespace.as_deref().unwrap_or("default"),
        s.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn slice_name(s: &EndpointSlice) -> String {
    format!(
        "{}/{}",
        s.metadata.namespace.as_deref().unwrap_or("default"),
        s.metadata.name.as_deref().unwrap_or("<unnamed>")
    )
}

fn preview(text: &str) -> String {
    text.chars().take(2000).collect()
}

/// One mutation: where, what, and with which value.
fn mutation() -> impl Strategy<Value = (usize, u64, u8, u64)> {
    (0usize..3, any::<u64>(), any::<u8>(), any::<u64>())
}

/// Services, EndpointSlices and a Node, mutated, written as YAML
/// (multi-document or a `kind: List`) or JSON, sometimes cut short.
#[test]
fn mutated_manifests_never_panic_and_errors_name_the_object() {
    let case = (
        prop::collection::vec(mutation(), 1..6),
        0u8..3,
        prop::option::weighted(0.15, any::<prop::sample::Index>()),
    );
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let total = std::cell::RefCell::new(Reached::default());
    runner
        .run(&case, |(mutations, format, cut)| {
            let mut documents = vec![service(), slice(), node()];
            for (which, path, op, pick) in mutations {
                mutate(&mut documents[which], path, op, pick);
            }
            let list = || json!({"apiVersion": "v1", "kind": "List", "items": documents});
            let (name, mut text) = match format {
                0 => (
                    "objects.yaml",
                    documents
                        .iter()
                        .map(|d| serde_yaml::to_string(d).expect("YAML"))
                        .collect::<Vec<_>>()
                        .join("---\n"),
                ),
                1 => ("list.yaml", serde_yaml::to_string(&list()).expect("YAML")),
                _ => ("list.json", serde_json::to_string(&list()).expect("JSON")),
            };
            if let Some(cut) = cut {
                let mut at = cut.index(text.len() + 1);
                while !text.is_char_boundary(at) {
                    at -= 1;
                }
                text.truncate(at);
                // A cut may fall inside a name: the names stated are unknown.
                documents.clear();
            }
            let r = read_and_model(Path::new(name), &text, &documents);
            let mut t = total.borrow_mut();
            t.manifest_errors += r.manifest_errors;
            t.services += r.services;
            t.frontends += r.frontends;
            t.model_errors += r.model_errors;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let t = total.into_inner();
    eprintln!(
        "{CASES} mutated files: {} errors reading them; {} Services modelled into {} \
         frontends, {} model errors",
        t.manifest_errors, t.services, t.frontends, t.model_errors
    );
    // The mutations must reach past the parser into the model, and the
    // model must see both good and bad Services.
    assert!(
        t.manifest_errors > CASES as usize / 10
            && t.services > CASES as usize / 4
            && t.frontends > 0
            && t.model_errors > CASES as usize / 50,
        "the mutations did not reach every stage"
    );
}

const CASES: u32 = 3000;

/// Text no serializer would write: nesting far past any parser's limit,
/// alias bombs, tags, binary junk.
#[test]
fn hostile_texts_are_errors_naming_the_file() {
    let bomb = {
        let mut t = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (i, prev) in (b'b'..=b'k').zip(b'a'..) {
            let (i, prev) = (i as char, prev as char);
            t += &format!(
                "{i}: &{i} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            );
        }
        t + "apiVersion: v1\nkind: Service\nmetadata: {name: bomb}\n"
    };
    let cases: Vec<(&str, String)> = vec![
        ("deep.yaml", format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000))),
        ("deep-map.yaml", "a: {".repeat(20_000)),
        ("deep.json", format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000))),
        ("bomb.yaml", bomb),
        ("tagged.yaml", "apiVersion: v1\nkind: !!binary Service\nmetadata: !custom {name: x}\n".into()),
        ("junk.yaml", String::from_utf8_lossy(&[0xff, 0xfe, 0, 1, 2, b':', b'-', b'-']).into_owned()),
        ("list-in-list.yaml", "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: List\n  items:\n  - {apiVersion: v1, kind: Service, metadata: {name: inner}, spec: {ports: 7}}\n".into()),
        ("numbers.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: n}\nspec: {ports: [{port: 1e400}, {port: 99999999999999999999999}]}\n".into()),
    ];
    for (name, text) in cases {
        read_and_model(Path::new(name), &text, &[]);
    }
    // An object inside a nested List is still reported with its own name.
    let (_, errors) = parse_manifest(
        Path::new("list-in-list.yaml"),
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: List\n  items:\n  - {apiVersion: v1, kind: Service, metadata: {name: inner}, spec: {ports: 7}}\n",
    )
    .expect("parses");
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(
        texts.len() == 1 && texts[0].starts_with("list-in-list.yaml: Service default/inner: "),
        "{texts:?}"
    );
}
