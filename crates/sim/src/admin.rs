//! Runtime switches that let tests put the simulator into states that are hard to reach with
//! real load: an unhealthy engine, a slow one, a pinned KV pressure / queue depth, or a replica
//! that fails the way a dying one does (`PUT /admin/fail`).

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

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
    /// How completion requests fail (`PUT /admin/fail`).
    pub fail: Fail,
    /// Completion requests left to fail this way; `None`: until cleared.
    pub fail_count: Option<u64>,
    /// `cut`: SSE events a stream sends before its connection is closed.
    pub cut_after_events: u32,
}

/// How the simulator fails, as a replica that is dying does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Fail {
    #[default]
    None,
    /// The listener is closed (connections refused) and every open connection reset, for
    /// `for_ms`; then the simulator listens again on the same address.
    Refuse,
    /// A completion request is read, then its connection reset before any response byte.
    Reset,
    /// Completions and `/health` answer 503 (as `PUT /admin/health {"healthy": false}`).
    Unavailable,
    /// A completion answers with this status (`status`, default 503); `/health` stays 200.
    Status(u16),
    /// A streamed completion's connection is closed after `after_events` SSE events (a
    /// non-streamed one is answered).
    Cut,
}

/// What one completion request meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failing {
    No,
    Reset,
    Status(u16),
    Cut(u32),
}

impl Default for Switches {
    fn default() -> Self {
        Self {
            healthy: true,
            extra_ms: 0.0,
            kv_usage: None,
            waiting: None,
            fail: Fail::None,
            fail_count: None,
            cut_after_events: 3,
        }
    }
}

/// Longest refusal: the simulator cannot be told anything while it refuses.
const MAX_REFUSE: Duration = Duration::from_secs(600);

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

    /// Whether `/health` answers 200.
    pub(crate) fn healthy(&self) -> bool {
        let s = self.get();
        s.healthy && s.fail != Fail::Unavailable
    }

    /// The failure one completion request meets, counting it against `count`.
    pub(crate) fn take_failure(&self) -> Failing {
        let mut s = self.switches.lock().unwrap_or_else(PoisonError::into_inner);
        if !s.healthy {
            return Failing::Status(503);
        }
        let failing = match s.fail {
            Fail::None | Fail::Refuse => return Failing::No,
            Fail::Reset => Failing::Reset,
            Fail::Unavailable => Failing::Status(503),
            Fail::Status(code) => Failing::Status(code),
            Fail::Cut => Failing::Cut(s.cut_after_events),
        };
        if let Some(left) = s.fail_count.as_mut() {
            *left = left.saturating_sub(1);
            if *left == 0 {
                s.fail = Fail::None;
                s.fail_count = None;
            }
        }
        failing
    }

    /// `{"mode": "none"|"refuse"|"reset"|"unavailable"|"status"|"cut", "count": N,
    /// "for_ms": N, "status": N, "after_events": N}`. Returns the switches and, for `refuse`,
    /// how long to refuse (the caller closes the listener).
    pub(crate) fn set_fail(&self, body: &Value) -> Result<(Switches, Option<Duration>), String> {
        let mode = body.get("mode").and_then(Value::as_str).ok_or(
            "expected {\"mode\": \"none\"|\"refuse\"|\"reset\"|\"unavailable\"|\"status\"|\"cut\"}",
        )?;
        let uint = |key: &str| -> Result<Option<u64>, String> {
            match body.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(Some)
                    .ok_or(format!("{key} must be a non-negative integer")),
            }
        };
        let count = uint("count")?.filter(|n| *n > 0);
        let mut refuse = None;
        let fail = match mode {
            "none" => Fail::None,
            "reset" => Fail::Reset,
            "unavailable" => Fail::Unavailable,
            "cut" => Fail::Cut,
            "status" => {
                let code = uint("status")?.unwrap_or(503);
                if !(500..=599).contains(&code) {
                    return Err("status must be a 5xx code".into());
                }
                Fail::Status(code as u16)
            }
            "refuse" => {
                let ms = uint("for_ms")?
                    .filter(|ms| (1..=MAX_REFUSE.as_millis() as u64).contains(ms))
                    .ok_or("refuse needs for_ms between 1 and 600000: nothing can reach the simulator while it refuses")?;
                refuse = Some(Duration::from_millis(ms));
                Fail::Refuse
            }
            other => return Err(format!("unknown mode {other:?}")),
        };
        let after = uint("after_events")?;
        let switches = self.update(|s| {
            s.fail = fail;
            s.fail_count = count.filter(|_| fail != Fail::None && fail != Fail::Refuse);
            if let Some(n) = after {
                s.cut_after_events = n.min(u64::from(u32::MAX)) as u32;
            }
            Ok(())
        })?;
        Ok((switches, refuse))
    }

    /// The refusal is over: the simulator listens again.
    pub(crate) fn refused(&self) {
        let _ = self.update(|s| {
            if s.fail == Fail::Refuse {
                s.fail = Fail::None;
            }
            Ok(())
        });
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

    #[test]
    fn failure_modes_apply_count_down_and_validate() {
        let a = Admin::default();
        assert_eq!(a.take_failure(), Failing::No);
        a.set_fail(&json!({"mode": "reset", "count": 2})).unwrap();
        assert_eq!(a.take_failure(), Failing::Reset);
        assert_eq!(a.take_failure(), Failing::Reset);
        assert_eq!(a.take_failure(), Failing::No, "counted down");
        assert_eq!(a.get().fail, Fail::None);
        a.set_fail(&json!({"mode": "unavailable"})).unwrap();
        assert!(!a.healthy());
        assert_eq!(a.take_failure(), Failing::Status(503));
        a.set_fail(&json!({"mode": "status", "status": 502}))
            .unwrap();
        assert!(a.healthy(), "a status failure keeps /health up");
        assert_eq!(a.take_failure(), Failing::Status(502));
        a.set_fail(&json!({"mode": "cut", "after_events": 5}))
            .unwrap();
        assert_eq!(a.take_failure(), Failing::Cut(5));
        let (_, refuse) = a
            .set_fail(&json!({"mode": "refuse", "for_ms": 300}))
            .unwrap();
        assert_eq!(refuse, Some(Duration::from_millis(300)));
        a.refused();
        assert_eq!(a.get().fail, Fail::None);
        for bad in [
            json!({"mode": "refuse"}),
            json!({"mode": "status", "status": 404}),
            json!({"mode": "explode"}),
            json!({"mode": "reset", "count": -1}),
            json!({}),
        ] {
            assert!(a.set_fail(&bad).is_err(), "{bad}");
        }
        a.set_fail(&json!({"mode": "none"})).unwrap();
        a.set_health(&json!({"healthy": false})).unwrap();
        assert_eq!(a.take_failure(), Failing::Status(503));
    }
}
