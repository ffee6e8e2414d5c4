//! The OTLP trace export request (`opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest`)
//! encoded as protobuf by hand: the seven messages Sluice sends, written straight from its span
//! records into one reused buffer, no intermediate structs. The field numbers are those of
//! opentelemetry-proto v1 (`trace.proto`, `common.proto`, `resource.proto`); the tests decode the
//! output with the `opentelemetry-proto` crate's generated types.

use crate::attributes::{field_len, key_value as attr_key_value, varint, Attributes};
use crate::span::{Event, Span, Status};

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// `Span.flags` bits 8 and 9: whether the parent's remoteness is known, and whether it is remote.
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

fn tag(buf: &mut Vec<u8>, field: u32, wire: u8) {
    varint(buf, u64::from(field) << 3 | u64::from(wire));
}

fn bytes_field(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    tag(buf, field, LEN);
    varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// A string field, left out when empty (proto3's default).
fn string_field(buf: &mut Vec<u8>, field: u32, s: &str) {
    if !s.is_empty() {
        bytes_field(buf, field, s.as_bytes());
    }
}

fn uint_field(buf: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        tag(buf, field, VARINT);
        varint(buf, v);
    }
}

fn fixed64_field(buf: &mut Vec<u8>, field: u32, v: u64) {
    tag(buf, field, FIXED64);
    buf.extend_from_slice(&v.to_le_bytes());
}

fn fixed32_field(buf: &mut Vec<u8>, field: u32, v: u32) {
    tag(buf, field, FIXED32);
    buf.extend_from_slice(&v.to_le_bytes());
}

/// A nested message: its body is written after a one-byte length, which is widened in place
/// (the body moved right) when the body turns out to be 128 bytes or more.
fn message(buf: &mut Vec<u8>, field: u32, body: impl FnOnce(&mut Vec<u8>)) {
    tag(buf, field, LEN);
    let at = buf.len();
    buf.push(0);
    body(buf);
    let len = buf.len() - at - 1;
    if len < 0x80 {
        buf[at] = len as u8;
        return;
    }
    let mut prefix = Vec::with_capacity(10);
    varint(&mut prefix, len as u64);
    let end = buf.len();
    buf.resize(end + prefix.len() - 1, 0);
    buf.copy_within(at + 1..end, at + prefix.len());
    buf[at..at + prefix.len()].copy_from_slice(&prefix);
}

/// A span's or event's attributes, encoded when they were set (as the field they go in).
fn attributes(buf: &mut Vec<u8>, attrs: &Attributes) {
    buf.extend_from_slice(attrs.encoded());
}

fn event(buf: &mut Vec<u8>, e: &Event) {
    message(buf, 11, |buf| {
        fixed64_field(buf, 1, e.time_unix_nanos);
        string_field(buf, 2, e.name.as_str());
        attributes(buf, &e.attributes);
    });
}

fn span(buf: &mut Vec<u8>, s: &Span) {
    message(buf, 2, |buf| {
        bytes_field(buf, 1, &s.context.trace_id.0);
        bytes_field(buf, 2, &s.context.span_id.0);
        if let Some(state) = &s.trace_state {
            string_field(buf, 3, state.as_str());
        }
        if let Some(parent) = &s.parent_span_id {
            bytes_field(buf, 4, &parent.0);
        }
        string_field(buf, 5, s.name.as_str());
        uint_field(buf, 6, s.kind as u64);
        fixed64_field(buf, 7, s.start_unix_nanos);
        fixed64_field(buf, 8, s.end_unix_nanos);
        attributes(buf, &s.attributes);
        uint_field(buf, 10, u64::from(s.attributes.dropped()));
        for e in &s.events {
            event(buf, e);
        }
        uint_field(buf, 12, u64::from(s.dropped_events));
        if let Status::Error(msg) = &s.status {
            message(buf, 15, |buf| {
                string_field(buf, 2, msg.as_str());
                uint_field(buf, 3, 2); // STATUS_CODE_ERROR
            });
        }
        let mut flags = u32::from(s.context.flags.0) | FLAG_HAS_IS_REMOTE;
        if s.parent_span_id.is_some() && s.parent_is_remote {
            flags |= FLAG_IS_REMOTE;
        }
        fixed32_field(buf, 16, flags);
    });
}

/// The `Resource` message's body, encoded once per exporter.
pub fn encode_resource(attrs: &[(String, String)]) -> Vec<u8> {
    let mut buf = Vec::new();
    for (k, v) in attrs {
        attr_key_value(&mut buf, 1, k, v);
    }
    buf
}

/// The instrumentation scope every span is reported under.
pub struct Scope<'a> {
    pub name: &'a str,
    pub version: &'a str,
}

/// One export request: one `ResourceSpans` (the pre-encoded `resource`) with one `ScopeSpans`
/// holding `spans`, written into `buf` (cleared first); the request is `buf[returned..]`.
///
/// The spans are written after room for the three enclosing headers, which are filled in once
/// their lengths are known: wrapping a batch of 512 spans after the fact moved it three times.
pub fn encode_request<'a>(
    buf: &mut Vec<u8>,
    resource: &[u8],
    scope: &Scope,
    spans: impl IntoIterator<Item = &'a Span>,
) -> usize {
    // Tags and lengths of the request's field, the resource and the scope's spans: at most
    // 1 + 10 bytes each.
    let room = resource.len() + 3 * 11;
    buf.clear();
    buf.resize(room, 0);
    message(buf, 1, |buf| {
        string_field(buf, 1, scope.name);
        string_field(buf, 2, scope.version);
    });
    for s in spans {
        span(buf, s);
    }
    let scope_spans = buf.len() - room;
    let resource_spans = field_len(resource.len()) + field_len(scope_spans);
    let mut head = Vec::with_capacity(room);
    tag(&mut head, 1, LEN);
    varint(&mut head, resource_spans as u64);
    bytes_field(&mut head, 1, resource);
    tag(&mut head, 2, LEN);
    varint(&mut head, scope_spans as u64);
    let start = room - head.len();
    buf[start..room].copy_from_slice(&head);
    start
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attributes::MAX_ATTRIBUTES;
    use crate::context::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use crate::span::{SpanKind, Str};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Pv;
    use prost::Message;

    fn sample(attrs: usize) -> Span {
        let mut attributes = Attributes::with_capacity(9, 0);
        attributes.set("s", "text");
        attributes.set("shared", &Str::Shared("arc".into()));
        attributes.set("empty", "");
        attributes.set("i", &-42i64);
        attributes.set("zero", &0i64);
        attributes.set("d", &1.5f64);
        attributes.set("b", &false);
        attributes.set("a", &vec!["stop", "length"]);
        // Distinct keys (one key set again replaces its value).
        const PADS: [&str; 5] = ["pad0", "pad1", "pad2", "pad3", "pad4"];
        for key in &PADS[..attrs] {
            attributes.set(key, "x".repeat(300).as_str());
        }
        if attrs == 0 {
            // To the limit and 3 past it.
            for i in 0..MAX_ATTRIBUTES - 8 + 3 {
                attributes.set(Box::leak(format!("k{i}").into_boxed_str()), &1i64);
            }
        }
        let mut event_attributes = Attributes::with_capacity(3, 0);
        event_attributes.set("sluice.queue_wait_ms", &12.5f64);
        Span {
            context: SpanContext {
                trace_id: TraceId([0xa1; 16]),
                span_id: SpanId([0xb2; 8]),
                flags: TraceFlags(0x03),
                is_remote: false,
            },
            parent_span_id: Some(SpanId([0xc3; 8])),
            parent_is_remote: true,
            trace_state: TraceState::parse([b"congo=t61".as_slice()]),
            name: "chat llama-3-70b".into(),
            kind: SpanKind::Server,
            start_unix_nanos: 1_700_000_000_000_000_000,
            end_unix_nanos: 1_700_000_000_500_000_000,
            status: Status::Error("upstream timed out".into()),
            attributes,
            events: vec![Event {
                name: "sluice.admitted".into(),
                time_unix_nanos: 1_700_000_000_100_000_000,
                attributes: event_attributes,
            }],
            dropped_events: 0,
        }
    }

    fn decode(buf: &[u8]) -> ExportTraceServiceRequest {
        ExportTraceServiceRequest::decode(buf).expect("decodes with opentelemetry-proto")
    }

    #[test]
    fn a_span_decodes_field_for_field() {
        let resource = encode_resource(&[("service.name".into(), "sluice".into())]);
        let mut buf = Vec::new();
        let s = sample(0);
        let scope = Scope {
            name: "sluice",
            version: "9.9.9",
        };
        let start = encode_request(&mut buf, &resource, &scope, [&s]);
        let req = decode(&buf[start..]);
        let rs = &req.resource_spans[0];
        let res = rs.resource.as_ref().unwrap();
        assert_eq!(res.attributes[0].key, "service.name");
        let ss = &rs.scope_spans[0];
        assert_eq!(ss.scope.as_ref().unwrap().name, "sluice");
        assert_eq!(ss.scope.as_ref().unwrap().version, "9.9.9");
        let p = &ss.spans[0];
        assert_eq!(p.trace_id, vec![0xa1; 16]);
        assert_eq!(p.span_id, vec![0xb2; 8]);
        assert_eq!(p.parent_span_id, vec![0xc3; 8]);
        assert_eq!(p.trace_state, "congo=t61");
        assert_eq!(p.name, "chat llama-3-70b");
        assert_eq!(p.kind, 2);
        assert_eq!(p.start_time_unix_nano, 1_700_000_000_000_000_000);
        assert_eq!(p.end_time_unix_nano, 1_700_000_000_500_000_000);
        assert_eq!(p.flags, 0x303);
        assert_eq!(p.dropped_attributes_count, 3);
        assert_eq!(p.attributes.len(), MAX_ATTRIBUTES);
        let status = p.status.as_ref().unwrap();
        assert_eq!(
            (status.code, status.message.as_str()),
            (2, "upstream timed out")
        );
        let attr = |k: &str| {
            p.attributes
                .iter()
                .find(|kv| kv.key == k)
                .and_then(|kv| kv.value.clone())
                .and_then(|v| v.value)
        };
        assert_eq!(attr("s"), Some(Pv::StringValue("text".into())));
        assert_eq!(attr("shared"), Some(Pv::StringValue("arc".into())));
        assert_eq!(attr("empty"), Some(Pv::StringValue(String::new())));
        assert_eq!(attr("i"), Some(Pv::IntValue(-42)));
        assert_eq!(attr("zero"), Some(Pv::IntValue(0)));
        assert_eq!(attr("d"), Some(Pv::DoubleValue(1.5)));
        assert_eq!(attr("b"), Some(Pv::BoolValue(false)));
        let Some(Pv::ArrayValue(arr)) = attr("a") else {
            panic!("array")
        };
        let items: Vec<_> = arr.values.into_iter().filter_map(|v| v.value).collect();
        assert_eq!(
            items,
            vec![
                Pv::StringValue("stop".into()),
                Pv::StringValue("length".into())
            ]
        );
        let e = &p.events[0];
        assert_eq!(e.name, "sluice.admitted");
        assert_eq!(e.time_unix_nano, 1_700_000_000_100_000_000);
        assert_eq!(
            e.attributes[0].value.clone().unwrap().value,
            Some(Pv::DoubleValue(12.5))
        );
    }

    #[test]
    fn long_messages_and_many_spans_keep_their_lengths() {
        let resource = encode_resource(&[("service.name".into(), "x".repeat(1000))]);
        let spans: Vec<Span> = (0..300).map(|i| sample(i % 5)).collect();
        let mut buf = Vec::new();
        let scope = Scope {
            name: "sluice",
            version: "1",
        };
        let start = encode_request(&mut buf, &resource, &scope, &spans);
        let req = decode(&buf[start..]);
        let got = &req.resource_spans[0].scope_spans[0].spans;
        assert_eq!(got.len(), 300);
        assert_eq!(got[4].attributes.len(), 8 + 4);
        assert!(buf.len() > 200_000);
    }

    #[test]
    fn a_root_client_span_has_no_parent_and_local_flags() {
        let mut s = sample(0);
        s.parent_span_id = None;
        s.parent_is_remote = false;
        s.kind = SpanKind::Client;
        s.status = Status::Unset;
        s.context.flags = TraceFlags(0x01);
        let mut buf = Vec::new();
        let scope = Scope {
            name: "s",
            version: "",
        };
        let start = encode_request(&mut buf, &[], &scope, [&s]);
        let req = decode(&buf[start..]);
        let p = &req.resource_spans[0].scope_spans[0].spans[0];
        assert!(p.parent_span_id.is_empty());
        assert_eq!((p.kind, p.flags), (3, 0x101));
        assert!(p.status.is_none());
    }
}
