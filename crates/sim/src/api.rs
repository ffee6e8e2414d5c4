//! The OpenAI-compatible wire format as vLLM speaks it: request parsing, response bodies,
//! server-sent-event framing and vLLM's error shape.
//!
//! Everything here is pure so the exact bytes a proxy sees can be tested without a socket.

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{json, Value};

use super::prompt::Prompt;

/// A test and benchmark hint: how long the answer would be if nothing capped it. A real vLLM
/// ignores unknown headers, so the same traffic can be replayed against one.
pub(crate) const OUTPUT_TOKENS_HEADER: &str = "x-sim-output-tokens";

/// Which OpenAI endpoint a request came in on; it decides the body shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub(crate) fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        }
    }
}

/// An error in vLLM's JSON shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

impl ApiError {
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: 404,
            kind: "NotFoundError",
            message: message.into(),
        }
    }

    /// vLLM's type for a well-formed request it will not act on (its LoRA endpoints use it).
    pub(crate) fn invalid_input(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            kind: "InvalidUserInput",
            message: message.into(),
        }
    }

    /// vLLM's refusal of a `priority` when the engine schedules first come, first served.
    pub(crate) fn priority_disabled(priority: i64) -> Self {
        Self::bad_request(format!(
            "Got priority {priority} but Priority scheduling is not enabled."
        ))
    }

    pub(crate) fn method_not_allowed() -> Self {
        Self {
            status: 405,
            kind: "MethodNotAllowed",
            message: "Method Not Allowed".into(),
        }
    }

    pub(crate) fn unavailable() -> Self {
        Self {
            status: 503,
            kind: "ServiceUnavailableError",
            message: "The engine is unhealthy.".into(),
        }
    }

    /// A server error of the given status (`PUT /admin/fail {"mode": "status"}`).
    pub(crate) fn status(status: u16) -> Self {
        Self {
            status,
            kind: "InternalServerError",
            message: format!("The simulator answers {status} (admin/fail)."),
        }
    }

    pub(crate) fn context_length(budget: u64, prompt: u64, completion: u64) -> Self {
        Self::bad_request(format!(
            "This model's maximum context length is {budget} tokens. However, you requested {} \
             tokens ({prompt} in the messages, {completion} in the completion). Please reduce the \
             length of the messages or completion.",
            prompt + completion
        ))
    }

    pub(crate) fn body(&self) -> Bytes {
        Bytes::from(
            json!({
                "object": "error",
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.status,
            })
            .to_string(),
        )
    }
}

/// What the simulator needs from a completion request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RequestSpec {
    pub model: String,
    /// The prompt's text, for the prefix cache's block hashes.
    pub prompt: Prompt,
    pub prompt_tokens: u64,
    /// The tokens the answer really has.
    pub completion_tokens: u64,
    /// The request's cap, or the default when it set none: what a reserving engine holds.
    pub max_tokens: u64,
    /// vLLM reports `length` when the cap was the client's and `stop` when generation ended on
    /// its own, which is how we model a request without a cap.
    pub finish_reason: &'static str,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `priority` body field: lower is served sooner; 0 when absent.
    pub priority: i64,
}

/// Reads the natural answer length from [`OUTPUT_TOKENS_HEADER`], if the client sent one.
pub(crate) fn output_tokens(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let mut values = headers.get_all(OUTPUT_TOKENS_HEADER).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let invalid = |why: &str| {
        ApiError::bad_request(format!(
            "{OUTPUT_TOKENS_HEADER}: {why}, got {:?}",
            String::from_utf8_lossy(first.as_bytes())
                .chars()
                .take(64)
                .collect::<String>()
        ))
    };
    if values.next().is_some() {
        return Err(invalid("the header must be sent once"));
    }
    let text = std::str::from_utf8(first.as_bytes()).unwrap_or("").trim();
    // Digits only: `u64::from_str` would also take a sign, which no client means to send.
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("Input should be a valid non-negative integer"));
    }
    text.parse::<u64>()
        .map(Some)
        .map_err(|_| invalid("Input should be a valid non-negative integer"))
}

/// Validates a parsed request body the way vLLM would and extracts its sizes; `output_tokens`
/// is the natural answer length from [`OUTPUT_TOKENS_HEADER`].
pub(crate) fn parse_request(
    endpoint: Endpoint,
    body: &Value,
    models: &[String],
    default_max_tokens: u64,
    output_tokens: Option<u64>,
) -> Result<RequestSpec, ApiError> {
    let obj = body
        .as_object()
        .ok_or_else(|| ApiError::bad_request("Request body must be a JSON object"))?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => models.first().cloned().unwrap_or_default(),
        Some(Value::String(m)) => m.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "model: Input should be a valid string",
            ))
        }
    };
    if !models.contains(&model) {
        return Err(ApiError::not_found(format!(
            "The model `{model}` does not exist."
        )));
    }
    let prompt = match endpoint {
        Endpoint::Chat => match obj.get("messages") {
            Some(Value::Array(msgs)) => Prompt::from_messages(msgs),
            _ => return Err(ApiError::bad_request("messages: Field required")),
        },
        Endpoint::Completions => match obj.get("prompt") {
            Some(p @ (Value::String(_) | Value::Array(_))) => Prompt::from_completion(p),
            _ => return Err(ApiError::bad_request("prompt: Field required")),
        },
    };
    let priority = priority(obj.get("priority"))?;
    let cap = match token_cap(obj.get("max_completion_tokens"), "max_completion_tokens")? {
        Some(c) => Some(c),
        None => token_cap(obj.get("max_tokens"), "max_tokens")?,
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::bad_request(
                "stream: Input should be a valid boolean",
            ))
        }
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let max_tokens = cap.unwrap_or(default_max_tokens).max(1);
    let (completion_tokens, finish_reason) = match output_tokens {
        // Without a hint the answer runs to the cap; only a client's own cap reads as `length`.
        None => (max_tokens, if cap.is_some() { "length" } else { "stop" }),
        // vLLM counts at least one generated token even when the first one ends the answer.
        Some(n) if n < max_tokens => (n.max(1), "stop"),
        Some(_) => (max_tokens, "length"),
    };
    Ok(RequestSpec {
        model,
        prompt_tokens: prompt.tokens(),
        prompt,
        completion_tokens,
        max_tokens,
        finish_reason,
        stream,
        include_usage,
        priority,
    })
}

/// vLLM declares `priority: int = 0`; an integral float passes its validation too.
fn priority(v: Option<&Value>) -> Result<i64, ApiError> {
    let invalid = || ApiError::bad_request("priority: Input should be a valid integer");
    match v {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Ok(i),
            (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(f as i64),
            _ => Err(invalid()),
        },
        Some(_) => Err(invalid()),
    }
}

fn token_cap(v: Option<&Value>, field: &str) -> Result<Option<u64>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let n = n.as_f64().unwrap_or(1.0);
            if n.fract() != 0.0 {
                return Err(ApiError::bad_request(format!(
                    "{field}: Input should be a valid integer"
                )));
            }
            // Clamped rather than rejected so the simulator stays usable with sloppy clients.
            Ok(Some(n.clamp(1.0, u32::MAX as f64) as u64))
        }
        Some(_) => Err(ApiError::bad_request(format!(
            "{field}: Input should be a valid integer"
        ))),
    }
}

/// Identity shared by every body of one response.
#[derive(Debug, Clone)]
pub(crate) struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

const FILLER: &str = "tok ";

/// vLLM's usage object; `cached`, with `--enable-prompt-tokens-details`: the prompt tokens its
/// prefix cache served, in `prompt_tokens_details`.
fn usage(prompt: u64, completion: u64, cached: Option<u64>) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    if let (Some(cached), Some(o)) = (cached, u.as_object_mut()) {
        o.insert(
            "prompt_tokens_details".into(),
            json!({ "cached_tokens": cached }),
        );
    }
    u
}

/// The body of a non-streaming response with `completion` filler tokens; `cached` as in
/// [`usage`].
pub(crate) fn completion_body(
    meta: &ResponseMeta,
    spec: &RequestSpec,
    cached: Option<u64>,
) -> Bytes {
    let text = FILLER.repeat(usize::try_from(spec.completion_tokens).unwrap_or(0));
    let (object, choice) = match meta.endpoint {
        Endpoint::Chat => (
            "chat.completion",
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": spec.finish_reason,
                "logprobs": null,
            }),
        ),
        Endpoint::Completions => (
            "text_completion",
            json!({
                "index": 0,
                "text": text,
                "finish_reason": spec.finish_reason,
                "logprobs": null,
            }),
        ),
    };
    Bytes::from(
        json!({
            "id": meta.id,
            "object": object,
            "created": meta.created,
            "model": meta.model,
            "choices": [choice],
            "usage": usage(spec.prompt_tokens, spec.completion_tokens, cached),
        })
        .to_string(),
    )
}

pub(crate) const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Every event of one stream, built once: all token chunks are byte-identical, so sending one is
/// a refcount bump, which keeps hundreds of concurrent streams cheap.
#[derive(Debug, Clone)]
pub(crate) struct SseFrames {
    /// Chat streams open with the assistant role; completions have no such chunk.
    pub role: Option<Bytes>,
    pub token: Bytes,
    pub finish: Bytes,
    pub usage: Option<UsageFrame>,
}

/// A stream's usage chunk, rendered at its end: the cached count is known only once the request
/// is admitted, after the frames were built.
#[derive(Debug, Clone)]
pub(crate) struct UsageFrame {
    chunk: Value,
    prompt: u64,
    completion: u64,
}

impl UsageFrame {
    pub(crate) fn render(&self, cached: Option<u64>) -> Bytes {
        let mut v = self.chunk.clone();
        if let Some(obj) = v.as_object_mut() {
            obj.insert("usage".into(), usage(self.prompt, self.completion, cached));
        }
        sse(&v)
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub(crate) fn sse_frames(meta: &ResponseMeta, spec: &RequestSpec) -> SseFrames {
    let object = match meta.endpoint {
        Endpoint::Chat => "chat.completion.chunk",
        Endpoint::Completions => "text_completion",
    };
    let chunk = |choices: Value| {
        json!({
            "id": meta.id,
            "object": object,
            "created": meta.created,
            "model": meta.model,
            "choices": choices,
        })
    };
    let choice = |content: &str, finish: Option<&str>| match meta.endpoint {
        Endpoint::Chat => json!([{
            "index": 0,
            "delta": {"content": content},
            "logprobs": null,
            "finish_reason": finish,
        }]),
        Endpoint::Completions => json!([{
            "index": 0,
            "text": content,
            "logprobs": null,
            "finish_reason": finish,
        }]),
    };
    let role = match meta.endpoint {
        Endpoint::Chat => Some(sse(&chunk(json!([{
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }])))),
        Endpoint::Completions => None,
    };
    let usage = spec.include_usage.then(|| UsageFrame {
        chunk: chunk(json!([])),
        prompt: spec.prompt_tokens,
        completion: spec.completion_tokens,
    });
    SseFrames {
        role,
        token: sse(&chunk(choice(FILLER, None))),
        finish: sse(&chunk(choice("", Some(spec.finish_reason)))),
        usage,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["m1".into(), "m2".into()]
    }

    fn parse(endpoint: Endpoint, body: Value) -> Result<RequestSpec, ApiError> {
        parse_request(endpoint, &body, &models(), 128, None)
    }

    fn hinted(body: Value, output_tokens: u64) -> RequestSpec {
        parse_request(Endpoint::Chat, &body, &models(), 128, Some(output_tokens)).unwrap()
    }

    #[test]
    fn prompt_token_estimate() {
        let s = parse(
            Endpoint::Chat,
            json!({"messages": [
                {"role": "system", "content": "abcd"},
                {"role": "user", "content": [{"type": "text", "text": "efghi"}]},
            ]}),
        )
        .unwrap();
        assert_eq!(s.prompt_tokens, 3);
        let s = parse(Endpoint::Completions, json!({"prompt": ["abcdefgh", "ij"]})).unwrap();
        assert_eq!(s.prompt_tokens, 3);
    }

    #[test]
    fn priority_is_an_integer_field() {
        let priority = |v: Value| parse(Endpoint::Chat, json!({"messages": [], "priority": v}));
        assert_eq!(
            parse(Endpoint::Chat, json!({"messages": []}))
                .unwrap()
                .priority,
            0
        );
        assert_eq!(priority(json!(null)).unwrap().priority, 0);
        assert_eq!(priority(json!(-3)).unwrap().priority, -3);
        assert_eq!(priority(json!(2.0)).unwrap().priority, 2);
        for bad in [json!(1.5), json!("1"), json!(true), json!([1])] {
            let e = priority(bad.clone()).unwrap_err();
            assert_eq!(
                (e.status, e.message.as_str()),
                (400, "priority: Input should be a valid integer"),
                "{bad}"
            );
        }
        let body: Value = serde_json::from_slice(&ApiError::priority_disabled(5).body()).unwrap();
        assert_eq!(
            body,
            json!({"object": "error",
                   "message": "Got priority 5 but Priority scheduling is not enabled.",
                   "type": "BadRequestError", "param": null, "code": 400})
        );
    }

    #[test]
    fn completion_length_from_caps() {
        let s = parse(Endpoint::Chat, json!({"messages": [], "max_tokens": 7})).unwrap();
        assert_eq!((s.completion_tokens, s.finish_reason), (7, "length"));
        let s = parse(
            Endpoint::Chat,
            json!({"messages": [], "max_tokens": 7, "max_completion_tokens": 9}),
        )
        .unwrap();
        assert_eq!(s.completion_tokens, 9);
        let s = parse(Endpoint::Chat, json!({"messages": [], "max_tokens": 0})).unwrap();
        assert_eq!(s.completion_tokens, 1);
        let s = parse(Endpoint::Chat, json!({"messages": [], "max_tokens": null})).unwrap();
        assert_eq!((s.completion_tokens, s.finish_reason), (128, "stop"));
        assert_eq!(s.model, "m1");
        assert_eq!(s.max_tokens, 128);
        assert_eq!(
            parse(Endpoint::Chat, json!({"messages": [], "max_tokens": "x"}))
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn model_and_shape_errors() {
        let e = parse(Endpoint::Chat, json!({"model": "nope", "messages": []})).unwrap_err();
        assert_eq!(e.status, 404);
        let body: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(
            body,
            json!({"object": "error", "message": "The model `nope` does not exist.",
                   "type": "NotFoundError", "param": null, "code": 404})
        );
        assert_eq!(
            parse(Endpoint::Chat, json!({"model": "m2", "messages": []}))
                .unwrap()
                .model,
            "m2"
        );
        assert_eq!(
            parse(Endpoint::Chat, json!({"prompt": "x"}))
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            parse(Endpoint::Completions, json!([1])).unwrap_err().status,
            400
        );
    }

    #[test]
    fn output_tokens_hint_caps_the_answer() {
        let capped = json!({"messages": [], "max_tokens": 100});
        let s = hinted(capped.clone(), 5);
        assert_eq!(
            (s.completion_tokens, s.max_tokens, s.finish_reason),
            (5, 100, "stop")
        );
        // An answer as long as the cap or longer is cut by it.
        for n in [100, 500] {
            let s = hinted(capped.clone(), n);
            assert_eq!((s.completion_tokens, s.finish_reason), (100, "length"));
        }
        // Without a cap the default is the cap.
        let s = hinted(json!({"messages": []}), 5);
        assert_eq!(
            (s.completion_tokens, s.max_tokens, s.finish_reason),
            (5, 128, "stop")
        );
        let s = hinted(json!({"messages": []}), 200);
        assert_eq!((s.completion_tokens, s.finish_reason), (128, "length"));
        let s = hinted(capped, 0);
        assert_eq!((s.completion_tokens, s.finish_reason), (1, "stop"));

        // Usage and the finish chunk carry the real length, streamed or not.
        let s = hinted(
            json!({"messages": [], "max_tokens": 100, "stream": true,
                   "stream_options": {"include_usage": true}}),
            5,
        );
        let v: Value =
            serde_json::from_slice(&completion_body(&meta(Endpoint::Chat), &s, None)).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "tok ".repeat(5));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["completion_tokens"], 5);
        let f = sse_frames(&meta(Endpoint::Chat), &s);
        let finish: Value =
            serde_json::from_slice(f.finish.strip_prefix(b"data: ").unwrap()).unwrap();
        assert_eq!(finish["choices"][0]["finish_reason"], "stop");
        let usage = f.usage.unwrap();
        let plain: Value =
            serde_json::from_slice(usage.render(None).strip_prefix(b"data: ").unwrap()).unwrap();
        assert_eq!(plain["usage"]["completion_tokens"], 5);
        assert!(plain["usage"].get("prompt_tokens_details").is_none());
        let detailed: Value =
            serde_json::from_slice(usage.render(Some(32)).strip_prefix(b"data: ").unwrap())
                .unwrap();
        assert_eq!(
            detailed["usage"]["prompt_tokens_details"],
            json!({"cached_tokens": 32})
        );
    }

    #[test]
    fn output_tokens_header_parsing() {
        let headers = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(
                    OUTPUT_TOKENS_HEADER,
                    http::HeaderValue::from_bytes(v).unwrap(),
                );
            }
            h
        };
        assert_eq!(output_tokens(&headers(&[])), Ok(None));
        assert_eq!(output_tokens(&headers(&[b"5"])), Ok(Some(5)));
        assert_eq!(output_tokens(&headers(&[b" 007 "])), Ok(Some(7)));
        let bad: &[&[&[u8]]] = &[
            &[b""],
            &[b"-1"],
            &[b"+1"],
            &[b"1.5"],
            &[b"five"],
            &[b"99999999999999999999999"],
            &[b"\xff"],
            &[b"1", b"2"],
        ];
        for bad in bad {
            let e = output_tokens(&headers(bad)).unwrap_err();
            assert_eq!((e.status, e.kind), (400, "BadRequestError"), "{bad:?}");
            assert!(
                e.message.starts_with("x-sim-output-tokens: "),
                "{}",
                e.message
            );
        }
    }

    fn meta(endpoint: Endpoint) -> ResponseMeta {
        ResponseMeta {
            endpoint,
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m1".into(),
        }
    }

    #[test]
    fn non_stream_body_shape() {
        let spec = parse(Endpoint::Chat, json!({"messages": [], "max_tokens": 3})).unwrap();
        let v: Value =
            serde_json::from_slice(&completion_body(&meta(Endpoint::Chat), &spec, None)).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "tok tok tok ");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4})
        );
        let spec = parse(
            Endpoint::Completions,
            json!({"prompt": "x", "max_tokens": 2}),
        )
        .unwrap();
        let v: Value =
            serde_json::from_slice(&completion_body(&meta(Endpoint::Completions), &spec, None))
                .unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "tok tok ");
    }

    #[test]
    fn sse_framing() {
        let spec = parse(
            Endpoint::Chat,
            json!({"messages": [], "max_tokens": 2, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .unwrap();
        let f = sse_frames(&meta(Endpoint::Chat), &spec);
        let mut all = Vec::new();
        for b in [
            f.role.clone().unwrap(),
            f.token.clone(),
            f.token.clone(),
            f.finish.clone(),
            f.usage.clone().unwrap().render(None),
        ] {
            all.extend_from_slice(&b);
        }
        all.extend_from_slice(SSE_DONE);
        let text = String::from_utf8(all).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 6);
        let parsed: Vec<Value> = events[..5]
            .iter()
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        assert_eq!(parsed[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(parsed[1]["object"], "chat.completion.chunk");
        assert_eq!(parsed[1]["choices"][0]["delta"]["content"], "tok ");
        assert_eq!(parsed[3]["choices"][0]["finish_reason"], "length");
        assert_eq!(parsed[4]["choices"], json!([]));
        assert_eq!(parsed[4]["usage"]["completion_tokens"], 2);

        let spec = RequestSpec {
            include_usage: false,
            ..spec
        };
        assert!(sse_frames(&meta(Endpoint::Chat), &spec).usage.is_none());
        assert!(sse_frames(&meta(Endpoint::Completions), &spec)
            .role
            .is_none());
    }
}
