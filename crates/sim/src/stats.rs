//! What the simulator has been asked to do, so proxy tests can check what actually reached the
//! backend (which model, which token caps, which tenant, which trace context, how many at once,
//! in which order they were scheduled, how many were aborted, how much of their prompts the
//! cache served).

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
    /// The body's bytes as received (a body resent on failover arrives whole).
    pub body_bytes: usize,
    /// The W3C trace context it came with, as received (vLLM's `llm_request` span would be the
    /// child of the `traceparent`'s parent id).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
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
            body_bytes: 0,
            traceparent: None,
            tracestate: None,
        }
    }
}

/// One request leaving the waiting queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Admission {
    /// The engine's admission order, 1-based: the order tasks log in may differ.
    pub seq: u64,
    pub id: String,
    pub request_id: Option<String>,
    pub model: String,
    pub priority: i64,
    pub queue_ms: f64,
    pub cached_tokens: u64,
}

#[derive(Default)]
struct Counters {
    received: u64,
    by_path: BTreeMap<String, u64>,
    by_model: BTreeMap<String, u64>,
    completed: u64,
    aborted: u64,
    prefix_queries: u64,
    prefix_hits: u64,
    admitted_by_priority: BTreeMap<i64, u64>,
    recent: VecDeque<Recent>,
    admissions: VecDeque<Admission>,
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

    /// A request whose client went away before its answer ended, queued or running.
    pub(crate) fn aborted(&self) {
        self.with(|c| c.aborted += 1);
    }

    pub(crate) fn prefix_cache(&self, queried: u64, hit: u64) {
        self.with(|c| {
            c.prefix_queries += queried;
            c.prefix_hits += hit;
        });
    }

    pub(crate) fn admitted(&self, a: Admission) {
        self.with(|c| {
            *c.admitted_by_priority.entry(a.priority).or_default() += 1;
            if c.admissions.len() == RECENT {
                c.admissions.pop_front();
            }
            c.admissions.push_back(a);
        });
    }

    pub(crate) fn reset(&self) {
        self.with(|c| *c = Counters::default());
    }

    pub(crate) fn to_json(&self, load: &Snapshot) -> Value {
        self.with(|c| {
            let mut admissions: Vec<&Admission> = c.admissions.iter().collect();
            admissions.sort_by_key(|a| a.seq);
            json!({
                "received": c.received,
                "by_path": c.by_path,
                "by_model": c.by_model,
                // The same counts under the name fleet tests use: every completion request by
                // the model it named (the default model when it named none), served or not.
                "requests_by_model": c.by_model,
                "running": load.running,
                "waiting": load.waiting,
                "peak_running": load.peak_running,
                "peak_in_flight": load.peak_in_flight,
                "kv_used_tokens": load.kv_used,
                "kv_written_tokens": load.kv_written,
                "kv_cached_free_tokens": load.kv_cached_free,
                "completed": c.completed,
                "aborted": c.aborted,
                "prefix_cache_queries_tokens": c.prefix_queries,
                "prefix_cache_hit_tokens": c.prefix_hits,
                "admitted_by_priority": c.admitted_by_priority,
                "admissions": admissions,
                "recent": c.recent,
                // The `traceparent` of each of `recent`, oldest first (null: none was sent).
                "last_traceparents": c.recent.iter().map(|r| r.traceparent.as_deref()).collect::<Vec<_>>(),
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
        s.aborted();
        s.prefix_cache(100, 64);
        s.prefix_cache(50, 0);
        for (seq, priority) in [(2, 1), (1, -1), (3, 1)] {
            s.admitted(Admission {
                seq,
                id: format!("cmpl-{seq}"),
                request_id: None,
                model: "m".into(),
                priority,
                queue_ms: 0.0,
                cached_tokens: 0,
            });
        }
        let v = s.to_json(&Snapshot::default());
        assert_eq!(v["received"], 60);
        assert_eq!(v["by_model"]["m"], 60);
        assert_eq!(v["requests_by_model"], json!({"m": 60}));
        assert_eq!((&v["aborted"], &v["completed"]), (&json!(1), &json!(1)));
        assert_eq!(v["prefix_cache_queries_tokens"], 150);
        assert_eq!(v["prefix_cache_hit_tokens"], 64);
        assert_eq!(v["admitted_by_priority"], json!({"-1": 1, "1": 2}));
        let ids: Vec<&str> = v["admissions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["cmpl-1", "cmpl-2", "cmpl-3"]);
        assert_eq!(v["by_path"]["/v1/completions"], 60);
        assert_eq!(v["completed"], 1);
        let recent = v["recent"].as_array().unwrap();
        assert_eq!(recent.len(), 50);
        assert_eq!(recent[0]["max_tokens"], 10);
        assert_eq!(recent[49]["content_length"], "10");
        assert_eq!(recent[49]["max_completion_tokens"], Value::Null);
        assert_eq!(v["last_traceparents"].as_array().unwrap().len(), 50);
        assert_eq!(v["last_traceparents"][49], Value::Null);
        s.reset();
        let v = s.to_json(&Snapshot::default());
        assert_eq!((&v["received"], &v["aborted"]), (&json!(0), &json!(0)));
        assert_eq!(v["admissions"], json!([]));
    }
}
