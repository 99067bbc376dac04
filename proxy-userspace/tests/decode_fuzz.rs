//! Manifest decoding and the model on mutated objects: whatever a file or
//! the API holds (fields deleted, wrong types, huge or negative numbers, bad
//! addresses and protocols, unicode, deep nesting, truncated text), reading
//! it never panics, and every error names the object: the file, the kind
//! and namespace/name where those are known.

use std::path::Path;

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proptest::prelude::*;
use proxy_userspace::{
    model::{self, ModelConfig, NodeInfo},
    source::manifest::{ManifestError, parse_manifest},
};
use serde_json::{Value, json};

fn service() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "demo", "labels": {"app": "web"}},
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.10",
            "clusterIPs": ["10.96.0.10"],
            "ipFamilies": ["IPv4"],
            "ports": [
                {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30080},
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns", "nodePort": 30053}
            ],
            "externalIPs": ["192.0.2.10"],
            "externalTrafficPolicy": "Local",
            "internalTrafficPolicy": "Cluster",
            "healthCheckNodePort": 32000,
            "loadBalancerSourceRanges": ["192.0.2.0/24"],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}
        },
        "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.7"}]}}
    })
}

fn slice() -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-1",
            "namespace": "demo",
            "labels": {"kubernetes.io/service-name": "web"}
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": ["10.0.0.1"],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": "node-a",
                "zone": "z1",
                "hints": {"forZones": [{"name": "z1"}]}
            },
            {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true}}
        ],
        "ports": [
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 5353, "protocol": "UDP"}
        ]
    })
}

fn node() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}}
    })
}

/// Values of a field's own type that are still wrong, and values of other
/// types.
fn replacement(original: &Value, pick: u64) -> Value {
    let same_type: Vec<Value> = match original {
        Value::Number(_) => vec![
            json!(0),
            json!(-1),
            json!(-65536),
            json!(65536),
            json!(i32::MAX),
            json!(i32::MIN),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(1.5),
            json!(1e300),
        ],
        Value::String(_) => vec![
            json!(""),
            json!("300.1.2.3"),
            json!("10.0.0.1/33"),
            json!("::ffff:10.0.0.1"),
            json!("fe80::1%eth0"),
            json!("None"),
            json!("SCTP"),
            json!("tcp"),
            json!("ñ\u{202e}鍵🦀"),
            json!("a\u{0}b"),
            json!("x".repeat(70_000)),
            json!("-1"),
            json!("99999999999999999999"),
        ],
        Value::Bool(_) => vec![json!(true), json!(false)],
        _ => vec![],
    };
    let other_types = [
        Value::Null,
        json!("a string"),
        json!(-7),
        json!(true),
        json!([]),
        json!([1, "two", null]),
        json!({}),
        json!({"unexpected": {"deep": [1]}}),
        nested(64),
    ];
    let n = same_type.len() as u64;
    if pick % 10 < 7 && n > 0 {
        same_type[(pick / 10 % n) as usize].clone()
    } else {
        other_types[(pick / 10 % other_types.len() as u64) as usize].clone()
    }
}

/// Arrays nested `depth` deep.
fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |v, _| json!([v]))
}

/// One mutation at a place chosen by `path` (a stream of choices, one per
/// level): the value there replaced, deleted, or given an extra field.
fn mutate(value: &mut Value, mut path: u64, op: u8, pick: u64) {
    let mut at = value;
    loop {
        let stop = path % 4 == 0;
        path /= 4;
        let children = match at {
            Value::Object(map) => map.len(),
            Value::Array(items) => items.len(),
            _ => 0,
        };
        if stop || children == 0 {
            break;
        }
        let i = (path % children as u64) as usize;
        path /= children as u64;
        let last = match at {
            Value::Object(map) => {
                let key = map.keys().nth(i).expect("in range").clone();
                let child = map.get(&key).expect("present");
                if stop_here(child, path) {
                    match op % 3 {
                        0 => {
                            map.remove(&key);
                            return;
                        }
                        1 => {
                            let new = replacement(child, pick);
                            map.insert(key, new);
                            return;
                        }
                        _ => {}
                    }
                }
                map.get_mut(&key).expect("present")
            }
            Value::Array(items) => &mut items[i],
            _ => unreachable!("children counted above"),
        };
        at = last;
    }
    match (op % 3, at) {
        (2, Value::Object(map)) => {
            map.insert(format!("extra{pick}"), replacement(&json!(0), pick));
        }
        (2, Value::Array(items)) => items.push(replacement(&json!(""), pick)),
        (_, leaf) => *leaf = replacement(leaf, pick),
    }
}

/// Whether a mutation stops at `child` (scalar children always do).
fn stop_here(child: &Value, path: u64) -> bool {
    !(child.is_object() || child.is_array()) || path % 3 == 0
}

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
            assert!(
                documents.is_empty()
                    || object.contains("<unnamed>")
                    || stated.iter().any(|s| s == object),
                "an error names {object}, which no document is ({stated:?}): {text}"
            );
        }
    }
    let node = NodeInfo {
        name: "node-a".into(),
        zone: Some("z1".into()),
    };
    let config = ModelConfig::default();
    let slices: Vec<&EndpointSlice> = manifests.endpoint_slices.iter().collect();
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
        reached.model_errors += modelled.0.is_err() as usize + modelled.1.is_err() as usize;
        for e in [modelled.0.err(), modelled.1.err()].into_iter().flatten() {
            let text = e.to_string();
            let names_it = match &e {
                model::ModelError::InvalidService { service, .. } => *service == name,
                model::ModelError::InvalidSlice { slice, .. } => {
                    slices.iter().any(|s| *slice == slice_name(s))
                }
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
