//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the ids, the `traceparent` header
//! parsed and formatted, and `tracestate` carried through within the spec's bounds.
//!
//! Parsing is strict where the spec says "MUST ignore": a malformed `traceparent` (wrong length,
//! separators, upper-case or non-hex digits, version `ff`, an all-zero trace or parent id) is
//! refused, and then the caller's `tracestate` is dropped with it. A version above `00` is read
//! the forward-compatible way (its first 55 characters as version 00, then a `-` or the end).
//! Sluice always sends version `00` with only the flags it knows (sampled, random).

use std::fmt;
use std::sync::Arc;

/// A 16-byte trace id; all zeros is invalid.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TraceId(pub [u8; 16]);

/// An 8-byte span id; all zeros is invalid.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub const INVALID: TraceId = TraceId([0; 16]);

    pub fn is_valid(&self) -> bool {
        self.0 != [0; 16]
    }

    /// Lower-case hex, 32 characters.
    pub fn from_hex(hex: &str) -> Option<Self> {
        let mut id = [0; 16];
        decode_hex(hex.as_bytes(), &mut id).then_some(TraceId(id))
    }

    /// The randomness OpenTelemetry's `TraceIdRatioBased` sampler reads: the trace id's least
    /// significant 56 bits (W3C Trace Context Level 2).
    pub fn randomness(&self) -> u64 {
        let mut low = [0u8; 8];
        low[1..].copy_from_slice(&self.0[9..]);
        u64::from_be_bytes(low)
    }
}

impl SpanId {
    pub const INVALID: SpanId = SpanId([0; 8]);

    pub fn is_valid(&self) -> bool {
        self.0 != [0; 8]
    }

    /// Lower-case hex, 16 characters.
    pub fn from_hex(hex: &str) -> Option<Self> {
        let mut id = [0; 8];
        decode_hex(hex.as_bytes(), &mut id).then_some(SpanId(id))
    }
}

impl TraceId {
    /// Lower-case hex, 32 characters, without the formatting machinery (once per request).
    pub fn to_hex(&self) -> String {
        let mut out = [0u8; 32];
        encode_hex(&self.0, &mut out);
        as_str(&out).to_owned()
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; 32];
        encode_hex(&self.0, &mut out);
        f.write_str(as_str(&out))
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({self})")
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; 16];
        encode_hex(&self.0, &mut out);
        f.write_str(as_str(&out))
    }
}

impl fmt::Debug for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SpanId({self})")
    }
}

/// The `trace-flags` byte. Only [`Self::SAMPLED`] and [`Self::RANDOM`] (Level 2: the trace id's
/// low 56 bits are random) are kept; other bits are dropped when propagating.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Debug)]
pub struct TraceFlags(pub u8);

impl TraceFlags {
    pub const SAMPLED: u8 = 0x01;
    pub const RANDOM: u8 = 0x02;
    const KNOWN: u8 = Self::SAMPLED | Self::RANDOM;

    pub fn is_sampled(self) -> bool {
        self.0 & Self::SAMPLED != 0
    }

    pub fn with_sampled(self, sampled: bool) -> Self {
        if sampled {
            TraceFlags(self.0 | Self::SAMPLED)
        } else {
            TraceFlags(self.0 & !Self::SAMPLED)
        }
    }
}

/// Who a span is: trace id, span id and flags; `is_remote` when it came from a caller's header.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct SpanContext {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub flags: TraceFlags,
    pub is_remote: bool,
}

impl SpanContext {
    pub fn is_sampled(&self) -> bool {
        self.flags.is_sampled()
    }

    /// The `traceparent` value naming this span as the parent (version 00, known flags only),
    /// formatted on the stack.
    pub fn traceparent(&self) -> Traceparent {
        let mut out = [0u8; TRACEPARENT_LEN];
        out[..3].copy_from_slice(b"00-");
        encode_hex(&self.trace_id.0, &mut out[3..35]);
        out[35] = b'-';
        encode_hex(&self.span_id.0, &mut out[36..52]);
        out[52] = b'-';
        encode_hex(&[self.flags.0 & TraceFlags::KNOWN], &mut out[53..55]);
        Traceparent(out)
    }
}

/// Length of a version-00 `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;

/// A formatted `traceparent` value, no allocation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Traceparent([u8; TRACEPARENT_LEN]);

impl Traceparent {
    pub fn as_str(&self) -> &str {
        as_str(&self.0)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Display for Traceparent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Traceparent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Traceparent({})", self.as_str())
    }
}

/// Why a `traceparent` was ignored.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum TraceparentError {
    /// Not 55 characters for version 00; shorter than 55, or not followed by `-`, for a later one.
    Length,
    /// Not two lower-case hex digits, or `ff`.
    Version,
    /// A `-` missing where the format puts one.
    Separator,
    /// Not 32 lower-case hex digits, or all zeros.
    TraceId,
    /// Not 16 lower-case hex digits, or all zeros.
    ParentId,
    /// Not two lower-case hex digits.
    Flags,
}

impl fmt::Display for TraceparentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Length => "traceparent has the wrong length",
            Self::Version => "traceparent version is not two lower-case hex digits other than ff",
            Self::Separator => "traceparent fields are not separated by '-'",
            Self::TraceId => "traceparent trace-id is not 32 lower-case hex digits, not all zero",
            Self::ParentId => "traceparent parent-id is not 16 lower-case hex digits, not all zero",
            Self::Flags => "traceparent trace-flags is not two lower-case hex digits",
        })
    }
}

impl std::error::Error for TraceparentError {}

/// Reads a `traceparent` value (surrounding spaces and tabs allowed). The result is remote and
/// keeps only the known flags.
pub fn parse_traceparent(value: &[u8]) -> Result<SpanContext, TraceparentError> {
    let v = trim_ows(value);
    if v.len() < TRACEPARENT_LEN {
        return Err(TraceparentError::Length);
    }
    let mut version = [0u8; 1];
    if !decode_hex(&v[..2], &mut version) || version[0] == 0xff {
        return Err(TraceparentError::Version);
    }
    if version[0] == 0 && v.len() != TRACEPARENT_LEN {
        return Err(TraceparentError::Length);
    }
    if v.len() > TRACEPARENT_LEN && v[TRACEPARENT_LEN] != b'-' {
        return Err(TraceparentError::Length);
    }
    if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return Err(TraceparentError::Separator);
    }
    let mut trace_id = TraceId::INVALID;
    if !decode_hex(&v[3..35], &mut trace_id.0) || !trace_id.is_valid() {
        return Err(TraceparentError::TraceId);
    }
    let mut span_id = SpanId::INVALID;
    if !decode_hex(&v[36..52], &mut span_id.0) || !span_id.is_valid() {
        return Err(TraceparentError::ParentId);
    }
    let mut flags = [0u8; 1];
    if !decode_hex(&v[53..55], &mut flags) {
        return Err(TraceparentError::Flags);
    }
    Ok(SpanContext {
        trace_id,
        span_id,
        flags: TraceFlags(flags[0] & TraceFlags::KNOWN),
        is_remote: true,
    })
}

/// A caller's `tracestate`, checked and bounded, shared cheaply between a request's spans.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct TraceState(Arc<str>);

impl TraceState {
    /// At most this many list members are kept (the spec's limit), the left-most first.
    pub const MAX_MEMBERS: usize = 32;
    /// At most this many characters are propagated (the spec's "at least 512"): longer values
    /// lose members over [`Self::LONG_MEMBER`] characters first, then members from the right.
    pub const MAX_LEN: usize = 512;
    pub const LONG_MEMBER: usize = 128;

    /// Combines the `tracestate` header lines (in order) into one list. `None` when there is
    /// nothing to carry or the list is malformed (a bad key or value, a duplicated key): the spec
    /// says not to propagate a `tracestate` that could not be parsed.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a [u8]>) -> Option<TraceState> {
        let mut members: Vec<&str> = Vec::new();
        for line in lines {
            for raw in line.split(|b| *b == b',') {
                let m = trim_ows(raw);
                if m.is_empty() {
                    continue;
                }
                let m = std::str::from_utf8(m).ok()?;
                let key = valid_member(m)?;
                if members.iter().any(|o| o.split('=').next() == Some(key)) {
                    return None;
                }
                members.push(m);
            }
        }
        members.truncate(Self::MAX_MEMBERS);
        let joined_len = |ms: &[&str]| ms.iter().map(|m| m.len() + 1).sum::<usize>().max(1) - 1;
        if joined_len(&members) > Self::MAX_LEN {
            while joined_len(&members) > Self::MAX_LEN {
                match members.iter().rposition(|m| m.len() > Self::LONG_MEMBER) {
                    Some(i) => members.remove(i),
                    None => break,
                };
            }
            while joined_len(&members) > Self::MAX_LEN {
                members.pop();
            }
        }
        if members.is_empty() {
            return None;
        }
        Some(TraceState(members.join(",").into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `key=value` per the spec's grammar; the key when valid.
fn valid_member(m: &str) -> Option<&str> {
    let (key, value) = m.split_once('=')?;
    let kchar = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit() || b"_-*/".contains(&c);
    let key_ok = match key.split_once('@') {
        None => {
            key.len() <= 256
                && key.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
                && key.bytes().all(kchar)
        }
        Some((tenant, system)) => {
            (1..=241).contains(&tenant.len())
                && tenant
                    .as_bytes()
                    .first()
                    .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                && tenant.bytes().all(kchar)
                && (1..=14).contains(&system.len())
                && system
                    .as_bytes()
                    .first()
                    .is_some_and(u8::is_ascii_lowercase)
                && system.bytes().all(kchar)
        }
    };
    let value_ok = (1..=256).contains(&value.len())
        && value
            .bytes()
            .all(|c| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=')
        && !value.ends_with(' ');
    (key_ok && value_ok).then_some(key)
}

/// What a request brought: its caller's span (the parent) and `tracestate`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Propagated {
    pub parent: SpanContext,
    pub state: Option<TraceState>,
}

/// Reads a request's trace context: `None` when there is no valid `traceparent` (its
/// `tracestate` then goes too). Pass every `tracestate` header line, in order.
pub fn extract<'a>(
    traceparent: Option<&[u8]>,
    tracestate: impl IntoIterator<Item = &'a [u8]>,
) -> Option<Propagated> {
    let parent = parse_traceparent(traceparent?).ok()?;
    Some(Propagated {
        parent,
        state: TraceState::parse(tracestate),
    })
}

fn trim_ows(v: &[u8]) -> &[u8] {
    let start = v.iter().position(|b| *b != b' ' && *b != b'\t');
    let Some(start) = start else { return &[] };
    let end = v
        .iter()
        .rposition(|b| *b != b' ' && *b != b'\t')
        .unwrap_or(start);
    &v[start..=end]
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// Lower-case hex into `out` (exactly twice its length); false on any other input.
fn decode_hex(hex: &[u8], out: &mut [u8]) -> bool {
    if hex.len() != out.len() * 2 {
        return false;
    }
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        match (hex_digit(pair[0]), hex_digit(pair[1])) {
            (Some(h), Some(l)) => *o = h << 4 | l,
            _ => return false,
        }
    }
    true
}

fn encode_hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (b, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// Our own hex output is ASCII.
fn as_str(ascii: &[u8]) -> &str {
    std::str::from_utf8(ascii).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_spec_example_parses_and_formats_back() {
        let c = parse_traceparent(EXAMPLE.as_bytes()).unwrap();
        assert_eq!(c.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.trace_id.to_hex(), c.trace_id.to_string());
        assert_eq!(c.span_id.to_string(), "00f067aa0ba902b7");
        assert!(c.is_sampled() && c.is_remote);
        assert_eq!(c.traceparent().as_str(), EXAMPLE);
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let c = parse_traceparent(unsampled.as_bytes()).unwrap();
        assert!(!c.is_sampled());
        assert_eq!(c.traceparent().as_str(), unsampled);
    }

    #[test]
    fn surrounding_whitespace_is_allowed_and_unknown_flags_are_dropped() {
        let c = parse_traceparent(format!(" \t{}\t ", &EXAMPLE[..53]).as_bytes());
        assert_eq!(c, Err(TraceparentError::Length));
        let c = parse_traceparent(format!(" {EXAMPLE}\t").as_bytes()).unwrap();
        assert_eq!(c.traceparent().as_str(), EXAMPLE);
        let c = parse_traceparent(format!("{}ff", &EXAMPLE[..53]).as_bytes()).unwrap();
        assert_eq!(c.flags, TraceFlags(0x03));
        assert!(c.traceparent().as_str().ends_with("-03"));
    }

    #[test]
    fn malformed_values_are_rejected() {
        use TraceparentError::*;
        let cases: &[(&str, TraceparentError)] = &[
            ("", Length),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
                Length,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
                Length,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-010",
                Length,
            ),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Version,
            ),
            (
                "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Version,
            ),
            (
                "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Version,
            ),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Separator,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
                Separator,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
                Separator,
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                TraceId,
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                TraceId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473z-00f067aa0ba902b7-01",
                TraceId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                ParentId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
                ParentId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
                Flags,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
                Flags,
            ),
        ];
        for (value, want) in cases {
            assert_eq!(parse_traceparent(value.as_bytes()), Err(*want), "{value:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_forward_compatibly() {
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = parse_traceparent(later.as_bytes()).unwrap();
        assert_eq!(c.traceparent().as_str(), EXAMPLE, "sent on as version 00");
        let with_more = format!("{later}-what-the-future-holds");
        assert!(parse_traceparent(with_more.as_bytes()).is_ok());
        let glued = format!("{later}x");
        assert_eq!(
            parse_traceparent(glued.as_bytes()),
            Err(TraceparentError::Length)
        );
    }

    #[test]
    fn ids_round_trip_through_hex() {
        let t = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        assert_eq!(t.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(TraceId::from_hex("4BF92F3577B34DA6A3CE929D0E0E4736").is_none());
        assert!(SpanId::from_hex("00f067aa0ba902b").is_none());
        assert_eq!(t.randomness(), 0x00a3ce929d0e0e4736 & ((1 << 56) - 1));
    }

    #[test]
    fn tracestate_is_carried_joined_and_trimmed() {
        let s = TraceState::parse([b"congo=t61rcWkgMzE, rojo=00f067aa0ba902b7 ".as_slice()]);
        assert_eq!(
            s.unwrap().as_str(),
            "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
        );
        let two = TraceState::parse([b"a=1,,".as_slice(), b" tenant@vendor=x y".as_slice()]);
        assert_eq!(two.unwrap().as_str(), "a=1,tenant@vendor=x y");
        assert_eq!(TraceState::parse([b" , ".as_slice()]), None);
        assert_eq!(TraceState::parse(std::iter::empty()), None);
    }

    #[test]
    fn malformed_tracestate_is_dropped_whole() {
        for bad in [
            "a=1,Upper=2",
            "a=1,b",
            "a=1,b=",
            "a=1,b=x,y",
            "a=1,a=2",
            "1a=x",
            "a=tab\tinside",
            "a=caf\u{e9}",
            "t@=x",
            "t@toolongsystemid=x",
        ] {
            assert_eq!(TraceState::parse([bad.as_bytes()]), None, "{bad:?}");
        }
    }

    #[test]
    fn tracestate_is_bounded_long_members_first_then_from_the_right() {
        let many: Vec<String> = (0..40).map(|i| format!("k{i}=v")).collect();
        let s = TraceState::parse([many.join(",").as_bytes()]).unwrap();
        assert_eq!(s.as_str().split(',').count(), TraceState::MAX_MEMBERS);
        assert!(s.as_str().starts_with("k0=v,") && s.as_str().ends_with(",k31=v"));

        let long = format!("big={}", "x".repeat(200));
        let mut parts = vec!["a=1".to_string(), long.clone()];
        parts.extend((0..20).map(|i| format!("m{i:02}={}", "y".repeat(16))));
        let s = TraceState::parse([parts.join(",").as_bytes()]).unwrap();
        assert!(!s.as_str().contains("big="), "the long member goes first");
        assert!(s.as_str().len() <= TraceState::MAX_LEN);
        assert!(s.as_str().starts_with("a=1,m00="));

        let medium: Vec<String> = (0..30)
            .map(|i| format!("m{i:02}={}", "z".repeat(20)))
            .collect();
        let s = TraceState::parse([medium.join(",").as_bytes()]).unwrap();
        assert!(s.as_str().len() <= TraceState::MAX_LEN);
        assert!(s.as_str().starts_with("m00=") && !s.as_str().contains("m29="));
    }

    #[test]
    fn extract_drops_tracestate_with_a_bad_traceparent() {
        let state = [b"a=1".as_slice()];
        let p = extract(Some(EXAMPLE.as_bytes()), state).unwrap();
        assert_eq!(p.state.unwrap().as_str(), "a=1");
        assert_eq!(extract(Some(b"00-bad"), state), None);
        assert_eq!(extract(None, state), None);
    }
}
