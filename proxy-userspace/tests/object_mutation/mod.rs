//! Valid Services, EndpointSlices and Nodes as JSON, and mutations of
//! them: fields deleted, replaced by wrong values of their own type (huge
//! or negative numbers, bad addresses and protocols, unicode) or of another
//! (nesting included), extra fields. Shared by the manifest decoding test
//! (`decode_fuzz.rs`) and the API source's (`tests/tests/kube_decode_fuzz.rs`).

use serde_json::{Value, json};

pub fn service() -> Value {
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

pub fn slice() -> Value {
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

pub fn node() -> Value {
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

/// A place in a document: keys and indices from the top.
#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize),
}

/// Every place in `value`, containers and leaves alike.
fn places(value: &Value, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(at.clone());
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                at.push(Step::Key(k.clone()));
                places(v, at, out);
                at.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                at.push(Step::Index(i));
                places(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// One mutation at the place `place` picks (uniformly over every place of
/// the document): the value there replaced (mostly), deleted, or given an
/// extra field or item.
pub fn mutate(value: &mut Value, place: u64, op: u8, pick: u64) {
    let mut all = Vec::new();
    places(value, &mut Vec::new(), &mut all);
    let path = &all[(place % all.len() as u64) as usize];
    let Some((last, parent_path)) = path.split_last() else {
        *value = replacement(value, pick);
        return;
    };
    let mut parent = &mut *value;
    for step in parent_path {
        parent = match step {
            Step::Key(k) => &mut parent[k.as_str()],
            Step::Index(i) => &mut parent[*i],
        };
    }
    let target = match last {
        Step::Key(k) => &mut parent[k.as_str()],
        Step::Index(i) => &mut parent[*i],
    };
    match op % 20 {
        0..=11 => *target = replacement(target, pick),
        12..=16 => match (parent, last) {
            (Value::Object(map), Step::Key(k)) => {
                map.remove(k);
            }
            (Value::Array(items), Step::Index(i)) => {
                items.remove(*i);
            }
            _ => unreachable!("a step matches its parent"),
        },
        _ => match target {
            Value::Object(map) => {
                map.insert(format!("extra{pick}"), replacement(&json!(0), pick));
            }
            Value::Array(items) => items.push(replacement(&json!(""), pick)),
            leaf => *leaf = replacement(leaf, pick),
        },
    }
}
