//! One shared copy of each string that repeats across objects: node names,
//! namespaces, port names and zones are in every slice, so the agent keeps
//! each once. Every object the model keeps interns through here.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

static STRINGS: Mutex<Option<HashSet<Arc<str>>>> = Mutex::new(None);

/// One shared copy of `text`: node names, namespaces, port names and zones
/// repeat across every slice, so each is kept once for the agent.
pub fn intern(text: &str) -> Arc<str> {
    let mut strings = STRINGS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let strings = strings.get_or_insert_with(HashSet::new);
    if let Some(shared) = strings.get(text) {
        return Arc::clone(shared);
    }
    let shared: Arc<str> = Arc::from(text);
    strings.insert(Arc::clone(&shared));
    shared
}

/// Forgets the strings no object holds any more (after a listing replaced
/// a kind, say), so departed nodes and namespaces do not stay forever.
pub fn forget_unused_strings() {
    let mut strings = STRINGS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(strings) = strings.as_mut() {
        strings.retain(|s| Arc::strong_count(s) > 1);
    }
}
