//! Request shaping: the body fields Sluice changes, `max_tokens` (with `max_completion_tokens`)
//! and `model`, and, for a pool that asks for it, vLLM's `priority`. Pure functions over bytes;
//! an unmodified body is never re-serialised, so it reaches vLLM byte for byte.

use serde_json::{Map, Value};
use std::hash::Hasher;

/// How much of a prompt's head keys its replica (prefix affinity): a few thousand characters
/// hold a shared system prompt's start or a conversation's first turns.
pub const PREFIX_BYTES: usize = 2048;

/// Only POST/PUT/PATCH to the completions endpoints are eligible for shaping.
pub fn is_shapeable(method: &str, path: &str) -> bool {
    matches!(method, "POST" | "PUT" | "PATCH")
        && matches!(
            path.trim_end_matches('/'),
            "/v1/chat/completions" | "/v1/completions"
        )
}

/// What routing, the ledger and the timeouts need from a completions body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BodyFacts {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub stream: bool,
    /// The body carries a `priority` field (a client's own is never trusted).
    pub has_priority: bool,
    /// A hash of the prompt's first [`PREFIX_BYTES`] (the messages' roles and text, or the
    /// prompt), when it has any.
    pub prefix: Option<u64>,
    /// The prompt's estimated tokens from its text and tool definitions, when it has any: the
    /// body's bytes count its JSON too (quotes, keys, escapes), a tenth or more of a short
    /// prompt, and a tenant's fair share is charged by this.
    pub prompt_tokens: Option<u64>,
}

/// What to do with the body's `priority` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    /// Leave it as the client sent it (or did not).
    #[default]
    Keep,
    /// Write this value (the tier's).
    Set(i64),
    /// Remove a client's own.
    Strip,
}

/// The rewrites a decision asks of a body.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rewrite<'a> {
    pub cap: Option<u32>,
    pub model: Option<&'a str>,
    pub priority: Priority,
}

impl Rewrite<'_> {
    /// Whether the body may need a change (read it whole to find out).
    pub fn any(&self, facts: Option<&BodyFacts>) -> bool {
        self.cap.is_some()
            || self.model.is_some()
            || match self.priority {
                Priority::Keep => false,
                Priority::Set(_) => true,
                Priority::Strip => facts.is_none_or(|f| f.has_priority),
            }
    }
}

/// Hashes the head of a prompt, piece by piece, up to [`PREFIX_BYTES`], and measures all of it.
#[derive(Default)]
struct PrefixHash {
    hasher: std::hash::DefaultHasher,
    fed: usize,
    /// Bytes of text read (all of it, not just the head), and of tool definitions.
    text: u64,
    /// Messages (or items of a batched prompt) read.
    pieces: u64,
}

impl PrefixHash {
    fn feed(&mut self, piece: &str) {
        self.text += piece.len() as u64;
        let room = PREFIX_BYTES.saturating_sub(self.fed);
        let take = &piece.as_bytes()[..piece.len().min(room)];
        if !take.is_empty() {
            self.hasher.write(take);
            self.fed += take.len();
        }
    }

    /// Between a message's role and its text, and after each message, so that "ab" + "c" and
    /// "a" + "bc" differ.
    fn mark(&mut self, byte: u8) {
        self.pieces += u64::from(byte);
        if self.fed < PREFIX_BYTES {
            self.hasher.write_u8(byte);
        }
    }

    /// Bytes the prompt carries besides its messages (tool definitions, rendered into it).
    fn extra(&mut self, bytes: u64) {
        self.text += bytes;
    }

    /// The prefix hash and the prompt's estimated tokens.
    fn finish(self) -> (Option<u64>, Option<u64>) {
        let tokens = (self.text > 0 || self.pieces > 0)
            .then(|| sluice_policy::work_gate::prompt_tokens_of_text(self.text, self.pieces));
        ((self.fed > 0).then(|| self.hasher.finish()), tokens)
    }
}

/// The bytes of a JSON value's strings and keys: what a chat template renders of tool
/// definitions.
fn text_bytes(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.len() as u64,
        Value::Array(a) => a.iter().map(text_bytes).sum(),
        Value::Object(o) => o.iter().map(|(k, v)| k.len() as u64 + text_bytes(v)).sum(),
        _ => 1,
    }
}

/// The prompt head's hash and the prompt's estimated tokens from a parsed body (the same as
/// the streaming reader's).
fn prefix_of(obj: &Map<String, Value>) -> (Option<u64>, Option<u64>) {
    let mut h = PrefixHash::default();
    for (key, v) in obj {
        match (key.as_str(), v) {
            ("messages", Value::Array(messages)) => {
                for m in messages {
                    let Value::Object(m) = m else { continue };
                    for (k, v) in m {
                        match (k.as_str(), v) {
                            ("role", r) => {
                                if let Value::String(r) = r {
                                    h.feed(r);
                                }
                                h.mark(0);
                            }
                            ("content", Value::String(c)) => h.feed(c),
                            ("content", Value::Array(parts)) => {
                                for p in parts {
                                    if let Some(Value::String(t)) = p.get("text") {
                                        h.feed(t);
                                    }
                                }
                            }
                            _ => {}
                        }
                    }
                    h.mark(1);
                }
            }
            ("prompt", Value::String(p)) => h.feed(p),
            ("prompt", Value::Array(ps)) => {
                for p in ps {
                    match p {
                        Value::String(p) => {
                            h.feed(p);
                            h.mark(1);
                        }
                        Value::Number(_) => h.extra(4),
                        _ => {}
                    }
                }
            }
            ("tools" | "functions", v) => h.extra(text_bytes(v)),
            _ => {}
        }
    }
    h.finish()
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

/// Applies a `max_tokens` cap, a model rewrite and the `priority` rule.
pub fn shape(body: &[u8], rewrite: &Rewrite<'_>) -> Shaped {
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(body) else {
        return Shaped::NotJson;
    };
    let facts = facts_of(&obj);
    let mut changed = false;
    if let Some(cap) = rewrite.cap {
        changed |= apply_max_tokens(&mut obj, "max_tokens", cap, true);
        changed |= apply_max_tokens(&mut obj, "max_completion_tokens", cap, false);
    }
    if let Some(m) = rewrite.model {
        changed |= apply_model(&mut obj, m);
    }
    match rewrite.priority {
        Priority::Keep => {}
        Priority::Set(p) => {
            if obj.get("priority").and_then(Value::as_i64) != Some(p)
                || obj.get("priority").is_some_and(|v| !v.is_i64())
            {
                obj.insert("priority".into(), Value::from(p));
                changed = true;
            }
        }
        Priority::Strip => changed |= obj.shift_remove("priority").is_some(),
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
    let (prefix, prompt_tokens) = prefix_of(obj);
    BodyFacts {
        model: obj.get("model").and_then(Value::as_str).map(str::to_string),
        max_tokens: obj
            .get("max_completion_tokens")
            .or_else(|| obj.get("max_tokens"))
            .and_then(Value::as_i64),
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
        has_priority: obj.contains_key("priority"),
        prefix,
        prompt_tokens,
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
        let mut has_priority = false;
        let mut prefix = PrefixHash::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Priority => {
                    has_priority = true;
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
                Key::Messages => map.next_value_seed(Messages(&mut prefix))?,
                Key::Prompt => map.next_value_seed(Prompt(&mut prefix))?,
                Key::Tools => prefix.extra(text_bytes(&map.next_value::<Value>()?)),
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
        let (prefix, prompt_tokens) = prefix.finish();
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
            has_priority,
            prefix,
            prompt_tokens,
        }))
    }
}

/// Visitor methods that read a JSON value past without using it: the prompt head's visitors
/// each care about one shape and let the others go by.
macro_rules! skip {
    ($de:lifetime; str) => {
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
    };
    ($de:lifetime; seq) => {
        fn visit_seq<A: serde::de::SeqAccess<$de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
            Ok(())
        }
    };
    ($de:lifetime; map) => {
        fn visit_map<A: serde::de::MapAccess<$de>>(self, mut map: A) -> Result<(), A::Error> {
            while map
                .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                .is_some()
            {}
            Ok(())
        }
    };
    ($de:lifetime; scalars) => {
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    };
}

/// `messages`, fed to the prefix hash as it is read (roles and text, nothing built).
struct Messages<'h>(&'h mut PrefixHash);

impl<'de> serde::de::DeserializeSeed<'de> for Messages<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Messages<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("messages")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Message(&mut *self.0))?.is_some() {}
        Ok(())
    }
    skip!('de; map);
    skip!('de; str);
    skip!('de; scalars);
}

/// One message: its role and text parts in document order, read in place.
struct Message<'h>(&'h mut PrefixHash);

impl<'de> serde::de::DeserializeSeed<'de> for Message<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Message<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a message")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "role" => {
                    map.next_value_seed(Text(&mut *self.0))?;
                    self.0.mark(0);
                }
                "content" => map.next_value_seed(Text(&mut *self.0))?,
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        self.0.mark(1);
        Ok(())
    }
    skip!('de; seq);
    skip!('de; str);
    skip!('de; scalars);
}

/// A role or a content: a string is fed, a list of parts feeds each part's `text`.
struct Text<'h>(&'h mut PrefixHash);

impl<'de> serde::de::DeserializeSeed<'de> for Text<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Text<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("text")
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.feed(v);
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Part(&mut *self.0))?.is_some() {}
        Ok(())
    }
    skip!('de; map);
    skip!('de; scalars);
}

/// One content part: only its `text` counts (the last one, as a parsed object keeps).
struct Part<'h>(&'h mut PrefixHash);

impl<'de> serde::de::DeserializeSeed<'de> for Part<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Part<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a content part")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut text: Option<std::borrow::Cow<'de, str>> = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key == "text" {
                match map.next_value::<serde_json::Value>()? {
                    Value::String(t) => text = Some(t.into()),
                    _ => text = None,
                }
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        if let Some(t) = text {
            self.0.feed(&t);
        }
        Ok(())
    }
    skip!('de; seq);
    skip!('de; str);
    skip!('de; scalars);
}

/// `prompt` (completions): a string or a list of strings.
struct Prompt<'h>(&'h mut PrefixHash);

impl<'de> serde::de::DeserializeSeed<'de> for Prompt<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match <serde_json::Value as serde::Deserialize>::deserialize(d)? {
            Value::String(p) => self.0.feed(&p),
            Value::Array(ps) => {
                for p in ps {
                    match p {
                        Value::String(p) => {
                            self.0.feed(&p);
                            self.0.mark(1);
                        }
                        // A token id is one token.
                        Value::Number(_) => self.0.extra(4),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// A body key, told apart without allocating a `String` for it (keys without escapes are
/// compared in place).
enum Key {
    Model,
    MaxTokens,
    MaxCompletionTokens,
    Stream,
    Priority,
    Messages,
    Prompt,
    Tools,
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
                    "priority" => Key::Priority,
                    "messages" => Key::Messages,
                    "prompt" => Key::Prompt,
                    "tools" | "functions" => Key::Tools,
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
            r#"{"messages":[{"content":[{"type":"text","text":"a"},{"type":"image_url"},"x"],"role":5},"str",{"role":"tool"}],"priority":3}"#,
            r#"{"prompt":["a","b",7],"messages":{"not":"a list"}}"#,
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
        let rw = Rewrite {
            cap,
            model,
            ..Rewrite::default()
        };
        match shape(body.as_bytes(), &rw) {
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
        let cap = Rewrite {
            cap: Some(256),
            ..Rewrite::default()
        };
        assert_eq!(
            shape(below.as_bytes(), &cap),
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
        } = shape(
            body.as_bytes(),
            &Rewrite {
                model: Some("small"),
                ..Rewrite::default()
            },
        )
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
        let cap = Rewrite {
            cap: Some(10),
            ..Rewrite::default()
        };
        assert_eq!(shape(b"{not json", &cap), Shaped::NotJson);
        assert_eq!(shape(b"[1,2]", &cap), Shaped::NotJson);
    }

    #[test]
    fn priority_is_written_replaced_or_stripped_never_trusted() {
        let set = |p| Rewrite {
            priority: Priority::Set(p),
            ..Rewrite::default()
        };
        let v = rewritten_with(r#"{"model":"m"}"#, &set(0));
        assert_eq!(v["priority"], 0);
        let v = rewritten_with(r#"{"model":"m","priority":-100}"#, &set(2));
        assert_eq!(v["priority"], 2, "a client's own priority is replaced");
        let same = r#"{"model":"m","priority":1}"#;
        assert!(matches!(
            shape(same.as_bytes(), &set(1)),
            Shaped::Unchanged(_)
        ));
        let strip = Rewrite {
            priority: Priority::Strip,
            ..Rewrite::default()
        };
        let v = rewritten_with(r#"{"model":"m","priority":-100}"#, &strip);
        assert!(v.get("priority").is_none());
        assert!(matches!(
            shape(br#"{"model":"m"}"#, &strip),
            Shaped::Unchanged(_)
        ));
        assert!(facts(same.as_bytes()).unwrap().has_priority);
        assert!(!strip.any(facts(br#"{"model":"m"}"#).as_ref()));
        assert!(strip.any(facts(same.as_bytes()).as_ref()));
    }

    fn rewritten_with(body: &str, rw: &Rewrite<'_>) -> Value {
        match shape(body.as_bytes(), rw) {
            Shaped::Rewritten { body, .. } => serde_json::from_slice(&body).unwrap(),
            other => panic!("expected a rewrite, got {other:?}"),
        }
    }

    /// Prompts that share their first bytes share a key; the key ignores what follows them.
    #[test]
    fn prompt_heads_key_their_replica() {
        let system = "You are a support agent. ".repeat(200);
        let chat = |user: &str| {
            serde_json::json!({"model": "m", "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user}]})
            .to_string()
        };
        let a = facts(chat("first question").as_bytes()).unwrap().prefix;
        let b = facts(chat("another one").as_bytes()).unwrap().prefix;
        assert!(a.is_some());
        assert_eq!(a, b, "the shared system prompt fills the head");
        let short = |user: &str| {
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": user}]})
                .to_string()
        };
        let c = facts(short("hello").as_bytes()).unwrap().prefix;
        let d = facts(short("goodbye").as_bytes()).unwrap().prefix;
        assert_ne!(c, d);
        // Parts and plain strings hash alike, and the prompt of a completion counts.
        let parts = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hello"}]}]}"#;
        assert_eq!(facts(parts.as_bytes()).unwrap().prefix, c);
        let prompt = facts(br#"{"prompt":"hello"}"#).unwrap().prefix;
        assert!(prompt.is_some());
        assert_eq!(facts(br#"{"model":"m"}"#).unwrap().prefix, None);
    }

    /// A prompt is counted by its text (four bytes a token) plus the chat template's few tokens
    /// a message, not by the JSON around it; tool definitions count, as they are rendered into
    /// the prompt; both readers agree.
    #[test]
    fn prompt_tokens_count_the_text_not_the_json() {
        let text = "abcd".repeat(200);
        let body = serde_json::json!({"model": "m", "max_tokens": 40, "messages": [
            {"role": "user", "content": text}]});
        let raw = body.to_string();
        let tokens = |b: &str| {
            let streamed = facts(b.as_bytes()).unwrap().prompt_tokens;
            let parsed = match serde_json::from_str(b).unwrap() {
                Value::Object(o) => facts_of(&o).prompt_tokens,
                _ => unreachable!(),
            };
            assert_eq!(streamed, parsed, "{b}");
            streamed
        };
        // 800 bytes of content and 4 of role: 201 tokens and 4 of template.
        assert_eq!(tokens(&raw), Some(205));
        assert!(raw.len() / 4 > 215, "the body's bytes over-count it");
        // Escapes in the JSON are not the text's.
        let quoted =
            serde_json::json!({"messages": [{"role": "user", "content": "\"".repeat(400)}]});
        assert_eq!(tokens(&quoted.to_string()), Some(101 + 4));
        let tools = serde_json::json!({"messages": [{"role": "user", "content": "abcd"}],
            "tools": [{"type": "function", "function": {"name": "lookup"}}]});
        assert!(tokens(&tools.to_string()).unwrap() > 2 + 4);
        assert_eq!(tokens(r#"{"prompt":[1,2,3]}"#), Some(3));
        assert_eq!(tokens(r#"{"prompt":"abcdabcd"}"#), Some(2));
        assert_eq!(
            tokens(r#"{"model":"m"}"#),
            None,
            "no prompt: the body's size stands"
        );
    }
}
