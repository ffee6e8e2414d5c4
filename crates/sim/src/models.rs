//! The models one replica serves: its base models and the LoRA adapters loaded on the first of
//! them, at start (`--lora`) or at runtime through vLLM's `/v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, with vLLM's answers and error messages.
//!
//! A request naming an adapter is served as its base model would be; only its name (in the
//! response, and in the prefix cache's block hashes, as vLLM keys blocks by adapter) differs.

use std::sync::{PoisonError, RwLock};

use serde_json::{json, Value};

use super::api::ApiError;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Adapter {
    name: String,
    /// vLLM's `lora_path`, listed as the adapter's `root`.
    path: String,
}

#[derive(Debug)]
pub(crate) struct Models {
    bases: Vec<String>,
    adapters: RwLock<Vec<Adapter>>,
}

impl Models {
    /// `loras` are `NAME` or `NAME=PATH` (vLLM's `--lora-modules` form); without a path the
    /// name stands in for it.
    pub(crate) fn new(bases: Vec<String>, loras: &[String]) -> Result<Self, String> {
        if bases.is_empty() {
            return Err("at least one --model is required".into());
        }
        let models = Self {
            bases,
            adapters: RwLock::new(Vec::new()),
        };
        for spec in loras.iter().map(|l| l.trim()).filter(|l| !l.is_empty()) {
            let (name, path) = spec.split_once('=').unwrap_or((spec, spec));
            models
                .load(&json!({"lora_name": name.trim(), "lora_path": path.trim()}))
                .map_err(|e| format!("--lora {spec}: {}", e.message))?;
        }
        Ok(models)
    }

    pub(crate) fn default_model(&self) -> &str {
        self.bases.first().map_or("", String::as_str)
    }

    /// Every name a request may use: base models, then adapters in load order.
    pub(crate) fn served(&self) -> Vec<String> {
        let adapters = self.adapters.read().unwrap_or_else(PoisonError::into_inner);
        self.bases
            .iter()
            .cloned()
            .chain(adapters.iter().map(|a| a.name.clone()))
            .collect()
    }

    /// `/v1/models`' entries: vLLM gives adapters their path as `root`, their base model as
    /// `parent`, and no `max_model_len`.
    pub(crate) fn cards(&self, created: u64, max_model_len: u64) -> Vec<Value> {
        let card = |id: &str, root: &str, parent: Option<&str>, len: Option<u64>| {
            json!({
                "id": id,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": len,
            })
        };
        let adapters = self.adapters.read().unwrap_or_else(PoisonError::into_inner);
        self.bases
            .iter()
            .map(|m| card(m, m, None, Some(max_model_len)))
            .chain(
                adapters
                    .iter()
                    .map(|a| card(&a.name, &a.path, Some(self.default_model()), None)),
            )
            .collect()
    }

    /// `{"lora_name": .., "lora_path": ..}`; the text vLLM answers with on success.
    pub(crate) fn load(&self, body: &Value) -> Result<String, ApiError> {
        let name = string_field(body, "lora_name")?.unwrap_or_default();
        let path = string_field(body, "lora_path")?.unwrap_or_default();
        if name.is_empty() || path.is_empty() {
            return Err(ApiError::invalid_input(
                400,
                "Both 'lora_name' and 'lora_path' must be provided.",
            ));
        }
        let mut adapters = self
            .adapters
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if adapters.iter().any(|a| a.name == name) {
            return Err(ApiError::invalid_input(
                400,
                format!("The lora adapter '{name}' has already been loaded."),
            ));
        }
        adapters.push(Adapter {
            name: name.clone(),
            path,
        });
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// `{"lora_name": ..}`; requests already running on the adapter finish normally.
    pub(crate) fn unload(&self, body: &Value) -> Result<String, ApiError> {
        let name = string_field(body, "lora_name")?;
        let has_id = body.get("lora_int_id").is_some_and(|v| !v.is_null());
        let Some(name) = name.filter(|n| !n.is_empty()).or_else(|| {
            // vLLM then looks the adapter up by a name of None, and finds nothing.
            has_id.then(|| "None".to_string())
        }) else {
            return Err(ApiError::invalid_input(
                400,
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
            ));
        };
        let mut adapters = self
            .adapters
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let before = adapters.len();
        adapters.retain(|a| a.name != name);
        if adapters.len() == before {
            return Err(ApiError::not_found(format!(
                "The lora adapter '{name}' cannot be found."
            )));
        }
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }
}

fn string_field(body: &Value, key: &str) -> Result<Option<String>, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request("Request body must be a JSON object"));
    }
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(format!(
            "{key}: Input should be a valid string"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Models {
        Models::new(vec!["base".into(), "other".into()], &["sql=/ad/sql".into()]).unwrap()
    }

    #[test]
    fn static_and_runtime_adapters_are_served_and_listed() {
        let m = models();
        assert_eq!(m.served(), ["base", "other", "sql"]);
        assert_eq!(
            m.load(&json!({"lora_name": "chat", "lora_path": "/ad/chat"})),
            Ok("Success: LoRA adapter 'chat' added successfully.".into())
        );
        assert_eq!(m.served(), ["base", "other", "sql", "chat"]);
        let cards = m.cards(7, 4096);
        assert_eq!(cards[0]["root"], "base");
        assert_eq!(cards[0]["parent"], Value::Null);
        assert_eq!(cards[0]["max_model_len"], 4096);
        assert_eq!(
            cards[3],
            json!({"id": "chat", "object": "model", "created": 7, "owned_by": "vllm",
                   "root": "/ad/chat", "parent": "base", "max_model_len": null})
        );
        assert_eq!(
            m.unload(&json!({"lora_name": "sql"})),
            Ok("Success: LoRA adapter 'sql' removed successfully.".into())
        );
        assert_eq!(m.served(), ["base", "other", "chat"]);
        // Without a path, a static adapter's name is its root.
        let bare = Models::new(vec!["base".into()], &["a".into(), " ".into()]).unwrap();
        assert_eq!(bare.cards(0, 1)[1]["root"], "a");
    }

    #[test]
    fn vllm_errors() {
        let m = models();
        let err = |r: Result<String, ApiError>| {
            let e = r.unwrap_err();
            (e.status, e.kind, e.message)
        };
        assert_eq!(
            err(m.load(&json!({"lora_name": "sql", "lora_path": "/x"}))),
            (
                400,
                "InvalidUserInput",
                "The lora adapter 'sql' has already been loaded.".into()
            )
        );
        assert_eq!(
            err(m.load(&json!({"lora_name": "x", "lora_path": ""}))),
            (
                400,
                "InvalidUserInput",
                "Both 'lora_name' and 'lora_path' must be provided.".into()
            )
        );
        assert_eq!(err(m.load(&json!({"lora_name": 3}))).0, 400);
        assert_eq!(err(m.load(&json!([]))).0, 400);
        assert_eq!(
            err(m.unload(&json!({"lora_name": "nope"}))),
            (
                404,
                "NotFoundError",
                "The lora adapter 'nope' cannot be found.".into()
            )
        );
        assert_eq!(
            err(m.unload(&json!({}))),
            (
                400,
                "InvalidUserInput",
                "either 'lora_name' and 'lora_int_id' needs to be provided.".into()
            )
        );
        assert_eq!(err(m.unload(&json!({"lora_int_id": 1}))).0, 404);
        assert_eq!(m.served(), ["base", "other", "sql"]);
        assert!(Models::new(vec!["b".into()], &["a".into(), "a=/p".into()]).is_err());
        assert!(Models::new(vec![], &[]).is_err());
    }
}
