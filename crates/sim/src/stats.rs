//! What the simulator has been asked to do, so proxy tests can check what actually reached the
//! backend (which model, which token caps, which tenant, how many at once).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, PoisonError};

use serde::Serialize;
use serde_json::{json, Value};

use super::engine::Snapshot;

const RECENT: usize = 50;

/// One received completion request as the proxy shaped it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Recent {
    pub path: String,
    pub model: Value,
    pub max_tokens: Value,
    pub max_completion_tokens: Value,
    /// The raw header, to check that a proxy which rewrote the body also fixed its length.
    pub content_length: Option<String>,
    pub tenant: Option<String>,
}

impl Recent {
    /// Takes fields from the body as sent; absent or unparseable ones are null.
    pub(crate) fn new(
        path: &str,
        body: Option<&Value>,
        content_length: Option<String>,
        tenant: Option<String>,
    ) -> Self {
        let field = |k: &str| body.and_then(|b| b.get(k)).cloned().unwrap_or(Value::Null);
        Self {
            path: path.to_string(),
            model: field("model"),
            max_tokens: field("max_tokens"),
            max_completion_tokens: field("max_completion_tokens"),
            content_length,
            tenant,
        }
    }
}

#[derive(Default)]
struct Counters {
    received: u64,
    by_path: BTreeMap<String, u64>,
    by_model: BTreeMap<String, u64>,
    completed: u64,
    recent: VecDeque<Recent>,
}

#[derive(Default)]
pub(crate) struct Stats {
    counters: Mutex<Counters>,
}

impl Stats {
    fn with<T>(&self, f: impl FnOnce(&mut Counters) -> T) -> T {
        f(&mut self.counters.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Counts a completion request; `model` is the one it resolves to (the default when absent).
    pub(crate) fn received(&self, recent: Recent, model: Option<&str>) {
        self.with(|c| {
            c.received += 1;
            *c.by_path.entry(recent.path.clone()).or_default() += 1;
            if let Some(m) = model {
                *c.by_model.entry(m.to_string()).or_default() += 1;
            }
            if c.recent.len() == RECENT {
                c.recent.pop_front();
            }
            c.recent.push_back(recent);
        });
    }

    pub(crate) fn completed(&self) {
        self.with(|c| c.completed += 1);
    }

    pub(crate) fn reset(&self) {
        self.with(|c| *c = Counters::default());
    }

    pub(crate) fn to_json(&self, load: &Snapshot) -> Value {
        self.with(|c| {
            json!({
                "received": c.received,
                "by_path": c.by_path,
                "by_model": c.by_model,
                "running": load.running,
                "waiting": load.waiting,
                "peak_running": load.peak_running,
                "peak_in_flight": load.peak_in_flight,
                "kv_used_tokens": load.kv_used,
                "kv_written_tokens": load.kv_written,
                "completed": c.completed,
                "recent": c.recent,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_keeps_last_fifty_and_resets() {
        let s = Stats::default();
        for i in 0..60 {
            let body = json!({"model": "m", "max_tokens": i});
            s.received(
                Recent::new("/v1/completions", Some(&body), Some("10".into()), None),
                Some("m"),
            );
        }
        s.completed();
        let v = s.to_json(&Snapshot::default());
        assert_eq!(v["received"], 60);
        assert_eq!(v["by_model"]["m"], 60);
        assert_eq!(v["by_path"]["/v1/completions"], 60);
        assert_eq!(v["completed"], 1);
        let recent = v["recent"].as_array().unwrap();
        assert_eq!(recent.len(), 50);
        assert_eq!(recent[0]["max_tokens"], 10);
        assert_eq!(recent[49]["content_length"], "10");
        assert_eq!(recent[49]["max_completion_tokens"], Value::Null);
        s.reset();
        assert_eq!(s.to_json(&Snapshot::default())["received"], 0);
    }
}
