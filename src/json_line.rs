//! Compact JSON for what is written once per request (the log line, the ledger's `inputs`
//! column). The output is byte for byte what `serde_json::to_vec` writes; only the cost differs.
//! serde_json sends every key, quote, colon and comma through `io::Write` (a `memcpy` call
//! each) and escapes the static keys of derived structs like any other string: for a decision
//! record that was ~22k instructions of the ~80k Sluice adds to a proxied request. Here a
//! struct's keys are written as they are (a Rust field name needs no escaping), single bytes
//! are pushed, and a string goes through serde_json's escaper only when it holds a byte that
//! needs escaping. Numbers use serde_json's own formatter, so they are the same digits.

use serde::ser::{self, Serialize};
use serde_json::ser::{CompactFormatter, Formatter};
use std::fmt::Display;

#[derive(Debug)]
pub struct Error(String);

impl Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: Display>(msg: T) -> Self {
        Error(msg.to_string())
    }
}

/// Appends `value` as compact JSON to `out`.
pub fn write<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<(), Error> {
    value.serialize(&mut Json { out })
}

/// `value` as compact JSON.
pub fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Error> {
    let mut out = Vec::with_capacity(2048);
    write(&mut out, value)?;
    Ok(out)
}

struct Json<'a> {
    out: &'a mut Vec<u8>,
}

fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// Whether any byte of `s` needs escaping, eight bytes per step: most strings here (ids,
/// names, models) need none, and the byte-per-byte scan was the largest single cost left.
fn any_escape(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // Nonzero where a byte of `w` is zero (exact for the lowest such byte, enough for "any").
    let zero = |w: u64| w.wrapping_sub(ONES) & !w & HIGH;
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_ne_bytes(c.try_into().unwrap_or_default());
        let quote = zero(w ^ u64::from_ne_bytes([b'"'; 8]));
        let backslash = zero(w ^ u64::from_ne_bytes([b'\\'; 8]));
        // A byte below 0x20: its top three bits are clear.
        let control = zero(w & u64::from_ne_bytes([0xe0; 8]));
        if quote | backslash | control != 0 {
            return true;
        }
    }
    chunks.remainder().iter().copied().any(needs_escape)
}

impl Json<'_> {
    fn str(&mut self, s: &str) {
        if any_escape(s.as_bytes()) {
            // Rare (a control character or quote in a tenant name or an error): serde_json's
            // escaper, so the escapes are its own.
            let _ = serde_json::to_writer(&mut *self.out, s);
        } else {
            self.out.reserve(s.len() + 2);
            self.out.push(b'"');
            self.out.extend_from_slice(s.as_bytes());
            self.out.push(b'"');
        }
    }

    /// A key the program itself names (a struct field, a variant): no escaping needed.
    fn name(&mut self, s: &'static str) {
        debug_assert!(!s.bytes().any(needs_escape), "{s:?}");
        self.out.reserve(s.len() + 3);
        self.out.push(b'"');
        self.out.extend_from_slice(s.as_bytes());
        self.out.extend_from_slice(b"\":");
    }

    fn num(&mut self, f: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>) {
        // Writing to a Vec cannot fail.
        let _ = f(self.out);
    }
}

/// A compound (`[…]` or `{…}`) being written: `first` tells whether a comma is due.
pub struct Compound<'a, 'b> {
    json: &'b mut Json<'a>,
    first: bool,
    /// Closing bytes: `]`, `}`, or `]}` / `}}` for a variant wrapped in an object.
    close: &'static [u8],
}

impl Compound<'_, '_> {
    fn comma(&mut self) {
        if self.first {
            self.first = false;
        } else {
            self.json.out.push(b',');
        }
    }

    fn finish(self) {
        self.json.out.extend_from_slice(self.close);
    }
}

/// Integers as serde_json writes them (itoa), one method per width.
macro_rules! integers {
    ($($method:ident($t:ty) => $write:ident),*) => {$(
        fn $method(self, v: $t) -> Result<(), Error> {
            self.num(|o| CompactFormatter.$write(o, v));
            Ok(())
        }
    )*};
}

impl<'a, 'b> ser::Serializer for &'b mut Json<'a> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'a, 'b>;
    type SerializeTuple = Compound<'a, 'b>;
    type SerializeTupleStruct = Compound<'a, 'b>;
    type SerializeTupleVariant = Compound<'a, 'b>;
    type SerializeMap = Compound<'a, 'b>;
    type SerializeStruct = Compound<'a, 'b>;
    type SerializeStructVariant = Compound<'a, 'b>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }
    integers!(
        serialize_i8(i8) => write_i8,
        serialize_i16(i16) => write_i16,
        serialize_i32(i32) => write_i32,
        serialize_i64(i64) => write_i64,
        serialize_i128(i128) => write_i128,
        serialize_u8(u8) => write_u8,
        serialize_u16(u16) => write_u16,
        serialize_u32(u32) => write_u32,
        serialize_u64(u64) => write_u64,
        serialize_u128(u128) => write_u128
    );
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        if v.is_finite() {
            self.num(|o| CompactFormatter.write_f32(o, v));
        } else {
            self.out.extend_from_slice(b"null");
        }
        Ok(())
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        if v.is_finite() {
            self.num(|o| CompactFormatter.write_f64(o, v));
        } else {
            self.out.extend_from_slice(b"null");
        }
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.str(v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.str(v);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        use ser::SerializeSeq;
        let mut seq = self.serialize_seq(Some(v.len()))?;
        for b in v {
            seq.serialize_element(b)?;
        }
        seq.end()
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.str(variant);
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        v.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        v: &T,
    ) -> Result<(), Error> {
        self.out.push(b'{');
        self.name(variant);
        v.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'[');
        Ok(Compound {
            json: self,
            first: true,
            close: b"]",
        })
    }
    fn serialize_tuple(self, len: usize) -> Result<Compound<'a, 'b>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        len: usize,
    ) -> Result<Compound<'a, 'b>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'{');
        self.name(variant);
        self.out.push(b'[');
        Ok(Compound {
            json: self,
            first: true,
            close: b"]}",
        })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'{');
        Ok(Compound {
            json: self,
            first: true,
            close: b"}",
        })
    }
    fn serialize_struct(self, _: &'static str, len: usize) -> Result<Compound<'a, 'b>, Error> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a, 'b>, Error> {
        self.out.push(b'{');
        self.name(variant);
        self.out.push(b'{');
        Ok(Compound {
            json: self,
            first: true,
            close: b"}}",
        })
    }
}

macro_rules! seq_like {
    ($($trait:ident :: $method:ident),*) => {$(
        impl ser::$trait for Compound<'_, '_> {
            type Ok = ();
            type Error = Error;
            fn $method<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
                self.comma();
                v.serialize(&mut *self.json)
            }
            fn end(self) -> Result<(), Error> {
                self.finish();
                Ok(())
            }
        }
    )*};
}
seq_like!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

macro_rules! struct_like {
    ($($trait:ident),*) => {$(
        impl ser::$trait for Compound<'_, '_> {
            type Ok = ();
            type Error = Error;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                v: &T,
            ) -> Result<(), Error> {
                self.comma();
                self.json.name(key);
                v.serialize(&mut *self.json)
            }
            fn end(self) -> Result<(), Error> {
                self.finish();
                Ok(())
            }
        }
    )*};
}
struct_like!(SerializeStruct, SerializeStructVariant);

impl ser::SerializeMap for Compound<'_, '_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        self.comma();
        // serde_json's rules for keys (strings; numbers, bools and chars quoted), by asking it
        // for the key alone: maps are rare in these records.
        let key = serde_json::to_value(key).map_err(ser::Error::custom)?;
        match key {
            serde_json::Value::String(s) => self.json.str(&s),
            serde_json::Value::Number(n) => self.json.str(&n.to_string()),
            serde_json::Value::Bool(b) => self.json.str(if b { "true" } else { "false" }),
            other => {
                return Err(ser::Error::custom(format!(
                    "map key {other} is not a string"
                )))
            }
        }
        self.json.out.push(b':');
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        v.serialize(&mut *self.json)
    }
    fn end(self) -> Result<(), Error> {
        self.finish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::to_vec;
    use serde::Serialize;
    use std::collections::BTreeMap;

    fn same<T: Serialize>(v: &T) {
        let ours = String::from_utf8(to_vec(v).unwrap()).unwrap();
        let theirs = serde_json::to_string(v).unwrap();
        assert_eq!(ours, theirs);
    }

    #[derive(Serialize)]
    enum E {
        Unit,
        New(u8),
        Tup(u8, String),
        Str { a: Option<f64>, b: Vec<i32> },
    }

    #[derive(Serialize)]
    struct S {
        s: String,
        n: Option<u64>,
        f: f64,
        g: f32,
        neg: i64,
        big: u128,
        ch: char,
        t: (bool, bool),
        e: Vec<E>,
        #[serde(skip_serializing_if = "Option::is_none")]
        skipped: Option<u8>,
        m: BTreeMap<String, i32>,
        ints: BTreeMap<u32, &'static str>,
        flags: BTreeMap<bool, u8>,
        #[serde(rename = "renamed-key")]
        r: (),
        bytes: serde_json::Value,
    }

    #[test]
    fn finds_an_escape_at_every_position() {
        for len in 0..40 {
            let plain = "a".repeat(len);
            assert!(!super::any_escape(plain.as_bytes()));
            same(&plain);
            for at in 0..len {
                for b in [b'"', b'\\', 0x00, 0x1f, 0x7f, 0xe9, b' '] {
                    let mut bytes = plain.clone().into_bytes();
                    bytes[at] = b;
                    let want = super::needs_escape(b);
                    assert_eq!(super::any_escape(&bytes), want, "{len} {at} {b:#x}");
                    if b < 0x80 {
                        same(&String::from_utf8(bytes).unwrap());
                    }
                }
            }
        }
    }

    #[test]
    fn writes_what_serde_json_writes() {
        let tricky = "quote \" back \\ nl \n tab \t nul \u{0} bell \u{7} é ✓ 🦀 \u{7f} </script>";
        let s = S {
            s: tricky.into(),
            n: None,
            f: 0.1 + 0.2,
            g: 1.5e-7,
            neg: i64::MIN,
            big: u128::MAX,
            ch: '"',
            t: (true, false),
            e: vec![
                E::Unit,
                E::New(7),
                E::Tup(1, "x".into()),
                E::Str {
                    a: Some(f64::NAN),
                    b: vec![-1, 0, 1],
                },
            ],
            skipped: None,
            m: [(tricky.to_string(), 1), ("plain".into(), 2)].into(),
            ints: [(3, "three"), (10, "ten")].into(),
            flags: [(true, 1), (false, 0)].into(),
            r: (),
            bytes: serde_json::json!({"nested": [1.0, 2.5, 1e300, -0.0, {"k": null}]}),
        };
        same(&s);
        same(&f64::INFINITY);
        same(&"");
        same(&Vec::<u8>::new());
    }

    #[test]
    fn writes_a_decision_record_as_serde_json_does() {
        let record = crate::decisions::DecisionRecord {
            request_id: "r-1".into(),
            tenant: "ten\"ant\u{1}".into(),
            tier: "Standard".into(),
            latency_ms: 12.345,
            queue_wait_ms: Some(3.0),
            pool: Some("spot".into()),
            inputs: Some(crate::replay::input::tests::sample().0),
            ..Default::default()
        };
        same(&record);
    }
}
