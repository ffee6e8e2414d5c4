//! Pure checks of a request's head and, when it is small, its body framing, run by the
//! connection guard ([`super::conn_guard`]) on the raw bytes *before* Pingora parses them.
//!
//! Pingora 0.9.1 enforces only fixed limits (1 MiB of header, 256 fields) and answers framing
//! errors with an empty 400 and an immediate close; some ambiguous framings it accepts and
//! normalises. Sluice refuses every ambiguous framing here, with a JSON answer, so a request
//! whose framing two HTTP parsers could read differently never reaches a backend.

pub use sluice_config::limits::{HeadLimits, PINGORA_MAX_HEADERS, PINGORA_MAX_HEADER_BYTES};

/// Body bytes read ahead to check framing: the size Sluice pre-reads anyway (Pingora's retry
/// buffer). Larger bodies are framed by Pingora's parser as they stream.
pub const BODY_LOOKAHEAD: usize = 64 * 1024;

/// How the request's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    NoBody,
    Length(u64),
    Chunked,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Bytes of request line and headers, up to and including the blank line.
    pub len: usize,
    pub framing: Framing,
    /// The client waits for `100 Continue` before sending its body: don't read ahead.
    pub expect_continue: bool,
}

/// What the client is told. `code` is the stable `error.code` (and `x-sluice-reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub code: &'static str,
    pub message: &'static str,
}

const fn refusal(status: u16, code: &'static str, message: &'static str) -> Refusal {
    Refusal {
        status,
        code,
        message,
    }
}

pub const TOO_MANY_CONNECTIONS: Refusal = refusal(
    503,
    "too_many_connections",
    "This listener has reached its connection limit; retry shortly.",
);
pub const LINE_TOO_LONG: Refusal = refusal(
    414,
    "request_line_too_long",
    "The request line is longer than this server accepts.",
);
pub const HEADER_TOO_LARGE: Refusal = refusal(
    431,
    "request_header_too_large",
    "The request header is larger than this server accepts.",
);
pub const TOO_MANY_HEADERS: Refusal = refusal(
    431,
    "too_many_headers",
    "The request has more header fields than this server accepts.",
);
pub const MALFORMED: Refusal = refusal(
    400,
    "malformed_request",
    "The request line or a header field is malformed (invalid bytes, bare CR, obsolete line folding).",
);
pub const BAD_VERSION: Refusal = refusal(
    400,
    "malformed_request",
    "Only HTTP/1.0 and HTTP/1.1 requests are accepted on this listener.",
);
pub const CL_AND_TE: Refusal = refusal(
    400,
    "ambiguous_framing",
    "The request has both Content-Length and Transfer-Encoding.",
);
pub const BAD_CONTENT_LENGTH: Refusal = refusal(
    400,
    "ambiguous_framing",
    "Content-Length is not a number, or is given more than once with different values.",
);
pub const BAD_TRANSFER_ENCODING: Refusal = refusal(
    400,
    "ambiguous_framing",
    "Transfer-Encoding must be exactly \"chunked\" (and is not allowed in HTTP/1.0).",
);
pub const BAD_CHUNK: Refusal = refusal(
    400,
    "invalid_chunked_body",
    "The chunked body is malformed (chunk size, chunk extension or line ending).",
);
pub const TRAILING_DATA: Refusal = refusal(
    400,
    "data_after_body",
    "Bytes arrived after the end of the request body (longer than Content-Length, or pipelined); pipelining is not supported.",
);

#[derive(Debug, PartialEq, Eq)]
pub enum HeadVerdict {
    Incomplete,
    Complete(Head),
    Refuse(Refusal),
}

/// Checks the bytes received so far. `Incomplete` means read more (the caller bounds time).
pub fn check_head(buf: &[u8], limits: &HeadLimits) -> HeadVerdict {
    let Some(line_end) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() > limits.max_request_line_bytes {
            HeadVerdict::Refuse(LINE_TOO_LONG)
        } else {
            HeadVerdict::Incomplete
        };
    };
    if line_end > limits.max_request_line_bytes {
        return HeadVerdict::Refuse(LINE_TOO_LONG);
    }
    let line = &buf[..line_end];
    let Some(line) = line.strip_suffix(b"\r") else {
        // A bare LF ends the request line: tolerated by some parsers, not by others.
        return HeadVerdict::Refuse(MALFORMED);
    };
    let http10 = match request_line_version(line) {
        Ok(v) => v,
        Err(r) => return HeadVerdict::Refuse(r),
    };
    let rest = &buf[line_end + 1..];
    let mut fields = vec![httparse::EMPTY_HEADER; limits.max_headers];
    let (fields_len, fields) = match httparse::parse_headers(rest, &mut fields) {
        Ok(httparse::Status::Complete((n, h))) => (n, h),
        Ok(httparse::Status::Partial) => {
            return if buf.len() > limits.max_header_bytes {
                HeadVerdict::Refuse(HEADER_TOO_LARGE)
            } else {
                HeadVerdict::Incomplete
            };
        }
        Err(httparse::Error::TooManyHeaders) => return HeadVerdict::Refuse(TOO_MANY_HEADERS),
        Err(_) => return HeadVerdict::Refuse(MALFORMED),
    };
    let len = line_end + 1 + fields_len;
    if len > limits.max_header_bytes {
        return HeadVerdict::Refuse(HEADER_TOO_LARGE);
    }
    // httparse accepts a bare LF as a line end; Pingora does too. Two parsers disagreeing on
    // where a header ends is how smuggling starts, so only CRLF is accepted.
    if bare_lf(&buf[line_end + 1..len]) {
        return HeadVerdict::Refuse(MALFORMED);
    }
    match framing(fields, http10) {
        Ok((framing, expect_continue)) => HeadVerdict::Complete(Head {
            len,
            framing,
            expect_continue,
        }),
        Err(r) => HeadVerdict::Refuse(r),
    }
}

/// `Ok(true)` for HTTP/1.0. The method and target are Pingora's to judge (it escapes some
/// bytes in targets that strict parsers reject); only control bytes are refused here.
fn request_line_version(line: &[u8]) -> Result<bool, Refusal> {
    if line.iter().any(|&b| b < 0x20 || b == 0x7f) {
        return Err(MALFORMED);
    }
    if line.ends_with(b" HTTP/1.1") {
        Ok(false)
    } else if line.ends_with(b" HTTP/1.0") {
        Ok(true)
    } else {
        Err(BAD_VERSION)
    }
}

fn bare_lf(fields: &[u8]) -> bool {
    // memchr jumps from line end to line end; a byte-by-byte scan of every head was ~0.5k
    // instructions a request.
    memchr::memchr_iter(b'\n', fields).any(|i| i == 0 || fields[i - 1] != b'\r')
}

fn framing(fields: &[httparse::Header<'_>], http10: bool) -> Result<(Framing, bool), Refusal> {
    let mut length: Option<u64> = None;
    let mut codings: Vec<String> = Vec::new();
    let mut expect_continue = false;
    for f in fields {
        if f.name.eq_ignore_ascii_case("content-length") {
            let text = std::str::from_utf8(f.value).map_err(|_| BAD_CONTENT_LENGTH)?;
            for part in text.split(',') {
                let part = part.trim_matches([' ', '\t']);
                if part.is_empty() || part.len() > 19 || !part.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(BAD_CONTENT_LENGTH);
                }
                let n: u64 = part.parse().map_err(|_| BAD_CONTENT_LENGTH)?;
                if length.is_some_and(|l| l != n) {
                    return Err(BAD_CONTENT_LENGTH);
                }
                length = Some(n);
            }
        } else if f.name.eq_ignore_ascii_case("transfer-encoding") {
            let text = std::str::from_utf8(f.value).map_err(|_| BAD_TRANSFER_ENCODING)?;
            codings.extend(
                text.split(',')
                    .map(|c| c.trim_matches([' ', '\t']).to_ascii_lowercase()),
            );
        } else if f.name.eq_ignore_ascii_case("expect") {
            expect_continue |= f.value.eq_ignore_ascii_case(b"100-continue");
        }
    }
    let framing = match (length, codings.is_empty()) {
        (Some(_), false) => return Err(CL_AND_TE),
        (None, false) if http10 || codings != ["chunked"] => return Err(BAD_TRANSFER_ENCODING),
        (None, false) => Framing::Chunked,
        (Some(0) | None, true) => Framing::NoBody,
        (Some(n), true) => Framing::Length(n),
    };
    Ok((framing, expect_continue))
}

#[derive(Debug, PartialEq, Eq)]
pub enum BodyVerdict {
    Incomplete,
    /// The body ends this many bytes into the buffer.
    Complete(usize),
    Refuse(Refusal),
}

/// Strict chunked framing: hex size, no extensions, CRLF only, data exactly `size` bytes,
/// optional trailer fields, blank line.
pub fn check_chunked(buf: &[u8]) -> BodyVerdict {
    let mut at = 0;
    loop {
        let Some(nl) = buf[at..].iter().position(|&b| b == b'\n') else {
            // 16 hex digits and CRLF are the most a valid size line needs.
            return if buf.len() - at > 18 {
                BodyVerdict::Refuse(BAD_CHUNK)
            } else {
                BodyVerdict::Incomplete
            };
        };
        let Some(size) = buf[at..at + nl].strip_suffix(b"\r").and_then(chunk_size) else {
            return BodyVerdict::Refuse(BAD_CHUNK);
        };
        at += nl + 1;
        if size == 0 {
            return trailers(buf, at);
        }
        // A size beyond the buffer is only a larger chunk still to come.
        let Some(end) = usize::try_from(size)
            .ok()
            .and_then(|s| at.checked_add(s))
            .filter(|end| end.checked_add(2).is_some_and(|e| e <= buf.len()))
        else {
            return BodyVerdict::Incomplete;
        };
        if &buf[end..end + 2] != b"\r\n" {
            return BodyVerdict::Refuse(BAD_CHUNK);
        }
        at = end + 2;
    }
}

fn chunk_size(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 16 || !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

fn trailers(buf: &[u8], mut at: usize) -> BodyVerdict {
    loop {
        let Some(nl) = buf[at..].iter().position(|&b| b == b'\n') else {
            return BodyVerdict::Incomplete;
        };
        let Some(line) = buf[at..at + nl].strip_suffix(b"\r") else {
            return BodyVerdict::Refuse(BAD_CHUNK);
        };
        at += nl + 1;
        if line.is_empty() {
            return BodyVerdict::Complete(at);
        }
        let valid = line.iter().position(|&b| b == b':').is_some_and(|c| c > 0)
            && line
                .iter()
                .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b) || b >= 0x80);
        if !valid {
            return BodyVerdict::Refuse(BAD_CHUNK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: HeadLimits = HeadLimits {
        max_header_bytes: 1024,
        max_headers: 8,
        max_request_line_bytes: 128,
    };

    fn head(raw: &str) -> HeadVerdict {
        check_head(raw.as_bytes(), &LIMITS)
    }

    fn refused(raw: &str) -> &'static str {
        match head(raw) {
            HeadVerdict::Refuse(r) => r.code,
            other => panic!("{raw:?} was not refused: {other:?}"),
        }
    }

    #[test]
    fn a_plain_request_and_its_framing() {
        let raw =
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n{\"a\":1}";
        assert_eq!(
            head(raw),
            HeadVerdict::Complete(Head {
                len: raw.len() - 7,
                framing: Framing::Length(12),
                expect_continue: false
            })
        );
        let chunked =
            "POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\nExpect: 100-continue\r\n\r\n";
        assert!(matches!(
            head(chunked),
            HeadVerdict::Complete(Head {
                framing: Framing::Chunked,
                expect_continue: true,
                ..
            })
        ));
        let same_twice = "POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3, 3\r\n\r\n";
        assert!(matches!(
            head(same_twice),
            HeadVerdict::Complete(Head {
                framing: Framing::Length(3),
                ..
            })
        ));
        assert_eq!(
            head("GET / HTTP/1.1\r\nHost: x\r\n"),
            HeadVerdict::Incomplete
        );
        assert_eq!(head("GET /abc"), HeadVerdict::Incomplete);
    }

    #[test]
    fn limits_are_enforced_before_the_head_is_complete() {
        assert_eq!(
            refused(&format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(200))),
            "request_line_too_long"
        );
        assert_eq!(
            refused(&format!("GET /{}", "a".repeat(200))),
            "request_line_too_long"
        );
        assert_eq!(
            refused(&format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(2000))),
            "request_header_too_large"
        );
        assert_eq!(
            refused(&format!("GET / HTTP/1.1\r\n{}", "X: 1\r\n".repeat(9))),
            "too_many_headers"
        );
        assert!(matches!(
            head(&format!("GET / HTTP/1.1\r\n{}\r\n", "X: 1\r\n".repeat(8))),
            HeadVerdict::Complete(_)
        ));
    }

    #[test]
    fn ambiguous_framing_is_refused() {
        for raw in [
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n",
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert_eq!(refused(raw), "ambiguous_framing", "{raw:?}");
        }
        for raw in [
            "POST / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            "POST / HTTP/1.1\r\nX: a\0b\r\n\r\n",
            "POST / HTTP/1.1\r\nX: a\rb\r\n\r\n",
            "POST / HTTP/1.1\r\nX: a\nY: b\r\n\r\n",
            "POST / HTTP/1.1\r\nX: a\r\n\n",
            "POST / HTTP/1.1\r\n\nX: a\r\n\r\n",
            "POST / HTTP/1.1\nX: a\r\n\r\n",
            "POST / HTTP/2.0\r\n\r\n",
            "POST /\0 HTTP/1.1\r\n\r\n",
            "POST / HTTP/1.1\r\nX : a\r\n\r\n",
        ] {
            assert_eq!(refused(raw), "malformed_request", "{raw:?}");
        }
    }

    #[test]
    fn chunked_bodies_are_framed_strictly() {
        assert_eq!(
            check_chunked(b"5\r\nhello\r\n0\r\n\r\n"),
            BodyVerdict::Complete(15)
        );
        assert_eq!(
            check_chunked(b"5\r\nhello\r\n0\r\nX-T: 1\r\n\r\nrest"),
            BodyVerdict::Complete(23)
        );
        assert_eq!(check_chunked(b"5\r\nhel"), BodyVerdict::Incomplete);
        assert_eq!(
            check_chunked(b"ffffffffffffffff\r\nab"),
            BodyVerdict::Incomplete
        );
        assert_eq!(
            check_chunked(b"5\r\nhello\r\n0\r\n"),
            BodyVerdict::Incomplete
        );
        for bad in [
            &b"5;ext=1\r\nhello\r\n0\r\n\r\n"[..],
            b"zz\r\nhello\r\n0\r\n\r\n",
            b"5\nhello\r\n0\r\n\r\n",
            b"5 \r\nhello\r\n0\r\n\r\n",
            b"3\r\nhello\r\n0\r\n\r\n",
            b"fffffffffffffffff\r\n",
            b"-1\r\nx\r\n",
            b"5\r\nhello\r\n0\r\nbad trailer\r\n\r\n",
        ] {
            assert_eq!(
                check_chunked(bad),
                BodyVerdict::Refuse(BAD_CHUNK),
                "{}",
                bad.escape_ascii()
            );
        }
    }
}
