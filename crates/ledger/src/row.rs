//! The ledger's own copy of a [`DecisionRecord`]: owned strings, so it can be written to the
//! spool as a JSON line and read back, and serialised with exactly the record's field names so
//! `/decisions/recent` answers the same shape from PostgreSQL as from the in-memory ring.

pub use sluice_record::decision::QueueEvent;
use sluice_record::decision::{DecisionRecord, Text};
use std::sync::Arc;

/// The ledger's row is the decision record itself (owned, deserialisable); these names keep the
/// ledger's code reading as rows.
pub type LedgerRow = DecisionRecord;
pub type SignalsRow = sluice_record::decision::SignalsUsed;

/// PostgreSQL text cannot hold NUL, and a client can put one in a JSON string (the model name):
/// left in, that row would fail its batch on every retry.
fn text(s: &str) -> String {
    nul_free(s).unwrap_or_else(|| s.to_string())
}

/// `s` with its NULs replaced, when it has any.
fn nul_free(s: &str) -> Option<String> {
    s.contains('\0').then(|| s.replace('\0', "\u{FFFD}"))
}

fn opt_text(s: Option<&str>) -> Option<String> {
    s.map(text)
}

/// [`text`] for a field that is usually one of the program's names (kept borrowed).
fn name(s: &Text) -> Text {
    nul_free(s).map_or_else(|| s.clone(), Text::Owned)
}

/// A copy fit for PostgreSQL and the JSON spool: NUL-free text, a finite latency.
pub fn sanitized(r: &DecisionRecord) -> LedgerRow {
    {
        LedgerRow {
            request_id: text(&r.request_id),
            received_at_ms: r.received_at_ms,
            replica: name(&r.replica),
            tenant: text(&r.tenant),
            tier: name(&r.tier),
            method: name(&r.method),
            path: name(&r.path),
            decision: r.decision,
            reason: name(&r.reason),
            state: name(&r.state),
            pool: r.pool.as_ref().map(name),
            route_reason: r.route_reason.as_ref().map(name),
            backend: r
                .backend
                .as_ref()
                .map(|b| nul_free(b).map_or_else(|| Arc::clone(b), Into::into)),
            requested_model: opt_text(r.requested_model.as_deref()),
            routed_model: opt_text(r.routed_model.as_deref()),
            requested_max_tokens: r.requested_max_tokens,
            applied_max_tokens: r.applied_max_tokens,
            stream: r.stream,
            queue_wait_ms: r.queue_wait_ms,
            status: r.status,
            // JSON has no NaN: a non-finite latency would come back from the spool unreadable.
            latency_ms: if r.latency_ms.is_finite() {
                r.latency_ms
            } else {
                0.0
            },
            ttfb_ms: r.ttfb_ms,
            overhead_us: r.overhead_us,
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.completion_tokens,
            sla_target_ms: r.sla_target_ms,
            sla_violated: r.sla_violated,
            ttft_ms: r.ttft_ms.filter(|v| v.is_finite()),
            tpot_ms: r.tpot_ms.filter(|v| v.is_finite()),
            ttft_target_ms: r.ttft_target_ms,
            tpot_target_ms: r.tpot_target_ms,
            slo_missed: r.slo_missed.as_ref().map(name),
            attempts: r.attempts,
            tried: r.tried.as_ref().map(name),
            trace_id: r.trace_id.as_ref().map(name),
            signals: SignalsRow {
                pressure: r.signals.pressure,
                queue_depth: r.signals.queue_depth,
                sla_violation_rate: r.signals.sla_violation_rate,
            },
            queue_outcome: r.queue_outcome,
            error: r.error,
            inputs: r.inputs,
        }
    }
}

/// Nothing for [`sanitized`] to change.
pub fn is_clean(r: &LedgerRow) -> bool {
    // A branch-free fold the compiler vectorises: these strings are short, where a memchr
    // call per string costs more than the scan.
    let ok = |s: &str| s.bytes().fold(1u8, |all, b| all & u8::from(b != 0)) == 1;
    let opt = |s: &Option<String>| s.as_deref().is_none_or(ok);
    r.latency_ms.is_finite()
        && [
            &*r.request_id,
            &r.replica,
            &r.tenant,
            &r.tier,
            &r.method,
            &r.path,
            &r.reason,
            &r.state,
        ]
        .into_iter()
        .all(ok)
        && [&r.pool, &r.route_reason]
            .into_iter()
            .all(|s| s.as_deref().is_none_or(ok))
        && r.backend.as_deref().is_none_or(ok)
        && [&r.requested_model, &r.routed_model].into_iter().all(opt)
}

/// The record itself when it is already fit (nearly always: no NUL anywhere, a finite latency),
/// else a sanitised copy: the writer copies nothing per row in the common case.
pub fn clean(r: Arc<DecisionRecord>) -> Arc<LedgerRow> {
    if is_clean(&r) {
        r
    } else {
        Arc::new(sanitized(&r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_record::decision::SignalsUsed;

    fn record() -> DecisionRecord {
        DecisionRecord {
            request_id: "r-1".into(),
            received_at_ms: 1_700_000_000_000,
            replica: "sluice-1".into(),
            tenant: "coding-assistant".into(),
            tier: "Standard".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            decision: sluice_record::Verdict::Degrade,
            reason: "degrade_pressure_elevated".into(),
            state: "Elevated".into(),
            pool: Some("on-demand".into()),
            route_reason: Some("route_tier_pool".into()),
            backend: Some("127.0.0.1:8001".into()),
            requested_model: Some("m".into()),
            routed_model: Some("m".into()),
            requested_max_tokens: Some(1000),
            applied_max_tokens: Some(256),
            stream: true,
            queue_wait_ms: Some(12.5),
            status: 200,
            latency_ms: 321.4,
            ttfb_ms: Some(40.0),
            overhead_us: Some(80.0),
            prompt_tokens: Some(9),
            completion_tokens: Some(256),
            sla_target_ms: Some(1000),
            sla_violated: Some(false),
            ttft_ms: None,
            tpot_ms: None,
            ttft_target_ms: None,
            tpot_target_ms: None,
            slo_missed: None,
            attempts: None,
            tried: None,
            trace_id: None,
            signals: SignalsUsed {
                pressure: Some(75.0),
                queue_depth: Some(0.0),
                sla_violation_rate: None,
            },
            queue_outcome: Some(sluice_record::QueueOutcome::Released),
            error: None,
            inputs: Some(inputs()),
        }
    }

    /// Replay inputs as a request path captures them, so the spool's JSON carries them too.
    fn inputs() -> sluice_record::PolicyInputs {
        use sluice_policy::{decide, PolicyState, RequestFacts, Tier};
        let rules = sluice_policy::tenant_policy::PolicyRules::default();
        let state = PolicyState::initial();
        let facts = RequestFacts {
            tier: Tier::Standard,
            shapeable: true,
            fallback_available: false,
            spot_healthy: true,
            fallback_pool: None,
            ticket: 42,
            prompt_tokens: 9,
            max_tokens: Some(1000),
            inflight_work: [10.0, 0.0],
        };
        let d = decide(&state, &rules, &facts);
        let clock = sluice_policy::Clock::new();
        sluice_record::PolicyInputs::capture(&state, &rules, &facts, &d, clock)
    }

    #[test]
    fn round_trips_through_json_and_sanitises_text() {
        let rec = record();
        let row = sanitized(&rec);
        assert_eq!(row, rec, "a clean record is unchanged");
        let b = serde_json::to_string(&row).unwrap();
        let back: LedgerRow = serde_json::from_str(&b).unwrap();
        assert_eq!(back, row);
        let old: LedgerRow = serde_json::from_str(r#"{"request_id":"x"}"#).unwrap();
        assert_eq!(old.request_id, "x");
        let mut nul = record();
        nul.requested_model = Some("a\0b".into());
        assert_eq!(
            sanitized(&nul).requested_model.as_deref(),
            Some("a\u{FFFD}b")
        );
        // The writer copies only what needs it.
        let rec = Arc::new(rec);
        assert!(Arc::ptr_eq(&clean(Arc::clone(&rec)), &rec));
        let nul = Arc::new(nul);
        let fixed = clean(Arc::clone(&nul));
        assert!(!Arc::ptr_eq(&fixed, &nul) && is_clean(&fixed));
        assert_eq!(fixed.requested_model.as_deref(), Some("a\u{FFFD}b"));
        let mut nan = record();
        nan.latency_ms = f64::NAN;
        assert!(!is_clean(&nan));
        assert_eq!(clean(Arc::new(nan)).latency_ms, 0.0);
    }

    #[test]
    fn queue_events_follow_the_outcome() {
        let mut row = sanitized(&record());
        let ev = row.queue_events();
        assert_eq!(
            ev.iter().map(|e| e.event).collect::<Vec<_>>(),
            ["queue_queued", "queue_released"]
        );
        assert_eq!(ev[1].at_ms, row.received_at_ms + 13);
        row.queue_outcome = Some(sluice_record::QueueOutcome::TimedOut);
        row.queue_wait_ms = Some(2000.0);
        assert_eq!(row.queue_events()[1].event, "queue_timed_out");
        row.queue_outcome = Some(sluice_record::QueueOutcome::Dropped);
        row.queue_wait_ms = None;
        let ev = row.queue_events();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].event, "queue_dropped");
        row.queue_outcome = None;
        assert!(row.queue_events().is_empty());
        assert_eq!(row.completed_at_ms(), row.received_at_ms + 321);
    }
}
