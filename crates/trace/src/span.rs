//! Spans as plain data, and the builder the request path fills in.
//!
//! A [`SpanBuilder`] always has its [`SpanContext`] (what is propagated downstream), and holds
//! the recorded [`Span`] only when its trace is sampled: an unsampled request allocates nothing
//! and every setter is a no-op. Attribute keys are `&'static str` (the names in
//! [`crate::semconv`]); a value is encoded as it is set ([`Attributes`]), from a borrow of what
//! the proxy already holds. [`SpanBuilder::set_with`] builds a value only when the span records.

pub use crate::attributes::{AttrValue, Attributes, MAX_ATTRIBUTES};
use crate::context::{SpanContext, SpanId, TraceState, Traceparent};
pub use crate::value::{Key, Str, Value};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// At most this many events a span.
pub const MAX_EVENTS: usize = 128;

/// What a span stands for, as OTLP numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    /// The request Sluice received.
    Server = 2,
    /// One attempt at sending it to a backend.
    Client = 3,
    Producer = 4,
    Consumer = 5,
}

/// A span's outcome: left unset on success (as instrumentations should), or an error with a
/// short description.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Status {
    #[default]
    Unset,
    Error(Str),
}

/// Something that happened at a point in a span.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub name: Str,
    pub time_unix_nanos: u64,
    pub attributes: Attributes,
}

/// A finished (or in-progress) span: what is exported.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub context: SpanContext,
    /// The parent's span id (absent for a root) and whether the parent was remote.
    pub parent_span_id: Option<SpanId>,
    pub parent_is_remote: bool,
    pub trace_state: Option<TraceState>,
    pub name: Str,
    pub kind: SpanKind,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    pub status: Status,
    pub attributes: Attributes,
    pub events: Vec<Event>,
    pub dropped_events: u32,
}

impl Span {
    /// The value set under `key`, if any, decoded.
    pub fn attribute(&self, key: &str) -> Option<Value> {
        self.attributes.get(key)
    }
}

/// Where a span's attributes go in its OTLP message, and an event's in its.
const SPAN_ATTRIBUTES: u8 = 9;
const EVENT_ATTRIBUTES: u8 = 3;

/// A span being built on the request path: its context always, its record only when sampled.
/// Finish it with [`crate::Tracer::end`]; a builder dropped without it is not exported.
#[derive(Debug)]
pub struct SpanBuilder {
    context: SpanContext,
    state: Option<TraceState>,
    record: Option<Box<Span>>,
}

impl SpanBuilder {
    /// A span that records nothing and propagates `context`.
    pub fn non_recording(context: SpanContext, state: Option<TraceState>) -> Self {
        Self {
            context,
            state,
            record: None,
        }
    }

    /// A recording span; `attribute_capacity` attributes' room is reserved up front.
    pub(crate) fn recording(
        context: SpanContext,
        state: Option<TraceState>,
        parent: Option<(SpanId, bool)>,
        name: Str,
        kind: SpanKind,
        start_unix_nanos: u64,
        attribute_capacity: usize,
    ) -> Self {
        let record = Box::new(Span {
            context,
            parent_span_id: parent.map(|p| p.0),
            parent_is_remote: parent.is_some_and(|p| p.1),
            trace_state: state.clone(),
            name,
            kind,
            start_unix_nanos,
            end_unix_nanos: start_unix_nanos,
            status: Status::Unset,
            attributes: Attributes::with_capacity(SPAN_ATTRIBUTES, attribute_capacity),
            events: Vec::new(),
            dropped_events: 0,
        });
        Self {
            context,
            state,
            record: Some(record),
        }
    }

    pub fn context(&self) -> &SpanContext {
        &self.context
    }

    /// The caller's `tracestate`, carried to the backend unchanged.
    pub fn trace_state(&self) -> Option<&TraceState> {
        self.state.as_ref()
    }

    /// The `traceparent` naming this span as the parent of what it calls.
    pub fn traceparent(&self) -> Traceparent {
        self.context.traceparent()
    }

    /// Whether the trace is sampled: only then do the setters keep anything.
    pub fn is_recording(&self) -> bool {
        self.record.is_some()
    }

    /// The record so far (`None` when not recording).
    pub fn span(&self) -> Option<&Span> {
        self.record.as_deref()
    }

    pub fn set_name(&mut self, name: impl Into<Str>) {
        if let Some(r) = &mut self.record {
            r.name = name.into();
        }
    }

    pub fn set_start(&mut self, start_unix_nanos: u64) {
        if let Some(r) = &mut self.record {
            r.start_unix_nanos = start_unix_nanos;
        }
    }

    /// Sets an attribute (an earlier value under the same key is replaced).
    pub fn set(&mut self, key: Key, value: impl AttrValue) {
        if let Some(r) = &mut self.record {
            r.attributes.set(key, &value);
        }
    }

    /// Sets an attribute whose value costs something to build (a `format!`, a copy): `value`
    /// runs only when the span records.
    pub fn set_with<V: AttrValue>(&mut self, key: Key, value: impl FnOnce() -> V) {
        if let Some(r) = &mut self.record {
            r.attributes.set(key, &value());
        }
    }

    /// Attributes set so far (0 when not recording).
    pub fn attribute_count(&self) -> usize {
        self.record.as_ref().map_or(0, |r| r.attributes.len())
    }

    /// Sets the attributes `from` has set since it had `first` (copied as encoded, not built
    /// again: a SERVER span repeats its last attempt's answer).
    pub fn copy_attributes(&mut self, from: &SpanBuilder, first: usize) {
        if let (Some(r), Some(f)) = (&mut self.record, &from.record) {
            r.attributes.extend_from(&f.attributes, first);
        }
    }

    /// Records an event; `attributes` fills its attribute list and runs only when recording.
    pub fn add_event(
        &mut self,
        name: impl Into<Str>,
        time_unix_nanos: u64,
        attributes: impl FnOnce(&mut EventAttributes),
    ) {
        let Some(r) = &mut self.record else { return };
        if r.events.len() >= MAX_EVENTS {
            r.dropped_events = r.dropped_events.saturating_add(1);
            return;
        }
        let mut attrs = EventAttributes(Attributes::with_capacity(EVENT_ATTRIBUTES, 0));
        attributes(&mut attrs);
        r.events.push(Event {
            name: name.into(),
            time_unix_nanos,
            attributes: attrs.0,
        });
    }

    /// Marks the span failed: status ERROR with `message`, and `error.type` (a low-cardinality
    /// class such as `timeout` or `500`) as the semantic conventions ask.
    pub fn set_error(&mut self, error_type: impl Into<Str>, message: impl Into<Str>) {
        if let Some(r) = &mut self.record {
            r.status = Status::Error(message.into());
            r.attributes
                .set(crate::semconv::ERROR_TYPE, &error_type.into());
        }
    }

    /// The finished record, `None` when not recording.
    pub(crate) fn finish(self, end_unix_nanos: u64) -> Option<Box<Span>> {
        let mut r = self.record?;
        r.end_unix_nanos = end_unix_nanos.max(r.start_unix_nanos);
        Some(r)
    }
}

/// An event's attribute list, filled in [`SpanBuilder::add_event`].
#[derive(Debug)]
pub struct EventAttributes(Attributes);

impl EventAttributes {
    pub fn set(&mut self, key: Key, value: impl AttrValue) -> &mut Self {
        self.0.set(key, &value);
        self
    }
}

/// Now, in Unix nanoseconds.
pub fn now_unix_nanos() -> u64 {
    unix_nanos(SystemTime::now())
}

pub fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The Unix time of a monotonic `Instant` (the proxy's `started`, `first_byte`, `last_byte`),
/// against one wall-clock reading taken once per process: spans' times then keep the order and
/// distances of the monotonic clock.
pub fn instant_unix_nanos(at: Instant) -> u64 {
    static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();
    let (anchor, anchor_ns) = *ANCHOR.get_or_init(|| (Instant::now(), now_unix_nanos()));
    match at.checked_duration_since(anchor) {
        Some(after) => anchor_ns.saturating_add(nanos(after)),
        None => anchor_ns.saturating_sub(nanos(anchor.duration_since(at))),
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{TraceFlags, TraceId};

    fn recording() -> SpanBuilder {
        let ctx = SpanContext {
            trace_id: TraceId([1; 16]),
            span_id: SpanId([2; 8]),
            flags: TraceFlags(1),
            is_remote: false,
        };
        SpanBuilder::recording(ctx, None, None, "s".into(), SpanKind::Server, 10, 4)
    }

    #[test]
    fn setters_replace_by_key_and_respect_the_limit() {
        let mut b = recording();
        b.set("a", 1i64);
        b.set("a", "two");
        assert_eq!(b.span().unwrap().attribute("a"), Some(Value::from("two")));
        let keys: Vec<&'static str> = (0..MAX_ATTRIBUTES + 3)
            .map(|i| &*Box::leak(format!("k{i}").into_boxed_str()))
            .collect();
        for k in keys {
            b.set(k, true);
        }
        let s = b.finish(5).unwrap();
        assert_eq!(s.attributes.len(), MAX_ATTRIBUTES);
        assert_eq!(s.attributes.dropped(), 4);
        assert_eq!(s.end_unix_nanos, 10, "an end before the start is clamped");
    }

    #[test]
    fn a_non_recording_span_keeps_nothing_and_builds_nothing() {
        let mut b = SpanBuilder::non_recording(*recording().context(), None);
        b.set("a", 1i64);
        b.set_with("b", || -> Value {
            panic!("built for a span that does not record")
        });
        b.add_event("e", 1, |_| panic!("built for a span that does not record"));
        b.set_error("timeout", "slow");
        assert!(!b.is_recording());
        assert_eq!(b.finish(2), None);
    }

    #[test]
    fn errors_set_status_and_error_type() {
        let mut b = recording();
        b.set_error("timeout", "upstream read timed out");
        b.add_event("retry", 12, |a| {
            a.set("sluice.attempt", 2u32);
        });
        let s = b.finish(20).unwrap();
        assert_eq!(s.status, Status::Error("upstream read timed out".into()));
        assert_eq!(s.attribute("error.type"), Some(Value::from("timeout")));
        let attrs: Vec<_> = s.events[0].attributes.iter().collect();
        assert_eq!(attrs, vec![("sluice.attempt".to_string(), Value::Int(2))]);
    }

    #[test]
    fn instants_map_to_unix_time_in_order() {
        let now = Instant::now();
        let a = instant_unix_nanos(now);
        let b = instant_unix_nanos(now + Duration::from_millis(5));
        assert_eq!(b - a, 5_000_000);
        assert!(a.abs_diff(now_unix_nanos()) < 1_000_000_000);
    }
}
