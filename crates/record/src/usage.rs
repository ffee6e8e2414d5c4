//! What a completion reports it used: `usage.prompt_tokens` and `usage.completion_tokens` of
//! an OpenAI-style body or of an SSE stream's usage chunk. The proxy reads it from the
//! response it relays (quotas and the record); clients of the API read the same.

/// (prompt_tokens, completion_tokens) from a completion body or an SSE stream's usage chunk.
pub fn usage_of(body: &[u8], sse: bool) -> (Option<u64>, Option<u64>) {
    // Typed, so the rest of a completion (its text above all) is skipped, not built into a tree.
    #[derive(serde::Deserialize)]
    struct Body {
        usage: Option<Usage>,
    }
    let parse = |json: &[u8]| {
        serde_json::from_slice::<Body>(json)
            .ok()?
            .usage
            .map(Usage::counts)
    };
    if !sse {
        return usage_near_end(body)
            .or_else(|| parse(body))
            .unwrap_or_default();
    }
    let text = String::from_utf8_lossy(body);
    text.rsplit("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data:"))
        .map(str::trim)
        .filter(|data| data.starts_with('{') && data.contains("\"usage\""))
        .find_map(|data| parse(data.as_bytes()))
        .unwrap_or_default()
}

/// The usage object of a completion body, found by its key from the end (vLLM and OpenAI put
/// it last) and parsed alone: the whole body was ~6k instructions per request to read two
/// numbers. `"usage"` followed by `:` cannot occur inside a JSON string (its quotes would be
/// escaped there), so a match is a key; `None` sends the caller to the full parse.
fn usage_near_end(body: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    const KEY: &[u8] = b"\"usage\"";
    let at = body.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = &body[at + KEY.len()..];
    let value = rest.trim_ascii_start().strip_prefix(b":")?;
    if let Some(counts) = flat_usage(value) {
        return Some(counts);
    }
    let mut de = serde_json::Deserializer::from_slice(value);
    let u = <Option<Usage> as serde::Deserialize>::deserialize(&mut de).ok()??;
    Some(u.counts())
}

/// The usage value as vLLM writes it — `null`, or one flat object of whole counts and nulls
/// (`prompt_tokens_details: null`) — read without serde (~1.6k instructions a request there).
/// `None` for any other shape (a nested object, a string, a fraction, a repeated key), which
/// the caller hands to serde.
fn flat_usage(value: &[u8]) -> Option<(Option<u64>, Option<u64>)> {
    let mut rest = value.trim_ascii_start();
    if rest.starts_with(b"null") {
        return Some((None, None));
    }
    rest = rest.strip_prefix(b"{")?.trim_ascii_start();
    let (mut prompt, mut completion) = (None, None);
    let (mut seen_prompt, mut seen_completion) = (false, false);
    if rest.starts_with(b"}") {
        return Some((None, None));
    }
    loop {
        rest = rest.strip_prefix(b"\"")?;
        let end = rest.iter().position(|&b| b == b'"' || b == b'\\')?;
        if rest[end] != b'"' {
            return None;
        }
        let key = &rest[..end];
        rest = rest[end + 1..]
            .trim_ascii_start()
            .strip_prefix(b":")?
            .trim_ascii_start();
        let count = if let Some(after) = rest.strip_prefix(b"null") {
            rest = after;
            None
        } else {
            let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
            if digits == 0 || digits > 19 {
                return None;
            }
            let n = std::str::from_utf8(&rest[..digits])
                .ok()?
                .parse::<u64>()
                .ok()?;
            rest = &rest[digits..];
            if matches!(rest.first(), Some(b'.' | b'e' | b'E')) {
                return None;
            }
            Some(n)
        };
        let slot = match key {
            b"prompt_tokens" => Some((&mut prompt, &mut seen_prompt)),
            b"completion_tokens" => Some((&mut completion, &mut seen_completion)),
            _ => None,
        };
        if let Some((value, seen)) = slot {
            if std::mem::replace(seen, true) {
                return None;
            }
            *value = count;
        }
        rest = rest.trim_ascii_start();
        match rest.first()? {
            b',' => rest = rest[1..].trim_ascii_start(),
            b'}' => return Some((prompt, completion)),
            _ => return None,
        }
    }
}

#[derive(serde::Deserialize)]
struct Usage {
    prompt_tokens: Option<serde_json::Value>,
    completion_tokens: Option<serde_json::Value>,
}

impl Usage {
    fn counts(self) -> (Option<u64>, Option<u64>) {
        let count = |v: Option<serde_json::Value>| v.and_then(|v| v.as_u64());
        (count(self.prompt_tokens), count(self.completion_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_json_and_sse() {
        let body =
            br#"{"id":"x","usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
        assert_eq!(usage_of(body, false), (Some(5), Some(7)));
        let sse = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":9}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage_of(sse, true), (Some(3), Some(9)));
        assert_eq!(
            usage_of(b"data: {\"usage\":null}\n\ndata: [DONE]\n\n", true),
            (None, None)
        );
        assert_eq!(usage_of(b"not json", false), (None, None));
        // The key inside generated text is escaped, so only the real usage counts.
        let body = br#"{"choices":[{"message":{"content":"say \"usage\": {\"prompt_tokens\": 99}"}}],"usage" : {"prompt_tokens":4,"completion_tokens":2}}"#;
        assert_eq!(usage_of(body, false), (Some(4), Some(2)));
        assert_eq!(
            usage_of(br#"{"usage":null,"choices":[]}"#, false),
            (None, None)
        );
        // Not last: found all the same; a body cut mid-usage falls back and finds nothing.
        assert_eq!(
            usage_of(
                br#"{"usage":{"prompt_tokens":1,"completion_tokens":3},"id":"x"}"#,
                false
            ),
            (Some(1), Some(3))
        );
        assert_eq!(usage_of(br#"{"usage":{"prompt_tok"#, false), (None, None));
    }

    /// The flat reader and serde agree on every shape either reads; what the flat one declines
    /// serde still reads.
    #[test]
    fn flat_usage_agrees_with_serde() {
        let serde_read = |v: &[u8]| {
            let u: Option<Usage> = serde_json::from_slice(v).ok()?;
            Some(u.map_or((None, None), Usage::counts))
        };
        for v in [
            &br#"null"#[..],
            br#"{}"#,
            br#"{"prompt_tokens":5,"total_tokens":12,"completion_tokens":7}"#,
            br#" { "prompt_tokens" : 5 , "completion_tokens" : null , "prompt_tokens_details" : null } "#,
            br#"{"completion_tokens":18446744073709551615}"#,
            br#"{"prompt_tokens":1.5,"completion_tokens":2}"#,
            br#"{"prompt_tokens":-1,"completion_tokens":2}"#,
            br#"{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":2},"completion_tokens":4}"#,
            br#"{"prompt_tokens":"3","completion_tokens":4}"#,
            br#"{"prompt_tokens":3,"prompt_tokens":4}"#,
            br#"{"prompt_tokens":3,"completion_tokens":4"#,
            br#"{"pro\"mpt_tokens":3}"#,
            br#"{"prompt_tokens":1e3}"#,
        ] {
            if let Some(flat) = flat_usage(v) {
                assert_eq!(Some(flat), serde_read(v), "{}", String::from_utf8_lossy(v));
            }
        }
        assert!(flat_usage(br#"{"prompt_tokens":3,"completion_tokens":4}"#).is_some());
        let nested = br#"{"prompt_tokens_details":{"cached_tokens":2},"prompt_tokens":3,"completion_tokens":4}"#;
        assert_eq!(flat_usage(nested), None);
        let body = [&br#"{"usage":"#[..], nested, b"}"].concat();
        assert_eq!(usage_of(&body, false), (Some(3), Some(4)));
    }
}
