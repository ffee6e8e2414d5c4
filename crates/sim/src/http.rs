//! Request routing for the simulator's HTTP/1.1 server: the vLLM OpenAI endpoints, vLLM's LoRA
//! and prefix-cache endpoints, `/health`, `/metrics`, and the `/admin` switches tests use.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::admin::Failing;
use super::api::{self, ApiError, Endpoint, ResponseMeta};
use super::generate::{self, Job};
use super::metrics::Gauges;
use super::stats::Recent;
use super::SchedulingPolicy;
use super::Sim;

/// Far above any prompt a KV budget could hold; only guards memory against runaway clients.
const MAX_BODY: usize = 64 * 1024 * 1024;
/// A few events of slack so decode never waits on a reader that is merely a bit behind.
const STREAM_BUFFER: usize = 32;

const JSON: &str = "application/json";
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const X_SIM_MODEL: HeaderName = HeaderName::from_static("x-sim-model");
const X_TENANT_ID: HeaderName = HeaderName::from_static("x-tenant-id");
/// How long a non-streamed request waited for admission, in milliseconds; tests read scheduling
/// order from it. A streamed response's headers leave before admission, so it has none.
const X_SIM_QUEUE_MS: HeaderName = HeaderName::from_static("x-sim-queue-ms");
/// Prompt tokens of a non-streamed request that the prefix cache served.
const X_SIM_CACHED_TOKENS: HeaderName = HeaderName::from_static("x-sim-cached-tokens");

/// One client connection: set when the simulator resets it (`PUT /admin/fail`), so it is closed
/// with an RST rather than a FIN once hyper lets go of it.
#[derive(Default)]
pub(crate) struct Conn {
    pub reset: AtomicBool,
}

/// The error that makes hyper drop a connection without (the rest of) a response: the
/// simulator resetting it on purpose.
#[derive(Debug)]
pub(crate) struct Reset;

impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection reset by the simulator (admin/fail)")
    }
}

impl std::error::Error for Reset {}

/// A response body that is either complete up front or fed event by event from a generator
/// task, each event becoming its own chunk on the wire as soon as it is produced; or such a
/// stream that is cut, its connection closed mid-body, after some events.
pub(crate) enum SimBody {
    Full(Option<Bytes>),
    Channel(mpsc::Receiver<Bytes>),
    Cut {
        rx: mpsc::Receiver<Bytes>,
        left: u32,
        /// Started after the last event, so hyper flushes the events before the cut.
        pause: Option<Pin<Box<tokio::time::Sleep>>>,
    },
}

/// How long a cut stream's last events have to leave before its connection is closed.
const CUT_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

impl Body for SimBody {
    type Data = Bytes;
    type Error = Reset;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Reset>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Channel(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
            SimBody::Cut { left: 0, pause, .. } => {
                let pause = pause.get_or_insert_with(|| Box::pin(tokio::time::sleep(CUT_PAUSE)));
                match pause.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Reset))),
                    Poll::Pending => Poll::Pending,
                }
            }
            SimBody::Cut { rx, left, .. } => rx.poll_recv(cx).map(|b| {
                b.map(|b| {
                    *left -= 1;
                    Ok(Frame::data(b))
                })
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, SimBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            SimBody::Channel(_) | SimBody::Cut { .. } => SizeHint::default(),
        }
    }
}

fn respond(
    status: StatusCode,
    content_type: Option<&'static str>,
    body: Bytes,
) -> Response<SimBody> {
    let body = if body.is_empty() { None } else { Some(body) };
    let mut resp = Response::new(SimBody::Full(body));
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    resp
}

fn json_response(status: StatusCode, v: &Value) -> Response<SimBody> {
    respond(status, Some(JSON), Bytes::from(v.to_string()))
}

fn error_response(e: &ApiError) -> Response<SimBody> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    respond(status, Some(JSON), e.body())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Completion(Endpoint),
    Models,
    LoadLora,
    UnloadLora,
    ResetPrefixCache,
    Health,
    Metrics,
    AdminHealth,
    AdminLatency,
    AdminKv,
    AdminFail,
    AdminStats,
    AdminReset,
}

impl Route {
    fn from_path(path: &str) -> Option<Self> {
        Some(match path {
            "/v1/chat/completions" => Route::Completion(Endpoint::Chat),
            "/v1/completions" => Route::Completion(Endpoint::Completions),
            "/v1/models" => Route::Models,
            "/v1/load_lora_adapter" => Route::LoadLora,
            "/v1/unload_lora_adapter" => Route::UnloadLora,
            "/reset_prefix_cache" => Route::ResetPrefixCache,
            "/health" => Route::Health,
            "/metrics" => Route::Metrics,
            "/admin/health" => Route::AdminHealth,
            "/admin/latency" => Route::AdminLatency,
            "/admin/kv" => Route::AdminKv,
            "/admin/fail" => Route::AdminFail,
            "/admin/stats" => Route::AdminStats,
            "/admin/reset" => Route::AdminReset,
            _ => return None,
        })
    }

    fn allows(self, m: &Method) -> bool {
        match self {
            Route::Completion(_)
            | Route::LoadLora
            | Route::UnloadLora
            | Route::ResetPrefixCache
            | Route::AdminReset => m == Method::POST,
            Route::Models | Route::Health | Route::Metrics | Route::AdminStats => {
                m == Method::GET || m == Method::HEAD
            }
            Route::AdminHealth | Route::AdminLatency | Route::AdminKv | Route::AdminFail => {
                m == Method::PUT || m == Method::POST
            }
        }
    }
}

/// The hyper service: every problem becomes an HTTP error response; it fails only to reset the
/// connection on purpose (`PUT /admin/fail {"mode": "reset"}`).
pub(crate) async fn handle(
    sim: Arc<Sim>,
    conn: Arc<Conn>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, Reset> {
    let Some(route) = Route::from_path(req.uri().path()) else {
        return Ok(error_response(&ApiError::not_found("Not Found")));
    };
    if !route.allows(req.method()) {
        return Ok(error_response(&ApiError::method_not_allowed()));
    }
    Ok(match route {
        Route::Completion(endpoint) => completion(sim, conn, req, endpoint).await?,
        Route::Models => models(&sim),
        Route::LoadLora | Route::UnloadLora => lora(&sim, req, route).await,
        Route::ResetPrefixCache => {
            // vLLM answers 200 whether or not blocks in use kept it from resetting.
            if !sim.engine.reset_prefix_cache() {
                log::warn!("sluice sim: prefix cache not reset, blocks are in use");
            }
            respond(StatusCode::OK, None, Bytes::new())
        }
        Route::Health => {
            if sim.admin.healthy() {
                respond(StatusCode::OK, None, Bytes::new())
            } else {
                respond(StatusCode::SERVICE_UNAVAILABLE, None, Bytes::new())
            }
        }
        Route::Metrics => metrics(&sim),
        Route::AdminHealth | Route::AdminLatency | Route::AdminKv | Route::AdminFail => {
            admin_switch(&sim, req, route).await
        }
        Route::AdminStats => json_response(StatusCode::OK, &stats(&sim)),
        Route::AdminReset => {
            sim.stats.reset();
            sim.engine.reset_peaks();
            json_response(StatusCode::OK, &stats(&sim))
        }
    })
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| ApiError::bad_request(format!("Could not read request body: {e}")))
}

fn header_string(req: &Request<Incoming>, name: impl http::header::AsHeaderName) -> Option<String> {
    req.headers()
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

async fn completion(
    sim: Arc<Sim>,
    conn: Arc<Conn>,
    req: Request<Incoming>,
    endpoint: Endpoint,
) -> Result<Response<SimBody>, Reset> {
    let arrived = Instant::now();
    let request_id = req.headers().get(X_REQUEST_ID).cloned();
    let id_text = request_id
        .as_ref()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let mut resp = completion_inner(sim, conn, req, endpoint, arrived, id_text).await?;
    if let Some(id) = request_id {
        resp.headers_mut().insert(X_REQUEST_ID, id);
    }
    Ok(resp)
}

async fn completion_inner(
    sim: Arc<Sim>,
    conn: Arc<Conn>,
    req: Request<Incoming>,
    endpoint: Endpoint,
    arrived: Instant,
    request_id: Option<String>,
) -> Result<Response<SimBody>, Reset> {
    let path = req.uri().path().to_string();
    let content_length = header_string(&req, CONTENT_LENGTH);
    let tenant = header_string(&req, X_TENANT_ID);
    let trace_context = (
        header_string(&req, "traceparent"),
        header_string(&req, "tracestate"),
    );
    let output_tokens = api::output_tokens(req.headers());
    let body = read_body(req).await;
    let parsed = body
        .as_ref()
        .ok()
        .map(|b| serde_json::from_slice::<Value>(b));
    let value = parsed.as_ref().and_then(|p| p.as_ref().ok());
    let model = value.map(|v| match v.get("model").and_then(Value::as_str) {
        Some(m) => m.to_string(),
        None => sim.models.default_model().to_string(),
    });
    let mut recent = Recent::new(&path, value, content_length, tenant);
    recent.body_bytes = body.as_ref().map_or(0, |b| b.len());
    (recent.traceparent, recent.tracestate) = trace_context;
    sim.stats.received(recent, model.as_deref());

    let cut = match sim.admin.take_failure() {
        Failing::No => None,
        Failing::Reset => {
            conn.reset.store(true, Ordering::Relaxed);
            return Err(Reset);
        }
        Failing::Status(503) => return Ok(error_response(&ApiError::unavailable())),
        Failing::Status(code) => return Ok(error_response(&ApiError::status(code))),
        Failing::Cut(after) => Some(after),
    };
    let value = match (body, parsed) {
        (Err(e), _) => return Ok(error_response(&e)),
        (Ok(_), Some(Ok(v))) => v,
        (Ok(_), _) => {
            return Ok(error_response(&ApiError::bad_request(
                "Invalid JSON in request body",
            )))
        }
    };
    let names = sim.models.served();
    let mut spec = match output_tokens
        .and_then(|n| api::parse_request(endpoint, &value, &names, sim.default_max_tokens, n))
    {
        Ok(s) => s,
        Err(e) => return Ok(error_response(&e)),
    };
    if spec.priority != 0 && sim.scheduling_policy == SchedulingPolicy::Fcfs {
        return Ok(error_response(&ApiError::priority_disabled(spec.priority)));
    }
    let need = sim
        .engine
        .footprint(spec.prompt_tokens, spec.completion_tokens, spec.max_tokens);
    let budget = sim.engine.budget();
    if need.reserved > budget {
        return Ok(error_response(&ApiError::context_length(
            budget,
            spec.prompt_tokens,
            need.reserved.saturating_sub(spec.prompt_tokens),
        )));
    }

    let id = sim.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = ResponseMeta {
        endpoint,
        id: format!("{}-{id}", endpoint.id_prefix()),
        created: unix_now(),
        model: spec.model.clone(),
    };
    let prompt = std::mem::take(&mut spec.prompt);
    let blocks = sim
        .engine
        .prefix_block_tokens()
        .map(|bt| prompt.block_hashes(bt, &spec.model))
        .unwrap_or_default();
    let demand = sim
        .engine
        .demand(need, spec.prompt_tokens, blocks, spec.priority);
    let job = Job {
        id: meta.id.clone(),
        request_id,
        engine: (id % sim.engines as u64) as usize,
        spec,
        demand,
        arrived,
    };
    let model_header = HeaderValue::from_str(&meta.model).ok();
    let mut resp = if job.spec.stream {
        // Headers go out before admission, as vLLM's streaming responses do: queueing shows
        // up as a late first chunk, not a late response.
        let frames = api::sse_frames(&meta, &job.spec);
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(generate::stream(Arc::clone(&sim), job, frames, tx));
        let body = match cut {
            None => SimBody::Channel(rx),
            Some(left) => SimBody::Cut {
                rx,
                left,
                pause: None,
            },
        };
        let mut resp = Response::new(body);
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        resp
    } else {
        let served = match generate::complete(&sim, &job).await {
            Ok(s) => s,
            Err(e) => {
                return Ok(error_response(&ApiError::context_length(
                    e.budget,
                    job.spec.prompt_tokens,
                    e.need.saturating_sub(job.spec.prompt_tokens),
                )))
            }
        };
        let mut resp = respond(
            StatusCode::OK,
            Some(JSON),
            api::completion_body(
                &meta,
                &job.spec,
                sim.prompt_tokens_details.then_some(served.cached_tokens),
            ),
        );
        let h = resp.headers_mut();
        let queue_ms = format!("{:.3}", served.queued.as_secs_f64() * 1000.0);
        if let Ok(v) = HeaderValue::from_str(&queue_ms) {
            h.insert(X_SIM_QUEUE_MS, v);
        }
        h.insert(X_SIM_CACHED_TOKENS, HeaderValue::from(served.cached_tokens));
        resp
    };
    if let Some(m) = model_header {
        resp.headers_mut().insert(X_SIM_MODEL, m);
    }
    Ok(resp)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn models(sim: &Sim) -> Response<SimBody> {
    let data = sim.models.cards(sim.started, sim.engine.budget());
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// vLLM's runtime LoRA updates: a plain-text success line, or its JSON error.
async fn lora(sim: &Sim, req: Request<Incoming>, route: Route) -> Response<SimBody> {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let Ok(value) = serde_json::from_slice::<Value>(&body) else {
        return error_response(&ApiError::bad_request("Invalid JSON in request body"));
    };
    let result = if route == Route::LoadLora {
        sim.models.load(&value)
    } else {
        sim.models.unload(&value)
    };
    match result {
        Ok(text) => respond(StatusCode::OK, None, Bytes::from(text)),
        Err(e) => error_response(&e),
    }
}

fn metrics(sim: &Sim) -> Response<SimBody> {
    let load = sim.engine.snapshot();
    let pins = sim.admin.get();
    let gauges = Gauges {
        running: load.running as u64,
        waiting: pins.waiting.unwrap_or(load.waiting as u64),
        kv_usage: pins.kv_usage.unwrap_or(load.kv_usage),
    };
    let text = sim
        .metrics
        .render(sim.models.default_model(), sim.legacy_metrics, gauges);
    respond(
        StatusCode::OK,
        Some("text/plain; version=0.0.4; charset=utf-8"),
        Bytes::from(text),
    )
}

fn stats(sim: &Sim) -> Value {
    let mut v = sim.stats.to_json(&sim.engine.snapshot());
    if let Some(obj) = v.as_object_mut() {
        if let Ok(switches) = serde_json::to_value(sim.admin.get()) {
            obj.insert("switches".into(), switches);
        }
    }
    v
}

async fn admin_switch(sim: &Sim, req: Request<Incoming>, route: Route) -> Response<SimBody> {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e),
    };
    let Ok(value) = serde_json::from_slice::<Value>(&body) else {
        return error_response(&ApiError::bad_request("Invalid JSON in request body"));
    };
    let result = match route {
        Route::AdminHealth => sim.admin.set_health(&value),
        Route::AdminLatency => sim.admin.set_latency(&value),
        Route::AdminFail => sim.admin.set_fail(&value).map(|(switches, refuse)| {
            if let Some(d) = refuse {
                sim.refuse(d);
            }
            switches
        }),
        _ => sim.admin.set_kv(&value),
    };
    match result.and_then(|s| serde_json::to_value(s).map_err(|e| e.to_string())) {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(msg) => error_response(&ApiError::bad_request(msg)),
    }
}
