//! A prompt as the simulator's stand-in for tokens.
//!
//! There is no tokenizer here, but vLLM's prefix cache only needs identical prompt heads to give
//! identical tokens. A token is four characters of the prompt's text (the count the simulator has
//! always used), the text being the messages' contents in order. A chat template puts role markers
//! between messages, so where each message starts and with which role belong to the tokens too:
//! the same words as a system prompt and as a user turn do not share cache.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::Value;

/// Characters per simulated token.
const CHARS_PER_TOKEN: usize = 4;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Prompt {
    chars: Vec<char>,
    /// Where each message (or each item of a batched completion prompt) starts, and its role.
    starts: Vec<(usize, String)>,
}

impl Prompt {
    /// A chat request's messages; text parts of multi-part contents are joined, other parts
    /// (images) add nothing.
    pub(crate) fn from_messages(msgs: &[Value]) -> Self {
        let mut p = Self::default();
        for msg in msgs {
            let role = msg.get("role").and_then(Value::as_str).unwrap_or("");
            p.starts.push((p.chars.len(), role.to_string()));
            match msg.get("content") {
                Some(Value::String(s)) => p.chars.extend(s.chars()),
                Some(Value::Array(parts)) => {
                    for text in parts
                        .iter()
                        .filter_map(|part| part.get("text").and_then(Value::as_str))
                    {
                        p.chars.extend(text.chars());
                    }
                }
                _ => {}
            }
        }
        p
    }

    /// A completion request's `prompt`: a string, token ids, or a list of either.
    pub(crate) fn from_completion(prompt: &Value) -> Self {
        let mut p = Self::default();
        p.push_completion(prompt);
        p
    }

    fn push_completion(&mut self, v: &Value) {
        match v {
            Value::String(s) => {
                self.starts.push((self.chars.len(), String::new()));
                self.chars.extend(s.chars());
            }
            // A token id already is one token: its four bytes become its four characters, so
            // the same ids give the same blocks and the count stays exact.
            Value::Number(n) => {
                let id = n.as_u64().unwrap_or(0) as u32;
                self.chars
                    .extend(id.to_be_bytes().into_iter().map(char::from));
            }
            Value::Array(items) => items.iter().for_each(|i| self.push_completion(i)),
            _ => {}
        }
    }

    pub(crate) fn chars(&self) -> u64 {
        self.chars.len() as u64
    }

    /// Roughly four characters per token, as for English text with a BPE tokenizer; an empty
    /// prompt still has one (vLLM always has a token to compute).
    pub(crate) fn tokens(&self) -> u64 {
        estimate_tokens(self.chars())
    }

    /// vLLM's block hashes of the prompt's full blocks: each hashes its parent's hash, its own
    /// tokens and `extra` (the model, as vLLM keys blocks by LoRA adapter), so two prompts share
    /// block `i` only when they agree on everything up to its end.
    pub(crate) fn block_hashes(&self, block_tokens: u64, extra: &str) -> Vec<u64> {
        let block_tokens = block_tokens.max(1);
        let full = self.tokens() / block_tokens;
        let block_chars = usize::try_from(block_tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(CHARS_PER_TOKEN);
        let mut parent = {
            let mut h = DefaultHasher::new();
            ("sluice-sim prefix", extra).hash(&mut h);
            h.finish()
        };
        let mut hashes = Vec::with_capacity(usize::try_from(full).unwrap_or(0));
        for i in 0..usize::try_from(full).unwrap_or(0) {
            let start = i.saturating_mul(block_chars).min(self.chars.len());
            let end = start.saturating_add(block_chars).min(self.chars.len());
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            self.chars[start..end].hash(&mut h);
            for (at, role) in self
                .starts
                .iter()
                .filter(|(at, _)| (start..end).contains(at))
            {
                (at - start, role).hash(&mut h);
            }
            parent = h.finish();
            hashes.push(parent);
        }
        hashes
    }
}

pub(crate) fn estimate_tokens(chars: u64) -> u64 {
    chars.div_ceil(CHARS_PER_TOKEN as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(system: &str, user: &str) -> Prompt {
        Prompt::from_messages(
            json!([{"role": "system", "content": system}, {"role": "user", "content": user}])
                .as_array()
                .unwrap(),
        )
    }

    #[test]
    fn counts_four_characters_a_token() {
        assert_eq!(estimate_tokens(0), 1);
        assert_eq!(estimate_tokens(4), 1);
        assert_eq!(estimate_tokens(5), 2);
        let p = Prompt::from_messages(
            json!([{"role": "user", "content": [{"type": "text", "text": "abcde"},
                                                {"type": "image_url"}]}])
            .as_array()
            .unwrap(),
        );
        assert_eq!((p.chars(), p.tokens()), (5, 2));
        let p = Prompt::from_completion(&json!(["abcdefgh", [1, 2]]));
        assert_eq!((p.chars(), p.tokens()), (16, 4));
    }

    #[test]
    fn only_a_shared_head_gives_equal_blocks() {
        let system = "s".repeat(64 * 3);
        let a = chat(&system, &"a".repeat(64)).block_hashes(16, "m");
        let b = chat(&system, &"b".repeat(64)).block_hashes(16, "m");
        assert_eq!((a.len(), b.len()), (4, 4));
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a[3], b[3]);

        // Same text in every block but the first: chaining makes every block differ.
        let c = chat(&format!("t{}", &system[1..]), &"a".repeat(64)).block_hashes(16, "m");
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));

        // Another model (or adapter) never shares, nor does the same text under another role.
        assert_ne!(chat(&system, "").block_hashes(16, "lora")[0], a[0]);
        let as_user = Prompt::from_messages(
            json!([{"role": "user", "content": system}])
                .as_array()
                .unwrap(),
        );
        assert_ne!(as_user.block_hashes(16, "m")[0], a[0]);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        // 60 characters are 15 tokens; 61 are 16, the last one short of characters.
        assert_eq!(chat(&"x".repeat(60), "").block_hashes(16, "m").len(), 0);
        assert_eq!(chat(&"x".repeat(61), "").block_hashes(16, "m").len(), 1);
        assert_eq!(chat(&"x".repeat(64), "").block_hashes(8, "m").len(), 2);
        // Token-id prompts: 32 ids are two blocks of 16, identical for identical ids.
        let ids: Vec<u32> = (0..32).collect();
        let p = Prompt::from_completion(&json!(ids)).block_hashes(16, "m");
        assert_eq!(p.len(), 2);
        assert_eq!(
            p,
            Prompt::from_completion(&json!(ids)).block_hashes(16, "m")
        );
    }
}
