//! The decision record and its policy inputs, written field by field. They are the only values
//! written once per request (the log line, the ledger's `inputs` column), and through serde
//! each field was a call that wrote its comma, its quoted key and its colon a byte or two at a
//! time: ~14k instructions a record. Here each key is one constant slice with its comma and
//! colon. Written as objects, the bytes are serde_json's (same order, same skipped fields, its
//! number formatter): the tests below compare the two on records that set and clear every
//! optional field. One exception: the objective's fields (`ttft_ms`, `tpot_ms`,
//! `ttft_target_ms`, `tpot_target_ms`, `slo_missed`) are left out of a record when `None`, where
//! serde writes `null` — most answers are not streamed or miss nothing, and the reader's
//! `#[serde(default)]` reads an absent field as `None` all the same. What is stored (the log
//! line, the ledger) has its inputs packed instead, an array of field values that serde reads
//! back as the same struct.

use crate::decision::DecisionRecord;
use crate::escape::write_str;
use crate::inputs::{Code, Decided, Facts, PolicyInputs, PoolRead, RulesFingerprint, TierRead};
use serde_json::ser::{CompactFormatter, Formatter};

/// `,"name":` as one constant.
macro_rules! key {
    ($name:literal) => {
        concat!(",\"", $name, "\":").as_bytes()
    };
}

/// How a struct is written: as an object (its field names as keys), or packed as an array of
/// its field values in declaration order, which serde's derived `Deserialize` reads as the same
/// struct.
#[derive(Clone, Copy, PartialEq)]
enum Form {
    Object,
    Packed,
}

/// A JSON object (or, packed, an array) being written; keys come from [`key!`], with their
/// leading comma dropped for the first one.
struct Obj<'a> {
    out: &'a mut Vec<u8>,
    empty: bool,
    form: Form,
}

impl<'a> Obj<'a> {
    fn open(out: &'a mut Vec<u8>) -> Self {
        Self::open_as(out, Form::Object)
    }

    fn open_as(out: &'a mut Vec<u8>, form: Form) -> Self {
        out.push(if form == Form::Packed { b'[' } else { b'{' });
        Obj {
            out,
            empty: true,
            form,
        }
    }

    fn key(&mut self, k: &'static [u8]) -> &mut Vec<u8> {
        let first = std::mem::replace(&mut self.empty, false);
        match (self.form, first) {
            (Form::Object, true) => self.out.extend_from_slice(&k[1..]),
            (Form::Object, false) => self.out.extend_from_slice(k),
            (Form::Packed, true) => {}
            (Form::Packed, false) => self.out.push(b','),
        }
        self.out
    }

    /// A `skip_serializing_if = "Option::is_none"` field that is `None`: left out of an
    /// object, but a packed array keeps its place.
    fn absent(&mut self, k: &'static [u8]) {
        if self.form == Form::Packed {
            self.key(k).extend_from_slice(b"null");
        }
    }

    fn str(&mut self, k: &'static [u8], v: &str) {
        write_str(self.key(k), v);
    }

    fn opt_str(&mut self, k: &'static [u8], v: Option<&str>) {
        match v {
            Some(v) => self.str(k, v),
            None => self.key(k).extend_from_slice(b"null"),
        }
    }

    fn code<T: Code>(&mut self, k: &'static [u8], v: T) {
        self.str(k, v.code());
    }

    fn bool(&mut self, k: &'static [u8], v: bool) {
        let v: &[u8] = if v { b"true" } else { b"false" };
        self.key(k).extend_from_slice(v);
    }

    fn opt_bool(&mut self, k: &'static [u8], v: Option<bool>) {
        match v {
            Some(v) => self.bool(k, v),
            None => self.key(k).extend_from_slice(b"null"),
        }
    }

    fn u64(&mut self, k: &'static [u8], v: u64) {
        // Writing to a Vec cannot fail.
        let _ = CompactFormatter.write_u64(self.key(k), v);
    }

    fn opt_u64(&mut self, k: &'static [u8], v: Option<u64>) {
        match v {
            Some(v) => self.u64(k, v),
            None => self.key(k).extend_from_slice(b"null"),
        }
    }

    fn opt_i64(&mut self, k: &'static [u8], v: Option<i64>) {
        match v {
            Some(v) => {
                let _ = CompactFormatter.write_i64(self.key(k), v);
            }
            None => self.key(k).extend_from_slice(b"null"),
        }
    }

    fn f64(&mut self, k: &'static [u8], v: f64) {
        f64_value(self.key(k), v);
    }

    fn opt_f64(&mut self, k: &'static [u8], v: Option<f64>) {
        match v {
            Some(v) => self.f64(k, v),
            None => self.key(k).extend_from_slice(b"null"),
        }
    }

    /// A `skip_serializing_if = "Option::is_none"` field.
    fn some_f64(&mut self, k: &'static [u8], v: Option<f64>) {
        match v {
            Some(v) => self.f64(k, v),
            None => self.absent(k),
        }
    }

    /// A field left out when `None` (see [`Obj::some_f64`]).
    fn some_u64(&mut self, k: &'static [u8], v: Option<u64>) {
        match v {
            Some(v) => self.u64(k, v),
            None => self.absent(k),
        }
    }

    /// A field left out when `None` (see [`Obj::some_f64`]).
    fn some_str(&mut self, k: &'static [u8], v: Option<&str>) {
        match v {
            Some(v) => self.str(k, v),
            None => self.absent(k),
        }
    }

    fn close(self) {
        self.out.push(if self.form == Form::Packed {
            b']'
        } else {
            b'}'
        });
    }
}

/// serde_json writes a NaN or an infinity as `null`.
fn f64_value(out: &mut Vec<u8>, v: f64) {
    // Most values in a line are whole (pressure 10.0, queue depth 0.0, in-flight work): the
    // shortest-digits float writer is ~4× the cost of an integer's digits and ".0", which is
    // what it writes for them below 1e15. -0.0 keeps its sign through the float writer.
    if v.fract() == 0.0 && v.abs() < 1e15 && !(v == 0.0 && v.is_sign_negative()) {
        let _ = CompactFormatter.write_i64(out, v as i64);
        out.extend_from_slice(b".0");
    } else if v.is_finite() {
        let _ = CompactFormatter.write_f64(out, v);
    } else {
        out.extend_from_slice(b"null");
    }
}

/// Appends `r` with its inputs packed ([`write_inputs_packed`]), or `null` for them when
/// `with_inputs` is false (they are stored elsewhere): the request log's line, which
/// `sluice replay` and every reader of records read as the same record. The inputs are for
/// replay, and their field names were a quarter of a line's bytes (1,424 → 1,070 for a plain
/// pass), which the log writer and the log's reader pay for on every request.
pub fn write_record_packed(out: &mut Vec<u8>, r: &DecisionRecord, with_inputs: bool) {
    record(out, r, with_inputs.then_some(Form::Packed));
}

/// `inputs_form` `None` writes the inputs as `null`.
fn record(out: &mut Vec<u8>, r: &DecisionRecord, inputs_form: Option<Form>) {
    let mut o = Obj::open(out);
    o.str(key!("request_id"), &r.request_id);
    o.u64(key!("received_at_ms"), r.received_at_ms);
    o.str(key!("replica"), &r.replica);
    o.str(key!("tenant"), &r.tenant);
    o.str(key!("tier"), &r.tier);
    o.str(key!("method"), &r.method);
    o.str(key!("path"), &r.path);
    o.str(key!("decision"), r.decision.as_str());
    o.str(key!("reason"), &r.reason);
    o.str(key!("state"), &r.state);
    o.opt_str(key!("pool"), r.pool.as_deref());
    o.opt_str(key!("route_reason"), r.route_reason.as_deref());
    o.opt_str(key!("backend"), r.backend.as_deref());
    o.opt_str(key!("requested_model"), r.requested_model.as_deref());
    o.opt_str(key!("routed_model"), r.routed_model.as_deref());
    o.opt_i64(key!("requested_max_tokens"), r.requested_max_tokens);
    o.opt_i64(key!("applied_max_tokens"), r.applied_max_tokens);
    o.bool(key!("stream"), r.stream);
    o.opt_f64(key!("queue_wait_ms"), r.queue_wait_ms);
    o.u64(key!("status"), u64::from(r.status));
    o.f64(key!("latency_ms"), r.latency_ms);
    o.opt_f64(key!("ttfb_ms"), r.ttfb_ms);
    o.opt_f64(key!("overhead_us"), r.overhead_us);
    o.opt_u64(key!("prompt_tokens"), r.prompt_tokens);
    o.opt_u64(key!("completion_tokens"), r.completion_tokens);
    o.opt_u64(key!("sla_target_ms"), r.sla_target_ms);
    o.opt_bool(key!("sla_violated"), r.sla_violated);
    // The objective's dimensions: left out when `None` (a whole answer has no TTFT or TPOT, an
    // end-to-end objective no targets for them, and most answers miss nothing).
    o.some_f64(key!("ttft_ms"), r.ttft_ms);
    o.some_f64(key!("tpot_ms"), r.tpot_ms);
    o.some_u64(key!("ttft_target_ms"), r.ttft_target_ms);
    o.some_u64(key!("tpot_target_ms"), r.tpot_target_ms);
    o.some_str(key!("slo_missed"), r.slo_missed.as_deref());
    o.some_u64(key!("attempts"), r.attempts);
    o.some_str(key!("tried"), r.tried.as_deref());
    o.some_str(key!("trace_id"), r.trace_id.as_deref());
    let mut s = Obj::open(o.key(key!("signals")));
    s.opt_f64(key!("pressure"), r.signals.pressure);
    s.opt_f64(key!("queue_depth"), r.signals.queue_depth);
    s.opt_f64(key!("sla_violation_rate"), r.signals.sla_violation_rate);
    s.close();
    o.opt_str(key!("queue_outcome"), r.queue_outcome.map(|q| q.as_str()));
    o.opt_str(key!("error"), r.error.map(|e| e.as_str()));
    match (&r.inputs, inputs_form) {
        (Some(i), Some(form)) => inputs(o.key(key!("inputs")), i, form),
        _ => o.key(key!("inputs")).extend_from_slice(b"null"),
    }
    o.close();
}

/// Appends `i` packed: every struct as an array of its field values in declaration order (an
/// absent optional one as `null`), which `serde_json::from_slice::<PolicyInputs>` reads back as
/// the same value. The log line's form (and the ledger's before migration 4, which stores
/// [`crate::binary`] instead): the field names were ~0.35 KB of the ~0.6 KB object, on
/// every line. Positional, so any change to the fields, even an added optional one, needs a
/// new [`crate::inputs::VERSION`].
pub fn write_inputs_packed(out: &mut Vec<u8>, i: &PolicyInputs) {
    inputs(out, i, Form::Packed);
}

fn inputs(out: &mut Vec<u8>, i: &PolicyInputs, form: Form) {
    let mut o = Obj::open_as(out, form);
    o.u64(key!("v"), u64::from(i.v));
    o.code(key!("mode"), i.mode);
    o.u64(key!("sample_ms"), i.sample_ms);
    o.u64(key!("epoch_ms"), i.epoch_ms);
    facts(o.key(key!("facts")), &i.facts, form);
    let shared = SampleShared::of(i, form);
    SAMPLE_BYTES.with_borrow_mut(|(last, bytes)| {
        if last.as_ref() != Some(&shared) {
            bytes.clear();
            sample_shared(bytes, i, form);
            *last = Some(shared);
        }
        o.out.extend_from_slice(bytes);
    });
    decided(o.key(key!("decided")), &i.decided, form);
    o.close();
}

/// The fields between `facts` and `decided`, each with its leading comma and key: what the
/// policy sample and the request's tier decide, so every request of one sample and tier writes
/// the same bytes. Written once per sample and tier on each thread instead of once a request
/// (~2k instructions a record: six floats, four codes, the keys).
fn sample_shared(out: &mut Vec<u8>, i: &PolicyInputs, form: Form) {
    // Never the first field, so each key below keeps its comma.
    let mut o = Obj {
        out,
        empty: false,
        form,
    };
    tier_read(o.key(key!("tier_state")), &i.tier_state, form);
    o.bool(key!("fallback_active"), i.fallback_active);
    let pools = o.key(key!("pools"));
    pools.push(b'[');
    pool_read(pools, &i.pools[0], form);
    pools.push(b',');
    pool_read(pools, &i.pools[1], form);
    pools.push(b']');
    let mut r = Obj::open_as(o.key(key!("rules")), form);
    r.u64(key!("tier"), u64::from(i.rules.tier));
    r.u64(key!("fallback"), u64::from(i.rules.fallback));
    r.u64(key!("controller"), u64::from(i.rules.controller));
    r.close();
}

std::thread_local! {
    /// The last [`sample_shared`] written on this thread, and its bytes.
    static SAMPLE_BYTES: std::cell::RefCell<(Option<SampleShared>, Vec<u8>)> =
        const { std::cell::RefCell::new((None, Vec::new())) };
}

/// What [`sample_shared`] writes, floats compared bit for bit: `-0.0 == 0.0`, but the two are
/// written differently.
#[derive(PartialEq)]
struct SampleShared {
    packed: bool,
    tier_state: TierRead,
    fallback_active: bool,
    /// Each pool's optional floats and level as bits, and its `saturated`.
    pools: [([Option<u64>; 6], [bool; 2]); 2],
    rules: RulesFingerprint,
}

impl SampleShared {
    fn of(i: &PolicyInputs, form: Form) -> Self {
        let bits = |v: Option<f64>| v.map(f64::to_bits);
        let pool = |p: &PoolRead| {
            (
                [
                    bits(p.pressure),
                    bits(p.queue_depth),
                    bits(p.sla_violation_rate),
                    Some(p.level.to_bits()),
                    bits(p.work_limit),
                    bits(p.lend_limit),
                ],
                [p.saturated, p.busy],
            )
        };
        SampleShared {
            packed: form == Form::Packed,
            tier_state: i.tier_state,
            fallback_active: i.fallback_active,
            pools: [pool(&i.pools[0]), pool(&i.pools[1])],
            rules: i.rules,
        }
    }
}

fn facts(out: &mut Vec<u8>, f: &Facts, form: Form) {
    let mut o = Obj::open_as(out, form);
    o.code(key!("tier"), f.tier);
    o.bool(key!("shapeable"), f.shapeable);
    o.bool(key!("fallback_available"), f.fallback_available);
    o.bool(key!("spot_healthy"), f.spot_healthy);
    match f.fallback_pool {
        Some(p) => o.code(key!("fallback_pool"), p),
        None => o.absent(key!("fallback_pool")),
    }
    o.u64(key!("ticket"), f.ticket);
    o.u64(key!("prompt_tokens"), f.prompt_tokens);
    match f.max_tokens {
        Some(m) => o.u64(key!("max_tokens"), m),
        None => o.absent(key!("max_tokens")),
    }
    let work = o.key(key!("inflight_work"));
    work.push(b'[');
    f64_value(work, f.inflight_work[0]);
    work.push(b',');
    f64_value(work, f.inflight_work[1]);
    work.push(b']');
    o.close();
}

fn tier_read(out: &mut Vec<u8>, t: &TierRead, form: Form) {
    let mut o = Obj::open_as(out, form);
    o.code(key!("state"), t.state);
    o.code(key!("driver"), t.driver);
    o.bool(key!("fail_open"), t.fail_open);
    o.bool(key!("pressure_unavailable"), t.pressure_unavailable);
    o.close();
}

fn pool_read(out: &mut Vec<u8>, p: &PoolRead, form: Form) {
    let mut o = Obj::open_as(out, form);
    o.some_f64(key!("pressure"), p.pressure);
    o.some_f64(key!("queue_depth"), p.queue_depth);
    o.some_f64(key!("sla_violation_rate"), p.sla_violation_rate);
    o.f64(key!("level"), p.level);
    o.bool(key!("saturated"), p.saturated);
    o.some_f64(key!("work_limit"), p.work_limit);
    o.bool(key!("busy"), p.busy);
    o.some_f64(key!("lend_limit"), p.lend_limit);
    o.close();
}

fn decided(out: &mut Vec<u8>, d: &Decided, form: Form) {
    let mut o = Obj::open_as(out, form);
    o.code(key!("action"), d.action);
    match d.cap {
        Some(cap) => o.u64(key!("cap"), u64::from(cap)),
        None => o.absent(key!("cap")),
    }
    o.code(key!("reason"), d.reason);
    o.code(key!("pool"), d.pool);
    o.close();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::SignalsUsed;
    use sluice_policy::{Pool, Tier};

    /// The object form, which must be what serde_json writes: the packed form shares its code.
    fn write_record(out: &mut Vec<u8>, r: &DecisionRecord) {
        record(out, r, Some(Form::Object));
    }

    fn write_inputs(out: &mut Vec<u8>, i: &PolicyInputs) {
        inputs(out, i, Form::Object);
    }

    fn ours(r: &DecisionRecord) -> String {
        let mut out = Vec::new();
        write_record(&mut out, r);
        String::from_utf8(out).unwrap()
    }

    fn full() -> DecisionRecord {
        DecisionRecord {
            request_id: "r-1".into(),
            received_at_ms: 1_796_176_578_487,
            replica: "sluice-a".into(),
            tenant: "ten\"ant\u{1}\\".into(),
            tier: "Standard".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            decision: crate::Verdict::Degrade,
            reason: "degraded_slo_pressure".into(),
            state: "Elevated".into(),
            pool: Some("spot".into()),
            route_reason: Some("route_tier_pool".into()),
            backend: Some("10.0.0.1:8000".into()),
            requested_model: Some("llama-3-70b".into()),
            routed_model: Some("llama-3-8b".into()),
            requested_max_tokens: Some(i64::MIN),
            applied_max_tokens: Some(256),
            stream: true,
            queue_wait_ms: Some(3.0),
            status: 200,
            latency_ms: 0.1 + 0.2,
            ttfb_ms: Some(f64::NAN),
            overhead_us: Some(f64::INFINITY),
            prompt_tokens: Some(u64::MAX),
            completion_tokens: Some(0),
            sla_target_ms: Some(2000),
            sla_violated: Some(true),
            ttft_ms: Some(412.337),
            tpot_ms: Some(38.25),
            ttft_target_ms: Some(500),
            tpot_target_ms: Some(u64::MAX),
            slo_missed: Some("tpot,e2e".into()),
            attempts: Some(2),
            tried: Some("10.0.0.1:8000".into()),
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
            signals: SignalsUsed {
                pressure: Some(1e300),
                queue_depth: Some(-0.0),
                sla_violation_rate: Some(1.5e-7),
            },
            queue_outcome: Some(crate::QueueOutcome::Released),
            error: Some(crate::Failure::UpstreamError),
            inputs: Some(crate::inputs::tests::sample().0),
        }
    }

    #[test]
    fn floats_are_written_as_serde_json_writes_them() {
        let values = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            10.0,
            252.0,
            0.5,
            -2.25,
            1e14,
            -1e14,
            999_999_999_999_999.0,
            1e15,
            1e16,
            1e17,
            123_456_789.0,
            4_503_599_627_370_496.5,
            1e-7,
            f64::MAX,
            f64::MIN,
            f64::MIN_POSITIVE,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        for v in values {
            let mut ours = Vec::new();
            f64_value(&mut ours, v);
            let theirs = serde_json::to_vec(&v).unwrap();
            assert_eq!(
                String::from_utf8(ours).unwrap(),
                String::from_utf8(theirs).unwrap(),
                "{v:?}"
            );
        }
    }

    #[test]
    fn a_record_with_every_field_set_is_what_serde_json_writes() {
        let r = full();
        assert_eq!(ours(&r), serde_json::to_string(&r).unwrap());
        let mut inputs = Vec::new();
        write_inputs(&mut inputs, r.inputs.as_ref().unwrap());
        assert_eq!(
            inputs,
            serde_json::to_vec(r.inputs.as_ref().unwrap()).unwrap()
        );
    }

    /// The objective's fields, which the line leaves out when `None`.
    const SLO_FIELDS: [&str; 8] = [
        "ttft_ms",
        "tpot_ms",
        "ttft_target_ms",
        "tpot_target_ms",
        "slo_missed",
        "attempts",
        "tried",
        "trace_id",
    ];

    /// What serde_json writes, without the objective's fields that are `null`.
    fn serde_without_absent_slo(r: &DecisionRecord) -> String {
        let mut s = serde_json::to_string(r).unwrap();
        for f in SLO_FIELDS {
            s = s.replace(&format!(",\"{f}\":null"), "");
        }
        s
    }

    #[test]
    fn a_record_with_every_optional_field_cleared_is_what_serde_json_writes() {
        let r = DecisionRecord::default();
        let line = ours(&r);
        assert_eq!(line, serde_without_absent_slo(&r));
        for f in SLO_FIELDS {
            assert!(!line.contains(&format!("\"{f}\"")), "{f} in {line}");
        }
        let back: DecisionRecord = serde_json::from_str(&line).unwrap();
        assert_eq!(back, r);
    }

    /// Each of the objective's fields is written when set and left out alone when not.
    #[test]
    fn the_objectives_fields_are_each_written_only_when_set() {
        let set = full();
        let line = ours(&set);
        for (f, v) in SLO_FIELDS.iter().zip([
            "412.337",
            "38.25",
            "500",
            "18446744073709551615",
            "\"tpot,e2e\"",
            "2",
            "\"10.0.0.1:8000\"",
            "\"4bf92f3577b34da6a3ce929d0e0e4736\"",
        ]) {
            assert!(line.contains(&format!(",\"{f}\":{v},")), "{f} in {line}");
        }
        let clears: [fn(&mut DecisionRecord); 8] = [
            |r| r.ttft_ms = None,
            |r| r.tpot_ms = None,
            |r| r.ttft_target_ms = None,
            |r| r.tpot_target_ms = None,
            |r| r.slo_missed = None,
            |r| r.attempts = None,
            |r| r.tried = None,
            |r| r.trace_id = None,
        ];
        for (f, clear) in SLO_FIELDS.iter().zip(clears) {
            let mut r = set.clone();
            clear(&mut r);
            let line = ours(&r);
            assert!(!line.contains(&format!("\"{f}\"")), "{f} in {line}");
            assert_eq!(line, serde_without_absent_slo(&r), "{f} cleared");
        }
        // A non-finite measurement is written as serde_json writes it, `null`.
        let mut r = set.clone();
        r.ttft_ms = Some(f64::NAN);
        assert_eq!(ours(&r), serde_json::to_string(&r).unwrap());
    }

    /// Sample inputs with every optional field set (and `work` in flight), or every one cleared.
    fn inputs_with_optionals(set: bool, work: [f64; 2]) -> PolicyInputs {
        let mut i = crate::inputs::tests::sample().0;
        i.facts.fallback_pool = set.then_some(Pool::Fallback);
        i.facts.max_tokens = set.then_some(4096);
        i.facts.inflight_work = if set { work } else { [0.0, 0.0] };
        i.decided.cap = set.then_some(512);
        for p in &mut i.pools {
            p.pressure = set.then_some(97.5);
            p.queue_depth = set.then_some(12.0);
            p.sla_violation_rate = set.then_some(0.02);
            p.work_limit = set.then_some(3.5e4);
            p.saturated = set;
        }
        i
    }

    #[test]
    fn inputs_with_their_skipped_fields_set_and_cleared_are_what_serde_json_writes() {
        for set in [true, false] {
            let i = inputs_with_optionals(set, [1.25, f64::NAN]);
            let mut out = Vec::new();
            write_inputs(&mut out, &i);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(&i).unwrap(),
                "fields set: {set}"
            );
        }
    }

    /// The sample's part of the inputs is kept per thread between records: a record whose
    /// sample differs in any one field, a float's sign or an option's presence included, must
    /// still be written as itself, in both forms, interleaved.
    #[test]
    fn consecutive_inputs_of_differing_samples_are_each_written_as_themselves() {
        let base = inputs_with_optionals(true, [1.0, 2.0]);
        let mut variants = vec![base];
        let mut add = |f: &dyn Fn(&mut PolicyInputs)| {
            let mut i = base;
            f(&mut i);
            variants.push(i);
        };
        add(&|i| i.pools[1].level = 1.0);
        add(&|i| i.pools[0].pressure = Some(-0.0));
        add(&|i| i.pools[0].pressure = Some(0.0));
        add(&|i| i.pools[0].work_limit = None);
        add(&|i| i.pools[1].queue_depth = None);
        add(&|i| i.pools[1].saturated = false);
        add(&|i| i.pools[0].sla_violation_rate = Some(0.5));
        add(&|i| i.fallback_active = !i.fallback_active);
        add(&|i| i.tier_state.fail_open = !i.tier_state.fail_open);
        add(&|i| i.rules.controller ^= 1);
        add(&|i| i.facts.tier = Tier::BestEffort);
        for round in 0..2 {
            for (n, i) in variants.iter().chain(variants.iter().rev()).enumerate() {
                let mut out = Vec::new();
                write_inputs(&mut out, i);
                assert_eq!(
                    String::from_utf8(out).unwrap(),
                    serde_json::to_string(i).unwrap(),
                    "round {round}, variant {n}"
                );
                let mut packed = Vec::new();
                write_inputs_packed(&mut packed, i);
                let back: PolicyInputs = serde_json::from_slice(&packed).unwrap();
                assert_eq!(
                    format!("{back:?}"),
                    format!("{i:?}"),
                    "round {round}, variant {n}"
                );
            }
        }
    }

    #[test]
    fn packed_inputs_read_back_as_the_same_inputs_in_under_three_fifths_of_the_bytes() {
        for set in [true, false] {
            // Finite: a packed NaN reads back as `null`, which no `f64` field takes; captured
            // inputs are finite.
            let i = inputs_with_optionals(set, [1.25, 3.0]);
            let mut packed = Vec::new();
            write_inputs_packed(&mut packed, &i);
            assert_eq!(packed[0], b'[', "{}", String::from_utf8_lossy(&packed));
            let back: PolicyInputs = serde_json::from_slice(&packed).unwrap();
            assert_eq!(back, i, "fields set: {set}");
            let object = serde_json::to_vec(&i).unwrap();
            assert!(
                packed.len() * 5 < object.len() * 3,
                "packed {} bytes, object {}: {}",
                packed.len(),
                object.len(),
                String::from_utf8_lossy(&packed)
            );
        }
    }

    #[test]
    fn a_record_with_packed_inputs_reads_back_as_the_same_record() {
        let mut r = full();
        r.ttfb_ms = Some(12.5);
        r.overhead_us = None;
        let mut line = Vec::new();
        write_record_packed(&mut line, &r, true);
        let back: DecisionRecord = serde_json::from_slice(&line).unwrap();
        assert!(back.inputs.is_some(), "{}", String::from_utf8_lossy(&line));
        assert_eq!(ours(&back), ours(&r));
        assert_eq!(
            (
                back.ttft_ms,
                back.tpot_ms,
                back.ttft_target_ms,
                back.tpot_target_ms
            ),
            (r.ttft_ms, r.tpot_ms, r.ttft_target_ms, r.tpot_target_ms)
        );
        assert_eq!(back.slo_missed, r.slo_missed);
        assert!(line.len() < ours(&r).len());
        // Without them (a ledger holds them): the same record, inputs null.
        let mut bare = Vec::new();
        write_record_packed(&mut bare, &r, false);
        let back: DecisionRecord = serde_json::from_slice(&bare).unwrap();
        r.inputs = None;
        assert_eq!(ours(&back), ours(&r));
    }
}
