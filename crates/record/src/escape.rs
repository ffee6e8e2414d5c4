//! Compact JSON for what is written once per request: the decision record (the log line) and
//! its policy inputs (packed, in the line). The output reads back through serde as
//! the value written, and its objects are byte for byte what `serde_json::to_vec` writes; the
//! inputs are packed into arrays (see [`crate::line`]). A string goes through
//! serde_json's escaper only when it holds a byte that needs escaping.

pub(crate) fn needs_escape(b: u8) -> bool {
    b < 0x20 || b == b'"' || b == b'\\'
}

/// Whether any byte of `s` needs escaping, eight bytes per step: most strings here (ids,
/// names, models) need none, and the byte-per-byte scan was the largest single cost left.
pub(crate) fn any_escape(s: &[u8]) -> bool {
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

/// `s` as a JSON string.
pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) {
    if any_escape(s.as_bytes()) {
        // Rare (a control character or quote in a tenant name or an error): serde_json's
        // escaper, so the escapes are its own.
        let _ = serde_json::to_writer(&mut *out, s);
    } else {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

#[cfg(test)]
mod tests {
    use super::{any_escape, needs_escape, write_str};

    fn same(s: &str) {
        let mut ours = Vec::new();
        write_str(&mut ours, s);
        assert_eq!(
            String::from_utf8(ours).unwrap(),
            serde_json::to_string(s).unwrap()
        );
    }

    #[test]
    fn finds_an_escape_at_every_position() {
        for len in 0..40 {
            let plain = "a".repeat(len);
            assert!(!any_escape(plain.as_bytes()));
            same(&plain);
            for at in 0..len {
                for b in [b'"', b'\\', 0x00, 0x1f, 0x7f, 0xe9, b' '] {
                    let mut bytes = plain.clone().into_bytes();
                    bytes[at] = b;
                    let want = needs_escape(b);
                    assert_eq!(any_escape(&bytes), want, "{len} {at} {b:#x}");
                    if b < 0x80 {
                        same(&String::from_utf8(bytes).unwrap());
                    }
                }
            }
        }
    }

    #[test]
    fn escapes_a_string_as_serde_json_does() {
        same("quote \" back \\ nl \n tab \t nul \u{0} bell \u{7} é ✓ 🦀 \u{7f} </script>");
        same("");
    }
}
