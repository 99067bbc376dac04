//! Temporary manifest trees and the texts written to them, shared by the
//! tests of decoding, reading and watching.

use std::{
    fs,
    path::PathBuf,
    sync::atomic::{AtomicUsize, Ordering},
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{error::ManifestError, events::Manifests};

/// A fresh directory under the system temp dir, removed on drop.
pub(super) struct TempDir(pub(super) PathBuf);

impl TempDir {
    pub(super) fn new(test: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ebpf-proxy-manifest-{test}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub(super) fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, text).expect("write manifest");
        path
    }

    /// Replaces a file the way editors do: write a temp file, rename it
    /// over the original.
    pub(super) fn replace(&self, name: &str, text: &str) {
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

pub(super) fn service_yaml(name: &str, cluster_ip: &str) -> String {
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

pub(super) fn slice_yaml(name: &str, service: &str, ip: &str) -> String {
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

pub(super) fn names(m: &Manifests) -> (Vec<String>, Vec<String>, Vec<String>) {
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

pub(super) fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(ToString::to_string).collect()
}

pub(super) fn error_texts(errors: &[ManifestError]) -> Vec<String> {
    errors.iter().map(ToString::to_string).collect()
}
