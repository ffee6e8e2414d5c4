//! Runtime switches that let tests put the simulator into states that are hard to reach with
//! real load: an unhealthy engine, a slow one, or a pinned KV pressure / queue depth.

use std::sync::{Mutex, PoisonError};

use serde::Serialize;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Switches {
    pub healthy: bool,
    /// Added to every request's time to first token.
    pub extra_ms: f64,
    /// Overrides the *reported* KV usage; scheduling still uses the real one.
    pub kv_usage: Option<f64>,
    /// Overrides the *reported* waiting-queue depth.
    pub waiting: Option<u64>,
}

impl Default for Switches {
    fn default() -> Self {
        Self {
            healthy: true,
            extra_ms: 0.0,
            kv_usage: None,
            waiting: None,
        }
    }
}

#[derive(Default)]
pub(crate) struct Admin {
    switches: Mutex<Switches>,
}

impl Admin {
    pub(crate) fn get(&self) -> Switches {
        *self.switches.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Validates the whole body before changing anything, so a bad request leaves state alone.
    fn update(
        &self,
        f: impl FnOnce(&mut Switches) -> Result<(), String>,
    ) -> Result<Switches, String> {
        let mut guard = self.switches.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = *guard;
        f(&mut next)?;
        *guard = next;
        Ok(next)
    }

    /// `{"healthy": bool}`
    pub(crate) fn set_health(&self, body: &Value) -> Result<Switches, String> {
        let healthy = body
            .get("healthy")
            .and_then(Value::as_bool)
            .ok_or("expected {\"healthy\": true|false}")?;
        self.update(|s| {
            s.healthy = healthy;
            Ok(())
        })
    }

    /// `{"extra_ms": N}`; 0 clears.
    pub(crate) fn set_latency(&self, body: &Value) -> Result<Switches, String> {
        let extra = body
            .get("extra_ms")
            .and_then(Value::as_f64)
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or("expected {\"extra_ms\": non-negative number}")?;
        self.update(|s| {
            s.extra_ms = extra;
            Ok(())
        })
    }

    /// `{"usage": 0..1 | null, "waiting": N | null}`; an absent key is left as it was.
    pub(crate) fn set_kv(&self, body: &Value) -> Result<Switches, String> {
        if !body.is_object() {
            return Err("expected a JSON object".into());
        }
        self.update(|s| {
            match body.get("usage") {
                None => {}
                Some(Value::Null) => s.kv_usage = None,
                Some(v) => {
                    let u = v
                        .as_f64()
                        .filter(|u| (0.0..=1.0).contains(u))
                        .ok_or("usage must be a number in 0..=1 or null")?;
                    s.kv_usage = Some(u);
                }
            }
            match body.get("waiting") {
                None => {}
                Some(Value::Null) => s.waiting = None,
                Some(v) => {
                    let w = v
                        .as_u64()
                        .ok_or("waiting must be a non-negative integer or null")?;
                    s.waiting = Some(w);
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn switches_apply_and_validate() {
        let a = Admin::default();
        assert!(a.get().healthy);
        assert!(!a.set_health(&json!({"healthy": false})).unwrap().healthy);
        assert!(a.set_health(&json!({"healthy": "no"})).is_err());
        assert!(!a.get().healthy);
        assert_eq!(
            a.set_latency(&json!({"extra_ms": 250})).unwrap().extra_ms,
            250.0
        );
        assert!(a.set_latency(&json!({"extra_ms": -1})).is_err());
        let s = a.set_kv(&json!({"usage": 0.9, "waiting": 4})).unwrap();
        assert_eq!((s.kv_usage, s.waiting), (Some(0.9), Some(4)));
        let s = a.set_kv(&json!({"usage": null})).unwrap();
        assert_eq!((s.kv_usage, s.waiting), (None, Some(4)));
        // A bad key rejects the whole body.
        assert!(a.set_kv(&json!({"usage": 0.5, "waiting": -2})).is_err());
        assert_eq!(a.get().kv_usage, None);
    }
}
