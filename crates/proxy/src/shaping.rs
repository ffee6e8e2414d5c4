//! Request shaping: the only two body fields Sluice ever changes, `max_tokens` (with
//! `max_completion_tokens`) and `model`. Pure functions over bytes; an unmodified body is never
//! re-serialised, so it reaches vLLM byte for byte.

use serde_json::{Map, Value};

/// Only POST/PUT/PATCH to the completions endpoints are eligible for shaping.
pub fn is_shapeable(method: &str, path: &str) -> bool {
    matches!(method, "POST" | "PUT" | "PATCH")
        && matches!(
            path.trim_end_matches('/'),
            "/v1/chat/completions" | "/v1/completions"
        )
}

/// What the ledger and the timeouts need from a completions body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BodyFacts {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub stream: bool,
}

#[derive(Debug, PartialEq)]
pub enum Shaped {
    /// Nothing to change: forward the original bytes.
    Unchanged(BodyFacts),
    /// The rewritten body.
    Rewritten {
        body: Vec<u8>,
        facts: BodyFacts,
        applied_max_tokens: Option<i64>,
    },
    /// Not a JSON object. The caller decides whether that is fatal (only when a rewrite is needed).
    NotJson,
}

/// Applies a `max_tokens` cap and/or a model rewrite.
pub fn shape(body: &[u8], cap: Option<u32>, model: Option<&str>) -> Shaped {
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(body) else {
        return Shaped::NotJson;
    };
    let facts = facts_of(&obj);
    let mut changed = false;
    if let Some(cap) = cap {
        changed |= apply_max_tokens(&mut obj, "max_tokens", cap, true);
        changed |= apply_max_tokens(&mut obj, "max_completion_tokens", cap, false);
    }
    if let Some(m) = model {
        changed |= apply_model(&mut obj, m);
    }
    if !changed {
        return Shaped::Unchanged(facts);
    }
    let applied_max_tokens = obj.get("max_tokens").and_then(Value::as_i64);
    match serde_json::to_vec(&Value::Object(obj)) {
        Ok(body) => Shaped::Rewritten {
            body,
            facts,
            applied_max_tokens,
        },
        Err(_) => Shaped::NotJson,
    }
}

pub fn facts_of(obj: &Map<String, Value>) -> BodyFacts {
    BodyFacts {
        model: obj.get("model").and_then(Value::as_str).map(str::to_string),
        max_tokens: obj
            .get("max_completion_tokens")
            .or_else(|| obj.get("max_tokens"))
            .and_then(Value::as_i64),
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
    }
}

/// Reads the facts without rewriting (for bodies that pass): the same answer as
/// [`facts_of`] over the parsed object, but the rest of the body (the messages above all) is
/// only checked, not built into a tree.
pub fn facts(body: &[u8]) -> Option<BodyFacts> {
    serde_json::from_slice::<FactsOnly>(body).ok().map(|f| f.0)
}

struct FactsOnly(BodyFacts);

impl<'de> serde::Deserialize<'de> for FactsOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(FactsVisitor)
    }
}

struct FactsVisitor;

impl<'de> serde::de::Visitor<'de> for FactsVisitor {
    type Value = FactsOnly;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    /// Later duplicates win, as they do in a parsed [`Value`].
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<FactsOnly, A::Error> {
        let (mut model, mut max_tokens, mut max_completion_tokens, mut stream) =
            (None, None, None, None);
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Model => model = Some(map.next_value::<Value>()?),
                Key::MaxTokens => max_tokens = Some(map.next_value::<Value>()?),
                Key::MaxCompletionTokens => {
                    max_completion_tokens = Some(map.next_value::<Value>()?)
                }
                Key::Stream => stream = Some(map.next_value::<Value>()?),
                Key::Other => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(FactsOnly(BodyFacts {
            // Moved out of the parsed value: a copy was one more allocation per request.
            model: match model {
                Some(Value::String(m)) => Some(m),
                _ => None,
            },
            max_tokens: max_completion_tokens
                .or(max_tokens)
                .as_ref()
                .and_then(Value::as_i64),
            stream: stream.as_ref().and_then(Value::as_bool).unwrap_or(false),
        }))
    }
}

/// A body key, told apart without allocating a `String` for it (keys without escapes are
/// compared in place).
enum Key {
    Model,
    MaxTokens,
    MaxCompletionTokens,
    Stream,
    Other,
}

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: serde::de::Error>(self, k: &str) -> Result<Key, E> {
                Ok(match k {
                    "model" => Key::Model,
                    "max_tokens" => Key::MaxTokens,
                    "max_completion_tokens" => Key::MaxCompletionTokens,
                    "stream" => Key::Stream,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// The seed's rules: missing → cap (only for `max_tokens`; `max_completion_tokens` is capped
/// only when present), not an integer → cap, above the cap → cap, at or below → unchanged.
fn apply_max_tokens(
    obj: &mut Map<String, Value>,
    field: &str,
    cap: u32,
    insert_missing: bool,
) -> bool {
    let current = match obj.get(field) {
        None if !insert_missing => return false,
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64()),
    };
    match current {
        Some(Some(n)) if n <= i64::from(cap) && n >= 0 => false,
        _ => {
            obj.insert(field.to_string(), Value::from(cap));
            true
        }
    }
}

fn apply_model(obj: &mut Map<String, Value>, model: &str) -> bool {
    if obj.get("model").and_then(Value::as_str) == Some(model) {
        return false;
    }
    obj.insert("model".into(), Value::from(model));
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streaming reader answers exactly what the parsed object does, duplicates and odd
    /// types included.
    #[test]
    fn facts_match_the_parsed_object() {
        let bodies = [
            r#"{"model":"m","messages":[{"role":"user","content":"hi \"x\""}],"max_tokens":5}"#,
            r#"{"model":"a","model":"b","max_tokens":1,"max_tokens":2,"stream":true}"#,
            r#"{"max_completion_tokens":null,"max_tokens":7}"#,
            r#"{"max_completion_tokens":9,"max_tokens":7,"stream":"yes"}"#,
            r#"{"model":3,"max_tokens":1.5,"nested":{"model":"no"}}"#,
            r#"{"mod\u0065l":"escaped-key"}"#,
            r#"[1,2]"#,
            r#"{"model":"m"} trailing"#,
            r#"{"model":"#,
            r#"not json"#,
        ];
        for b in bodies {
            let want = match serde_json::from_slice::<Value>(b.as_bytes()) {
                Ok(Value::Object(o)) => Some(facts_of(&o)),
                _ => None,
            };
            assert_eq!(facts(b.as_bytes()), want, "{b}");
        }
    }

    fn rewritten(body: &str, cap: Option<u32>, model: Option<&str>) -> Value {
        match shape(body.as_bytes(), cap, model) {
            Shaped::Rewritten { body, .. } => serde_json::from_slice(&body).unwrap(),
            other => panic!("expected a rewrite, got {other:?}"),
        }
    }

    #[test]
    fn shapeable_endpoints() {
        assert!(is_shapeable("POST", "/v1/chat/completions"));
        assert!(is_shapeable("PATCH", "/v1/completions"));
        assert!(!is_shapeable("GET", "/v1/chat/completions"));
        assert!(!is_shapeable("POST", "/v1/embeddings"));
        assert!(!is_shapeable("POST", "/v1/chat/completions/x"));
    }

    #[test]
    fn seed_max_tokens_rules() {
        assert_eq!(
            rewritten(r#"{"model":"m"}"#, Some(256), None)["max_tokens"],
            256,
            "missing → cap"
        );
        assert_eq!(
            rewritten(r#"{"max_tokens":"lots"}"#, Some(256), None)["max_tokens"],
            256,
            "non-integer → cap"
        );
        assert_eq!(
            rewritten(r#"{"max_tokens":1.5}"#, Some(256), None)["max_tokens"],
            256,
            "non-integer → cap"
        );
        assert_eq!(
            rewritten(r#"{"max_tokens":4096}"#, Some(256), None)["max_tokens"],
            256,
            "above → cap"
        );
        let below = r#"{"model":"m", "max_tokens": 100}"#;
        assert_eq!(
            shape(below.as_bytes(), Some(256), None),
            Shaped::Unchanged(facts(below.as_bytes()).unwrap())
        );
    }

    #[test]
    fn max_completion_tokens_capped_only_when_present() {
        let v = rewritten(
            r#"{"max_completion_tokens":9000,"max_tokens":10}"#,
            Some(512),
            None,
        );
        assert_eq!(
            (
                v["max_completion_tokens"].as_i64(),
                v["max_tokens"].as_i64()
            ),
            (Some(512), Some(10))
        );
        let v = rewritten(r#"{"max_tokens":9000}"#, Some(512), None);
        assert!(v.get("max_completion_tokens").is_none());
    }

    #[test]
    fn model_rewrite_keeps_every_other_field_in_order() {
        let body = r#"{"model":"big","messages":[{"role":"user","content":"hi"}],"temperature":0.7,"stream":true}"#;
        let Shaped::Rewritten {
            body: out, facts, ..
        } = shape(body.as_bytes(), None, Some("small"))
        else {
            panic!()
        };
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"model":"small","messages":[{"role":"user","content":"hi"}],"temperature":0.7,"stream":true}"#
        );
        assert_eq!(
            facts.model.as_deref(),
            Some("big"),
            "facts describe the request as received"
        );
        assert!(facts.stream);
    }

    #[test]
    fn not_json_is_reported_not_guessed() {
        assert_eq!(shape(b"{not json", Some(10), None), Shaped::NotJson);
        assert_eq!(shape(b"[1,2]", Some(10), None), Shaped::NotJson);
    }
}
