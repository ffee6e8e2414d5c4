//! A span's (or event's) attributes, kept as the OTLP `KeyValue` fields they are exported as:
//! each is encoded when it is set, from what the caller holds (a `&str` is copied once, into the
//! encoding), so the request path builds no value to keep, free or encode again later, and the
//! exporter copies a span's attributes as one slice. Building and then encoding ~35 values a
//! sampled request was most of tracing's cost.

use crate::value::{Key, Str, Value};
use std::fmt;
use std::sync::Arc;

/// At most this many attributes a span or event (OpenTelemetry's default limit); more are counted
/// as dropped.
pub const MAX_ATTRIBUTES: usize = 128;

const LEN: u8 = 2;
const VARINT: u8 = 0;
const FIXED64: u8 = 1;

pub(crate) fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// Bytes a varint takes.
pub(crate) fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// A length-delimited field's size: tag (one byte for fields below 16), length and body.
pub(crate) fn field_len(body: usize) -> usize {
    1 + varint_len(body as u64) + body
}

/// A value an attribute can take: written as an OTLP `AnyValue`'s body.
pub trait AttrValue {
    /// The `AnyValue` body's size.
    fn any_len(&self) -> usize;
    /// Writes the `AnyValue` body (the oneof is written even for a zero value: its presence is
    /// the type).
    fn write_any(&self, buf: &mut Vec<u8>);
}

fn write_str(buf: &mut Vec<u8>, field: u8, s: &[u8]) {
    buf.push(field << 3 | LEN);
    varint(buf, s.len() as u64);
    buf.extend_from_slice(s);
}

impl AttrValue for str {
    fn any_len(&self) -> usize {
        field_len(self.len())
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        write_str(buf, 1, self.as_bytes());
    }
}

macro_rules! via_str {
    ($($t:ty),*) => {$(
        impl AttrValue for $t {
            fn any_len(&self) -> usize {
                AttrValue::any_len(AsRef::<str>::as_ref(self))
            }
            fn write_any(&self, buf: &mut Vec<u8>) {
                AttrValue::write_any(AsRef::<str>::as_ref(self), buf)
            }
        }
    )*};
}
via_str!(String, Arc<str>, Str, std::borrow::Cow<'_, str>);

impl AttrValue for i64 {
    fn any_len(&self) -> usize {
        1 + varint_len(*self as u64)
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        buf.push(3 << 3 | VARINT);
        varint(buf, *self as u64);
    }
}

macro_rules! via_i64 {
    ($($t:ty),*) => {$(
        impl AttrValue for $t {
            fn any_len(&self) -> usize {
                i64::from(*self).any_len()
            }
            fn write_any(&self, buf: &mut Vec<u8>) {
                i64::from(*self).write_any(buf)
            }
        }
    )*};
}
via_i64!(i8, i16, i32, u8, u16, u32);

macro_rules! saturating_i64 {
    ($($t:ty),*) => {$(
        /// Saturates at `i64::MAX` (OTLP integers are signed).
        impl AttrValue for $t {
            fn any_len(&self) -> usize {
                i64::try_from(*self).unwrap_or(i64::MAX).any_len()
            }
            fn write_any(&self, buf: &mut Vec<u8>) {
                i64::try_from(*self).unwrap_or(i64::MAX).write_any(buf)
            }
        }
    )*};
}
saturating_i64!(u64, usize);

impl AttrValue for f64 {
    fn any_len(&self) -> usize {
        9
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        buf.push(4 << 3 | FIXED64);
        buf.extend_from_slice(&self.to_bits().to_le_bytes());
    }
}

impl AttrValue for bool {
    fn any_len(&self) -> usize {
        2
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(&[2 << 3 | VARINT, u8::from(*self)]);
    }
}

/// A list of strings: an `ArrayValue` of string `AnyValue`s.
impl<S: AsRef<str>> AttrValue for [S] {
    fn any_len(&self) -> usize {
        field_len(
            self.iter()
                .map(|s| field_len(field_len(s.as_ref().len())))
                .sum(),
        )
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        let body: usize = self
            .iter()
            .map(|s| field_len(field_len(s.as_ref().len())))
            .sum();
        buf.push(5 << 3 | LEN);
        varint(buf, body as u64);
        for s in self {
            let s = s.as_ref().as_bytes();
            buf.push(1 << 3 | LEN);
            varint(buf, field_len(s.len()) as u64);
            write_str(buf, 1, s);
        }
    }
}

impl<S: AsRef<str>> AttrValue for Vec<S> {
    fn any_len(&self) -> usize {
        self.as_slice().any_len()
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        self.as_slice().write_any(buf)
    }
}

impl AttrValue for Value {
    fn any_len(&self) -> usize {
        match self {
            Value::Str(s) => s.any_len(),
            Value::Int(i) => i.any_len(),
            Value::Double(d) => d.any_len(),
            Value::Bool(b) => b.any_len(),
            Value::StrArray(a) => a.as_slice().any_len(),
        }
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        match self {
            Value::Str(s) => s.write_any(buf),
            Value::Int(i) => i.write_any(buf),
            Value::Double(d) => d.write_any(buf),
            Value::Bool(b) => b.write_any(buf),
            Value::StrArray(a) => a.as_slice().write_any(buf),
        }
    }
}

impl<T: AttrValue + ?Sized> AttrValue for &T {
    fn any_len(&self) -> usize {
        (**self).any_len()
    }
    fn write_any(&self, buf: &mut Vec<u8>) {
        (**self).write_any(buf)
    }
}

/// Writes one `KeyValue` as field `field` of its message.
pub(crate) fn key_value(
    buf: &mut Vec<u8>,
    field: u8,
    key: &str,
    value: &(impl AttrValue + ?Sized),
) {
    let value_len = value.any_len();
    let key_len = if key.is_empty() {
        0
    } else {
        field_len(key.len())
    };
    let body = key_len + field_len(value_len);
    // Nearly every attribute: one-byte tags and lengths, written as whole words.
    if body < 0x80 && !key.is_empty() {
        buf.reserve(2 + body);
        buf.extend_from_slice(&[field << 3 | LEN, body as u8, 1 << 3 | LEN, key.len() as u8]);
        buf.extend_from_slice(key.as_bytes());
        buf.extend_from_slice(&[2 << 3 | LEN, value_len as u8]);
        value.write_any(buf);
        return;
    }
    buf.reserve(1 + varint_len(body as u64) + body);
    buf.push(field << 3 | LEN);
    varint(buf, body as u64);
    if !key.is_empty() {
        write_str(buf, 1, key.as_bytes());
    }
    buf.push(2 << 3 | LEN);
    varint(buf, value_len as u64);
    value.write_any(buf);
}

/// Attributes encoded as they are set: OTLP `KeyValue`s, each as field `field` of the message
/// that holds them (9 in a `Span`, 3 in an `Event`).
#[derive(Clone)]
pub struct Attributes {
    buf: Vec<u8>,
    field: u8,
    dropped: u32,
    /// The keys in the order their entries are encoded.
    keys: KeyList,
    /// A filter of the keys set so far: a key whose bit is clear is new and is appended without
    /// a search.
    seen: u128,
}

/// By their encoding.
impl PartialEq for Attributes {
    fn eq(&self, other: &Self) -> bool {
        self.buf == other.buf && self.field == other.field && self.dropped == other.dropped
    }
}

/// A key's bit in [`Attributes::seen`], from its length and its last two bytes (the
/// conventions' names differ there far more often than in their first bytes).
fn key_bit(key: &str) -> u128 {
    let b = key.as_bytes();
    let last = b.last().copied().unwrap_or(0) as usize;
    let before = b.len().checked_sub(2).map_or(0, |i| b[i] as usize);
    1 << ((key.len() * 7 + last * 3 + before) & 127)
}

impl Attributes {
    /// Attributes for field `field` of their message, with room for `count` of them.
    pub fn with_capacity(field: u8, count: usize) -> Self {
        Attributes {
            // At most about 48 bytes an attribute as Sluice sets them.
            buf: Vec::with_capacity(count * 48),
            field,
            dropped: 0,
            keys: KeyList::default(),
            seen: 0,
        }
    }

    /// Sets `key` (replacing an earlier value, as OpenTelemetry does), within the limit.
    pub fn set(&mut self, key: Key, value: &(impl AttrValue + ?Sized)) {
        let bit = key_bit(key);
        if self.seen & bit != 0 {
            let same = |k: &Key| k.len() == key.len() && (std::ptr::eq(*k, key) || *k == key);
            if let Some(i) = self.keys.as_slice().iter().position(same) {
                let range = self.range_of(i);
                self.buf.drain(range);
                self.keys.remove(i);
            }
        }
        if self.keys.len() >= MAX_ATTRIBUTES {
            self.dropped = self.dropped.saturating_add(1);
            return;
        }
        self.seen |= bit;
        self.keys.push(key);
        key_value(&mut self.buf, self.field, key, value);
    }

    /// Sets the attributes of `other` from its `first` on (as encoded there: both must be for
    /// the same field), replacing any of the same keys here.
    pub fn extend_from(&mut self, other: &Attributes, first: usize) {
        debug_assert_eq!(self.field, other.field);
        let keys = other.keys.as_slice().get(first..).unwrap_or(&[]);
        let start = other.range_of(first).start;
        if keys.iter().any(|k| self.seen & key_bit(k) != 0)
            || self.keys.len() + keys.len() > MAX_ATTRIBUTES
        {
            // Rare: entry by entry, through the replacing and limiting `set`.
            for (key, (_, value)) in keys.iter().zip(other.iter().skip(first)) {
                self.set(key, &value);
            }
            return;
        }
        self.buf.extend_from_slice(&other.buf[start..]);
        for key in keys {
            self.seen |= key_bit(key);
            self.keys.push(key);
        }
    }

    /// The encoded `KeyValue` fields.
    pub fn encoded(&self) -> &[u8] {
        &self.buf
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Attributes over the limit, not kept.
    pub fn dropped(&self) -> u32 {
        self.dropped
    }

    /// The value set under `key`, decoded (for tests and diagnostics).
    pub fn get(&self, key: &str) -> Option<Value> {
        self.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Every attribute, decoded, in the order set.
    pub fn iter(&self) -> impl Iterator<Item = (String, Value)> + '_ {
        Entries(&self.buf).map(|e| decode_entry(e.body))
    }

    /// Where the `i`th entry lies in the encoding.
    fn range_of(&self, i: usize) -> std::ops::Range<usize> {
        let base = self.buf.as_ptr() as usize;
        let end = self.buf.len();
        Entries(&self.buf).nth(i).map_or(end..end, |e| {
            let start = e.whole.as_ptr() as usize - base;
            start..start + e.whole.len()
        })
    }
}

/// Keys a span carries without an allocation of their own: Sluice sets at most ~26.
const INLINE_KEYS: usize = 32;

/// The keys in order: inline up to [`INLINE_KEYS`], then all of them on the heap.
#[derive(Clone)]
struct KeyList {
    inline: [Key; INLINE_KEYS],
    n: usize,
    heap: Vec<Key>,
}

impl Default for KeyList {
    fn default() -> Self {
        KeyList {
            inline: [""; INLINE_KEYS],
            n: 0,
            heap: Vec::new(),
        }
    }
}

impl KeyList {
    fn as_slice(&self) -> &[Key] {
        if self.heap.is_empty() {
            &self.inline[..self.n]
        } else {
            &self.heap
        }
    }

    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn push(&mut self, key: Key) {
        if !self.heap.is_empty() {
            self.heap.push(key);
        } else if self.n < INLINE_KEYS {
            self.inline[self.n] = key;
            self.n += 1;
        } else {
            self.heap = self.inline.to_vec();
            self.heap.push(key);
        }
    }

    fn remove(&mut self, i: usize) {
        if self.heap.is_empty() {
            self.inline.copy_within(i + 1..self.n, i);
            self.n -= 1;
        } else {
            self.heap.remove(i);
        }
    }
}

impl fmt::Debug for Attributes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// One encoded field: all of it, and its body.
struct Entry<'a> {
    whole: &'a [u8],
    body: &'a [u8],
}

/// The length-delimited fields of an encoding this module wrote (tags below 16).
struct Entries<'a>(&'a [u8]);

impl<'a> Iterator for Entries<'a> {
    type Item = Entry<'a>;
    fn next(&mut self) -> Option<Entry<'a>> {
        let (_, rest) = self.0.split_first()?;
        let (len, n) = read_varint(rest)?;
        let end = 1 + n + len as usize;
        let entry = Entry {
            whole: self.0.get(..end)?,
            body: &rest[n..n + len as usize],
        };
        self.0 = &self.0[end..];
        Some(entry)
    }
}

fn read_varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// A `KeyValue` body's key (empty when absent).
fn entry_key(kv: &[u8]) -> &[u8] {
    match Entries(kv).next() {
        Some(e) if kv[0] == (1 << 3 | LEN) => e.body,
        _ => &[],
    }
}

fn decode_entry(kv: &[u8]) -> (String, Value) {
    let key = String::from_utf8_lossy(entry_key(kv)).into_owned();
    let value = Entries(kv)
        .find(|e| e.whole[0] == (2 << 3 | LEN))
        .map_or(Value::Str(Str::Static("")), |e| decode_any(e.body));
    (key, value)
}

fn decode_any(any: &[u8]) -> Value {
    let text = |b: &[u8]| Str::Owned(String::from_utf8_lossy(b).into_owned());
    match any.first().map(|t| t >> 3) {
        Some(1) => Value::Str(
            Entries(any)
                .next()
                .map_or(Str::Static(""), |e| text(e.body)),
        ),
        Some(2) => Value::Bool(any.get(1) == Some(&1)),
        Some(3) => Value::Int(read_varint(&any[1..]).map_or(0, |(v, _)| v as i64)),
        Some(4) => Value::Double(f64::from_bits(u64::from_le_bytes(
            any.get(1..9)
                .and_then(|b| b.try_into().ok())
                .unwrap_or([0; 8]),
        ))),
        Some(5) => {
            let array = Entries(any).next().map_or(&[][..], |e| e.body);
            Value::StrArray(
                Entries(array)
                    .filter_map(|item| Entries(item.body).next().map(|s| text(s.body)))
                    .collect(),
            )
        }
        _ => Value::Str(Str::Static("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_a_key_set_again_is_replaced() {
        let mut a = Attributes::with_capacity(9, 0);
        a.set("s", "text");
        a.set("i", &-42i64);
        a.set("u", &u64::MAX);
        a.set("d", &1.5f64);
        a.set("b", &true);
        a.set("a", &["stop", "length"][..]);
        a.set("long", "x".repeat(300).as_str());
        a.set("s", &7u32);
        assert_eq!(a.len(), 7);
        assert_eq!(a.get("s"), Some(Value::Int(7)));
        assert_eq!(a.get("i"), Some(Value::Int(-42)));
        assert_eq!(a.get("u"), Some(Value::Int(i64::MAX)));
        assert_eq!(a.get("d"), Some(Value::Double(1.5)));
        assert_eq!(a.get("b"), Some(Value::Bool(true)));
        assert_eq!(a.get("a"), Some(Value::from(vec!["stop", "length"])));
        assert_eq!(a.get("long"), Some(Value::from("x".repeat(300))));
        let keys: Vec<String> = a.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["i", "u", "d", "b", "a", "long", "s"]);
        // Past the inline keys, replacing still finds them.
        let many: Vec<&'static str> = (0..INLINE_KEYS + 8)
            .map(|i| &*Box::leak(format!("k{i}").into_boxed_str()))
            .collect();
        for k in &many {
            a.set(k, &1i64);
        }
        a.set(many[3], &2i64);
        a.set(many[INLINE_KEYS + 4], &3i64);
        a.set("i", &4i64);
        assert_eq!(a.len(), 7 + INLINE_KEYS + 8);
        assert_eq!(a.get("k3"), Some(Value::Int(2)));
        assert_eq!(a.get(many[INLINE_KEYS + 4]), Some(Value::Int(3)));
        assert_eq!(a.get("i"), Some(Value::Int(4)));
        assert_eq!(a.iter().count(), a.len());

        // Copied from another span's: appended as encoded, or replacing what is there.
        let mut from = Attributes::with_capacity(9, 0);
        from.set("x", "skipped");
        from.set("y", "why");
        from.set("z", &5i64);
        let mut to = Attributes::with_capacity(9, 0);
        to.set("w", &true);
        to.extend_from(&from, 1);
        let got: Vec<_> = to.iter().collect();
        assert_eq!(got.len(), 3);
        assert_eq!(to.get("y"), Some(Value::from("why")));
        assert_eq!(to.get("x"), None);
        to.extend_from(&from, 2);
        assert_eq!((to.len(), to.get("z")), (3, Some(Value::Int(5))));
    }
}
