//! Attribute and span names: OpenTelemetry's semantic conventions for GenAI, HTTP and errors
//! (the GenAI ones are at Development stability in the conventions; spellings as of v1.37+),
//! and Sluice's own `sluice.*` attributes.
//!
//! Span names follow the GenAI inference convention, `{gen_ai.operation.name}
//! {gen_ai.request.model}` ([`span_name`]): `chat llama-3-70b`, `text_completion llama-3-8b`.

/// An attribute name (the same type as `span::Key`, named here so the names need no span).
type Key = &'static str;

// GenAI (https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/)
/// `chat`, `text_completion`, `embeddings` ([`operation_for_path`]).
pub const GEN_AI_OPERATION_NAME: Key = "gen_ai.operation.name";
/// Who serves the model; a custom value (such as `vllm`) is allowed where no well-known one fits.
pub const GEN_AI_PROVIDER_NAME: Key = "gen_ai.provider.name";
pub const GEN_AI_REQUEST_MODEL: Key = "gen_ai.request.model";
pub const GEN_AI_RESPONSE_MODEL: Key = "gen_ai.response.model";
pub const GEN_AI_REQUEST_MAX_TOKENS: Key = "gen_ai.request.max_tokens";
pub const GEN_AI_REQUEST_STREAM: Key = "gen_ai.request.stream";
pub const GEN_AI_USAGE_INPUT_TOKENS: Key = "gen_ai.usage.input_tokens";
pub const GEN_AI_USAGE_OUTPUT_TOKENS: Key = "gen_ai.usage.output_tokens";
/// A string array: one finish reason per choice.
pub const GEN_AI_RESPONSE_FINISH_REASONS: Key = "gen_ai.response.finish_reasons";
pub const GEN_AI_RESPONSE_ID: Key = "gen_ai.response.id";

/// The `gen_ai.operation.name` values Sluice's routes map to.
pub const OP_CHAT: &str = "chat";
pub const OP_TEXT_COMPLETION: &str = "text_completion";
pub const OP_EMBEDDINGS: &str = "embeddings";

// Server, HTTP and errors
pub const SERVER_ADDRESS: Key = "server.address";
pub const SERVER_PORT: Key = "server.port";
/// A low-cardinality failure class (`timeout`, `500`, `_OTHER`); set with the ERROR status.
pub const ERROR_TYPE: Key = "error.type";
pub const HTTP_REQUEST_METHOD: Key = "http.request.method";
pub const HTTP_RESPONSE_STATUS_CODE: Key = "http.response.status_code";
pub const HTTP_ROUTE: Key = "http.route";
pub const URL_PATH: Key = "url.path";

// Sluice's own
pub const SLUICE_TENANT: Key = "sluice.tenant";
pub const SLUICE_TIER: Key = "sluice.tier";
/// `pass`, `degrade`, `queue`, `fallback`, `reject`.
pub const SLUICE_DECISION: Key = "sluice.decision";
/// The decision's reason code.
pub const SLUICE_REASON: Key = "sluice.reason";
pub const SLUICE_POOL: Key = "sluice.pool";
/// Time waited in Sluice's queue for a slot, in milliseconds (a double).
pub const SLUICE_QUEUE_WAIT_MS: Key = "sluice.queue_wait_ms";
/// The pool's admission level when decided.
pub const SLUICE_LEVEL: Key = "sluice.level";
pub const SLUICE_MAX_TOKENS_REQUESTED: Key = "sluice.max_tokens.requested";
pub const SLUICE_MAX_TOKENS_APPLIED: Key = "sluice.max_tokens.applied";
/// The model the request was sent to vLLM with: the one it named, or the fallback's when the
/// decision moved it.
pub const SLUICE_MODEL_ROUTED: Key = "sluice.model.routed";
/// Which upstream attempt a CLIENT span is, from 1.
pub const SLUICE_ATTEMPT: Key = "sluice.attempt";
/// The request's id (`x-request-id`, the decision record's `request_id`).
pub const SLUICE_REQUEST_ID: Key = "sluice.request_id";
/// How a queue wait ended (`released`, or the refusal's reason), on [`EVENT_QUEUE_LEFT`].
pub const SLUICE_QUEUE_OUTCOME: Key = "sluice.queue.outcome";

/// `gen_ai.provider.name` of the fleet Sluice fronts (a custom value, as the conventions allow).
pub const PROVIDER_VLLM: &str = "vllm";

// Events
/// On the SERVER span: the request left Sluice's queue (admitted, or refused after waiting).
pub const EVENT_QUEUE_LEFT: &str = "sluice.queue.left";
/// On the SERVER span: a streamed answer's first token went to the client.
pub const EVENT_FIRST_TOKEN: &str = "sluice.first_token";

/// Resource attribute naming the service.
pub const SERVICE_NAME: &str = "service.name";
pub const SERVICE_VERSION: &str = "service.version";

/// The GenAI operation of an OpenAI-compatible path, `None` for any other.
pub fn operation_for_path(path: &str) -> Option<&'static str> {
    match path.trim_end_matches('/') {
        "/v1/chat/completions" => Some(OP_CHAT),
        "/v1/completions" => Some(OP_TEXT_COMPLETION),
        "/v1/embeddings" => Some(OP_EMBEDDINGS),
        _ => None,
    }
}

/// `{operation} {model}`, or the operation alone when the model is unknown.
pub fn span_name(operation: &str, model: &str) -> String {
    if model.is_empty() {
        operation.to_string()
    } else {
        // Not `format!`: its machinery cost more than the copy, twice a traced request.
        let mut name = String::with_capacity(operation.len() + 1 + model.len());
        name.push_str(operation);
        name.push(' ');
        name.push_str(model);
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_name_their_operation() {
        assert_eq!(operation_for_path("/v1/chat/completions"), Some("chat"));
        assert_eq!(
            operation_for_path("/v1/completions/"),
            Some("text_completion")
        );
        assert_eq!(operation_for_path("/v1/models"), None);
        assert_eq!(span_name(OP_CHAT, "llama-3-70b"), "chat llama-3-70b");
        assert_eq!(span_name(OP_TEXT_COMPLETION, ""), "text_completion");
    }
}
