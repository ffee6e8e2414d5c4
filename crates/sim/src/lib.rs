//! `sluice sim`: a stand-in for a vLLM OpenAI-compatible server, for tests and benchmarks.
//!
//! It speaks vLLM's HTTP API and exports vLLM's metric names, and its latency responds to load
//! the way a real engine's does: requests reserve KV cache (for their answer, or for their whole
//! `max_tokens` with `--kv-reserve max-tokens`), queue when it or the batch is full (first come,
//! first served, or by vLLM's `priority` field with `--scheduling-policy priority`), and decode
//! slower as the cache fills. One process is one replica of a fleet: it has its own prefix cache
//! (prompt blocks that stay in free KV after their request, so a later prompt with the same head
//! skips that part of prefill), its own LoRA adapters, and it aborts a request whose client goes
//! away. Admin endpoints let tests force states (unhealthy, slow, pinned pressure) and read back
//! what the proxy actually sent.

mod admin;
mod api;
mod engine;
mod generate;
mod http;
mod metrics;
mod models;
mod prefix;
mod prompt;
mod stats;

use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use self::admin::Admin;
pub use self::engine::KvReserve;
use self::engine::{Engine, EngineConfig};
use self::metrics::Metrics;
use self::models::Models;
use self::stats::Stats;

/// How the waiting queue is ordered, as vLLM's `--scheduling-policy`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// First come, first served; a request with a non-zero `priority` is refused
    #[default]
    Fcfs,
    /// By the request's `priority` (lower first), then arrival
    Priority,
}

/// `--prefix-caching on|off`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    #[default]
    On,
    Off,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1:8001")]
    pub listen: String,
    /// Served model names (repeatable / comma separated); the first is the default. Requests naming another model get vLLM's 404.
    #[arg(long = "model", value_delimiter = ',', default_value = "llama-3-70b")]
    pub models: Vec<String>,
    /// KV-cache budget in tokens
    #[arg(long, default_value_t = 16384)]
    pub kv_tokens: u64,
    /// Max concurrently running sequences (vLLM max_num_seqs)
    #[arg(long, default_value_t = 32)]
    pub max_running: usize,
    /// Time to first token at idle, ms
    #[arg(long, default_value_t = 20)]
    pub ttft_ms: u64,
    /// Prefill cost per prompt token, microseconds
    #[arg(long, default_value_t = 50)]
    pub prefill_us_per_token: u64,
    /// Inter-token latency at idle, ms (float ok)
    #[arg(long, default_value_t = 1.0)]
    pub itl_ms: f64,
    /// How much ITL and TTFT grow at full KV usage (factor: latency *= 1 + slowdown * kv_usage)
    #[arg(long, default_value_t = 3.0)]
    pub load_slowdown: f64,
    /// max_tokens of a request that sets none; also the completion length of one without an x-sim-output-tokens header
    #[arg(long, default_value_t = 128)]
    pub default_max_tokens: u64,
    /// KV a request reserves at admission and holds until it ends. Decode slows with the KV the running answers write (prompt + answer length), not with what they reserve; an answer is max_tokens long unless the x-sim-output-tokens request header says it stops sooner
    #[arg(long, value_enum, default_value_t = KvReserve::Output)]
    pub kv_reserve: KvReserve,
    /// Export the pre-v0.10 metric name vllm:gpu_cache_usage_perc instead of vllm:kv_cache_usage_perc, and vllm:inter_token_latency_seconds also as the pre-v0.11 vllm:time_per_output_token_seconds
    #[arg(long)]
    pub legacy_metrics: bool,
    /// Number of engines to export metrics for (label engine="0".."n-1"); load is split evenly
    #[arg(long, default_value_t = 1)]
    pub engines: usize,
    /// Tokens per KV block, the prefix cache's unit (vLLM's --block-size)
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// Automatic prefix caching: a prompt's leading blocks found cached skip prefill and need no new KV; blocks of finished requests stay cached in free KV until evicted (LRU)
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub prefix_caching: Switch,
    /// At most this many tokens of cached blocks no request uses are kept (least recently freed evicted first); default: all the free KV holds. A small cache thrashes when more distinct prompt heads come than it holds, without limiting the running batch's KV
    #[arg(long)]
    pub prefix_cache_tokens: Option<u64>,
    /// Prefills take turns on the engine's compute, as on a GPU: each waits for the prefills scheduled before it, so uncached prompt tokens delay the prompts behind them and a prefix-cache hit frees compute for them (default: each prefill takes its own time alone)
    #[arg(long)]
    pub serial_prefill: bool,
    /// As vLLM's flag: usage reports the prompt tokens the prefix cache served, as prompt_tokens_details.cached_tokens (in a stream's usage chunk with stream_options.include_usage)
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Waiting-queue order; with priority, lower `priority` values are admitted first
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,
    /// LoRA adapters of the first model, NAME or NAME=PATH (repeatable / comma separated); more can be loaded at runtime with POST /v1/load_lora_adapter
    #[arg(long = "lora", value_delimiter = ',')]
    pub loras: Vec<String>,
}

/// State shared by every connection.
pub(crate) struct Sim {
    models: Models,
    scheduling_policy: SchedulingPolicy,
    default_max_tokens: u64,
    legacy_metrics: bool,
    /// `--enable-prompt-tokens-details`.
    pub(crate) prompt_tokens_details: bool,
    engines: usize,
    /// Reported as the models' `created` time.
    started: u64,
    next_id: AtomicU64,
    engine: Engine,
    admin: Admin,
    stats: Stats,
    metrics: Metrics,
    /// `PUT /admin/fail {"mode": "refuse"}`: how long the accept loop refuses connections.
    refuse: tokio::sync::watch::Sender<Option<Duration>>,
    /// Bumped to reset every open connection.
    kill: tokio::sync::watch::Sender<u64>,
}

impl Sim {
    /// Closes the listener and resets every open connection for `d`: what a client sees of a
    /// replica whose process died, until it listens again.
    pub(crate) fn refuse(&self, d: Duration) {
        self.refuse.send_replace(Some(d));
    }
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("sluice sim: {msg}"))
}

impl Sim {
    fn new(args: SimArgs) -> io::Result<Self> {
        let models: Vec<String> = args
            .models
            .iter()
            .map(|m| m.trim().to_string())
            .filter(|m| !m.is_empty())
            .collect();
        let models = Models::new(models, &args.loras).map_err(|e| invalid(&e))?;
        if args.kv_tokens == 0 || args.max_running == 0 || args.engines == 0 || args.block_size == 0
        {
            return Err(invalid(
                "--kv-tokens, --max-running, --engines and --block-size must be at least 1",
            ));
        }
        for (name, v) in [
            ("--itl-ms", args.itl_ms),
            ("--load-slowdown", args.load_slowdown),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(&format!("{name} must be a non-negative number")));
            }
        }
        Ok(Self {
            engine: Engine::new(EngineConfig {
                kv_tokens: args.kv_tokens,
                max_running: args.max_running,
                ttft_ms: args.ttft_ms as f64,
                prefill_us_per_token: args.prefill_us_per_token as f64,
                itl_ms: args.itl_ms,
                load_slowdown: args.load_slowdown,
                kv_reserve: args.kv_reserve,
                block_tokens: args.block_size,
                prefix_caching: args.prefix_caching == Switch::On,
                prefix_cache_tokens: args.prefix_cache_tokens,
                serial_prefill: args.serial_prefill,
            }),
            metrics: Metrics::new(args.engines),
            models,
            scheduling_policy: args.scheduling_policy,
            default_max_tokens: args.default_max_tokens.max(1),
            legacy_metrics: args.legacy_metrics,
            prompt_tokens_details: args.enable_prompt_tokens_details,
            engines: args.engines,
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_id: AtomicU64::new(1),
            admin: Admin::default(),
            stats: Stats::default(),
            refuse: tokio::sync::watch::channel(None).0,
            kill: tokio::sync::watch::channel(0).0,
        })
    }
}

/// Serves the simulator on `listener` until the process ends.
pub async fn serve(args: SimArgs, listener: TcpListener) -> io::Result<()> {
    let sim = Arc::new(Sim::new(args)?);
    let addr = listener.local_addr()?;
    let mut listener = listener;
    let mut refuse = sim.refuse.subscribe();
    loop {
        let (stream, _) = tokio::select! {
            conn = listener.accept() => match conn {
                Ok(conn) => conn,
                Err(e) => {
                    // Usually fd exhaustion under a benchmark; back off instead of spinning.
                    log::warn!("sluice sim: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            Ok(()) = refuse.changed() => {
                let Some(d) = *refuse.borrow_and_update() else { continue };
                listener = refuse_for(&sim, listener, addr, d).await?;
                continue;
            }
        };
        // SSE chunks are tiny; Nagle would hold them back and blur chunk timing.
        let _ = stream.set_nodelay(true);
        tokio::spawn(connection(Arc::clone(&sim), stream));
    }
}

/// Closes `listener` (connections to `addr` are refused), resets every open connection once the
/// admin answer that asked for it has left, waits `d` and listens on `addr` again.
async fn refuse_for(
    sim: &Sim,
    listener: TcpListener,
    addr: std::net::SocketAddr,
    d: Duration,
) -> io::Result<TcpListener> {
    drop(listener);
    let until = tokio::time::Instant::now() + d;
    tokio::time::sleep(Duration::from_millis(20).min(d)).await;
    sim.kill.send_modify(|n| *n += 1);
    tokio::time::sleep_until(until).await;
    // The port is ours until the address is reused by someone else; keep trying a while.
    let mut tries = 0;
    let listener = loop {
        match TcpListener::bind(addr).await {
            Ok(l) => break l,
            Err(e) if tries < 100 => {
                tries += 1;
                log::warn!("sluice sim: listening again on {addr}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e),
        }
    };
    sim.admin.refused();
    Ok(listener)
}

/// One client connection, until it ends or the simulator resets it (`PUT /admin/fail`): a reset
/// connection is closed with an RST.
async fn connection(sim: Arc<Sim>, mut stream: tokio::net::TcpStream) {
    let conn = Arc::new(http::Conn::default());
    let mut kill = sim.kill.subscribe();
    {
        let (sim, c) = (Arc::clone(&sim), Arc::clone(&conn));
        let service = service_fn(move |req| http::handle(Arc::clone(&sim), Arc::clone(&c), req));
        let serving = http1::Builder::new()
            .keep_alive(true)
            .serve_connection(TokioIo::new(&mut stream), service);
        tokio::select! {
            ended = serving => if let Err(e) = ended {
                log::debug!("sluice sim: connection ended: {e}");
            },
            _ = kill.changed() => conn.reset.store(true, std::sync::atomic::Ordering::Relaxed),
        }
    }
    if conn.reset.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = stream.set_zero_linger();
    }
}

/// Binds `args.listen` and serves until the process ends.
pub async fn run(args: SimArgs) -> io::Result<()> {
    let listener = TcpListener::bind(&args.listen).await?;
    log::info!("sluice sim listening on {}", listener.local_addr()?);
    serve(args, listener).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::{connect::HttpConnector, Client};
    use hyper_util::rt::TokioExecutor;
    use serde_json::{json, Value};

    type TestClient = Client<HttpConnector, Full<Bytes>>;

    fn args() -> SimArgs {
        SimArgs {
            listen: "127.0.0.1:0".into(),
            models: vec!["m1".into(), "m2".into()],
            kv_tokens: 4096,
            max_running: 8,
            ttft_ms: 2,
            prefill_us_per_token: 10,
            itl_ms: 1.0,
            load_slowdown: 1.0,
            default_max_tokens: 16,
            kv_reserve: KvReserve::Output,
            legacy_metrics: false,
            engines: 1,
            block_size: 16,
            prefix_caching: Switch::On,
            prefix_cache_tokens: None,
            serial_prefill: false,
            enable_prompt_tokens_details: false,
            scheduling_policy: SchedulingPolicy::Fcfs,
            loras: Vec::new(),
        }
    }

    async fn start() -> (String, TestClient) {
        start_with(|_| {}).await
    }

    async fn start_with(f: impl FnOnce(&mut SimArgs)) -> (String, TestClient) {
        let mut a = args();
        f(&mut a);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(serve(a, listener));
        (base, Client::builder(TokioExecutor::new()).build_http())
    }

    async fn stats(client: &TestClient, base: &str) -> Value {
        let (_, _, b) = call(client, "GET", format!("{base}/admin/stats"), None).await;
        serde_json::from_slice(&b).unwrap()
    }

    /// Polls /admin/stats until `want` holds, for at most `within`.
    async fn stats_until(
        client: &TestClient,
        base: &str,
        within: Duration,
        want: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = std::time::Instant::now();
        loop {
            let s = stats(client, base).await;
            if want(&s) || start.elapsed() > within {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Writes a chat request on a bare connection and returns it unread, so the test decides
    /// when the client goes away.
    async fn raw_chat(base: &str, body: Value) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let addr = base.trim_start_matches("http://");
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let body = body.to_string();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(body.as_bytes()).await.unwrap();
        s
    }

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    async fn call(
        client: &TestClient,
        method: &str,
        url: String,
        body: Option<Value>,
    ) -> (u16, ::http::HeaderMap, Bytes) {
        let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
        let req = ::http::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .header("x-request-id", "rid-1")
            .header("x-tenant-id", "acme")
            .header("traceparent", TRACEPARENT)
            .body(Full::new(body))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        (
            status,
            headers,
            resp.into_body().collect().await.unwrap().to_bytes(),
        )
    }

    fn gauge(metrics: &str, name: &str) -> f64 {
        let prefix = format!("{name}{{model_name=\"m1\",engine=\"0\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap()
            .parse()
            .unwrap()
    }

    #[tokio::test]
    async fn serves_the_vllm_api_over_http() {
        let (base, client) = start().await;
        let chat = format!("{base}/v1/chat/completions");
        let msgs = json!([{"role": "user", "content": "hello there"}]);

        let (status, headers, body) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"model": "m2", "messages": msgs, "max_tokens": 7})),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-sim-model"], "m2");
        assert_eq!(headers["x-request-id"], "rid-1");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 7);
        assert_eq!(v["usage"]["prompt_tokens"], 3);
        assert_eq!(v["choices"][0]["finish_reason"], "length");

        // Streamed: events arrive as separate chunks, then [DONE].
        let req = ::http::Request::post(chat.clone())
            .body(Full::new(Bytes::from(
                json!({"messages": msgs, "max_tokens": 20, "stream": true,
                       "stream_options": {"include_usage": true}})
                .to_string(),
            )))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let mut body = resp.into_body();
        let mut frames = 0;
        let mut text = String::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                frames += 1;
                text.push_str(std::str::from_utf8(&data).unwrap());
            }
        }
        assert!(frames > 3, "{frames}");
        assert!(text.ends_with("data: [DONE]\n\n"));
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        // role + 20 tokens + finish + usage + [DONE]
        assert_eq!(events.len(), 24);
        let usage: Value = serde_json::from_str(&events[22]["data: ".len()..]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 20);

        // Unknown model.
        let (status, _, body) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"model": "nope", "messages": msgs})),
        )
        .await;
        assert_eq!(status, 404);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["message"], "The model `nope` does not exist.");

        // Too large for the KV budget, and malformed JSON.
        let (status, _, _) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"messages": msgs, "max_tokens": 5000})),
        )
        .await;
        assert_eq!(status, 400);
        let req = ::http::Request::post(chat.clone())
            .body(Full::new(Bytes::from_static(b"{nope")))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 400);

        // A slow request shows up as running in /metrics while in flight.
        let (status, _, _) = call(
            &client,
            "PUT",
            format!("{base}/admin/latency"),
            Some(json!({"extra_ms": 300})),
        )
        .await;
        assert_eq!(status, 200);
        let slow = {
            let client = client.clone();
            let chat = chat.clone();
            let msgs = msgs.clone();
            tokio::spawn(async move {
                call(
                    &client,
                    "POST",
                    chat,
                    Some(json!({"messages": msgs, "max_tokens": 1})),
                )
                .await
            })
        };
        let mut seen = 0.0;
        for _ in 0..50 {
            let (_, _, m) = call(&client, "GET", format!("{base}/metrics"), None).await;
            seen = gauge(
                std::str::from_utf8(&m).unwrap(),
                "vllm:num_requests_running",
            );
            if seen == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(seen, 1.0);
        call(
            &client,
            "PUT",
            format!("{base}/admin/latency"),
            Some(json!({"extra_ms": 0})),
        )
        .await;
        assert_eq!(slow.await.unwrap().0, 200);

        // Pinned pressure is what /metrics reports.
        call(
            &client,
            "PUT",
            format!("{base}/admin/kv"),
            Some(json!({"usage": 0.9, "waiting": 3})),
        )
        .await;
        let (_, _, m) = call(&client, "GET", format!("{base}/metrics"), None).await;
        let m = String::from_utf8(m.to_vec()).unwrap();
        assert_eq!(gauge(&m, "vllm:kv_cache_usage_perc"), 0.9);
        assert_eq!(gauge(&m, "vllm:num_requests_waiting"), 3.0);

        // Unhealthy: /health and completions answer 503.
        call(
            &client,
            "PUT",
            format!("{base}/admin/health"),
            Some(json!({"healthy": false})),
        )
        .await;
        assert_eq!(
            call(&client, "GET", format!("{base}/health"), None).await.0,
            503
        );
        let (status, _, _) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"messages": msgs})),
        )
        .await;
        assert_eq!(status, 503);
        call(
            &client,
            "PUT",
            format!("{base}/admin/health"),
            Some(json!({"healthy": true})),
        )
        .await;
        assert_eq!(
            call(&client, "GET", format!("{base}/health"), None).await.0,
            200
        );

        let (_, _, body) = call(&client, "GET", format!("{base}/admin/stats"), None).await;
        let stats: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(stats["received"], 7);
        assert_eq!(stats["by_model"]["m2"], 1);
        assert_eq!(stats["peak_running"], 1);
        assert_eq!(stats["running"], 0);
        let first = &stats["recent"][0];
        assert_eq!(first["model"], "m2");
        assert_eq!(first["max_tokens"], 7);
        assert_eq!(first["tenant"], "acme");
        assert_eq!(first["traceparent"], TRACEPARENT);
        assert_eq!(first["tracestate"], Value::Null);
        assert_eq!(stats["last_traceparents"][0], TRACEPARENT);
        assert!(
            first["content_length"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                > 0
        );

        let (_, _, body) = call(&client, "POST", format!("{base}/admin/reset"), None).await;
        let stats: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (stats["received"].as_u64(), stats["peak_running"].as_u64()),
            (Some(0), Some(0))
        );

        let (status, _, body) = call(&client, "GET", format!("{base}/v1/models"), None).await;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["data"][1]["id"], "m2");
        assert_eq!(v["data"][0]["max_model_len"], 4096);
        assert_eq!(
            call(&client, "GET", format!("{base}/nope"), None).await.0,
            404
        );
        assert_eq!(call(&client, "GET", chat, None).await.0, 405);
    }

    /// vLLM observes one inter-token latency per decoded token after the first: the gap since
    /// the token before it, at the pace the load sets.
    #[tokio::test]
    async fn a_streamed_answer_observes_one_inter_token_latency_per_later_token() {
        let (base, client) = start_with(|a| a.itl_ms = 4.0).await;
        let itl = |m: &str| {
            (
                gauge(m, "vllm:inter_token_latency_seconds_count"),
                gauge(m, "vllm:inter_token_latency_seconds_sum"),
            )
        };
        let metrics = || async {
            let (_, _, m) = call(&client, "GET", format!("{base}/metrics"), None).await;
            String::from_utf8(m.to_vec()).unwrap()
        };
        let before = metrics().await;
        assert!(!before.contains("vllm:time_per_output_token_seconds"));
        let (count0, sum0) = itl(&before);
        let tokens = 20;
        let req = ::http::Request::post(format!("{base}/v1/chat/completions"))
            .body(Full::new(Bytes::from(
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                       "stream": true})
                .to_string(),
            )))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        resp.into_body().collect().await.unwrap();
        let after = metrics().await;
        let (count, sum) = itl(&after);
        let gaps = (tokens - 1) as f64;
        assert_eq!(count - count0, gaps);
        // 4 ms at idle, slowed by the few tokens the answer writes into the 4096-token cache
        // (--load-slowdown 1): at most 1 % here.
        let mean = (sum - sum0) / gaps;
        assert!((0.004 - 1e-9..0.004 * 1.01).contains(&mean), "{mean}");
        assert_eq!(
            gauge(&after, "vllm:time_to_first_token_seconds_count"),
            1.0,
            "the first token is TTFT's, not a gap"
        );
        let bucket = |le: &str| {
            let l = format!(
                "vllm:inter_token_latency_seconds_bucket\
                 {{model_name=\"m1\",engine=\"0\",le=\"{le}\"}} "
            );
            after
                .lines()
                .find_map(|line| line.strip_prefix(l.as_str()))
                .unwrap()
                .parse::<f64>()
                .unwrap()
        };
        assert_eq!(bucket("0.01"), gaps);
        assert_eq!(bucket("+Inf"), gaps);
    }

    #[tokio::test]
    async fn client_disconnect_releases_kv() {
        let (base, client) = start().await;
        call(
            &client,
            "PUT",
            format!("{base}/admin/latency"),
            Some(json!({"extra_ms": 5000})),
        )
        .await;
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let mut pending = Vec::new();
        for stream in [false, true] {
            let client = client.clone();
            let url = format!("{base}/v1/chat/completions");
            let body = json!({"messages": msgs, "stream": stream});
            pending.push(tokio::spawn(async move {
                let req = ::http::Request::post(url)
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap();
                // Hold the response (stream) so the request stays in flight until aborted.
                let resp = client.request(req).await.unwrap();
                resp.into_body().collect().await.map(|_| ())
            }));
        }
        let running = |stats: &Value| stats["running"].as_u64().unwrap();
        let mut stats = Value::Null;
        for _ in 0..100 {
            let (_, _, b) = call(&client, "GET", format!("{base}/admin/stats"), None).await;
            stats = serde_json::from_slice(&b).unwrap();
            if running(&stats) == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(running(&stats), 2);
        for p in pending {
            p.abort();
        }
        for _ in 0..100 {
            let (_, _, b) = call(&client, "GET", format!("{base}/admin/stats"), None).await;
            stats = serde_json::from_slice(&b).unwrap();
            if running(&stats) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(running(&stats), 0);
        assert_eq!(stats["kv_used_tokens"], 0);
    }

    #[tokio::test]
    async fn a_closed_connection_aborts_queued_and_running_requests() {
        let (base, client) = start_with(|a| a.max_running = 1).await;
        call(
            &client,
            "PUT",
            format!("{base}/admin/latency"),
            Some(json!({"extra_ms": 5000})),
        )
        .await;
        let msgs = json!([{"role": "user", "content": "x".repeat(400)}]);
        let running = raw_chat(&base, json!({"messages": msgs})).await;
        stats_until(&client, &base, Duration::from_secs(5), |s| {
            s["running"] == 1
        })
        .await;
        let queued = raw_chat(&base, json!({"messages": msgs})).await;
        let queued_stream = raw_chat(&base, json!({"messages": msgs, "stream": true})).await;
        let s = stats_until(&client, &base, Duration::from_secs(5), |s| {
            s["waiting"] == 2
        })
        .await;
        assert_eq!((&s["running"], &s["waiting"]), (&json!(1), &json!(2)));
        assert_eq!(s["kv_used_tokens"], 116);

        // Each close is noticed at once: hyper drops the request's future with its connection.
        for (conn, aborted) in [(queued, 1), (queued_stream, 2), (running, 3)] {
            drop(conn);
            let s = stats_until(&client, &base, Duration::from_millis(200), |s| {
                s["aborted"] == aborted
            })
            .await;
            assert_eq!(s["aborted"], aborted, "{s}");
        }
        let s = stats(&client, &base).await;
        assert_eq!(
            (
                &s["running"],
                &s["waiting"],
                &s["kv_used_tokens"],
                &s["completed"]
            ),
            (&json!(0), &json!(0), &json!(0), &json!(0))
        );
        let (_, _, m) = call(&client, "GET", format!("{base}/metrics"), None).await;
        let m = String::from_utf8(m.to_vec()).unwrap();
        assert!(
            m.contains(
                "vllm:request_success_total{model_name=\"m1\",engine=\"0\",\
                 finished_reason=\"abort\"} 3.0\n"
            ),
            "{m}"
        );
    }

    #[tokio::test]
    async fn priority_needs_the_priority_policy() {
        let (base, client) = start().await;
        let url = format!("{base}/v1/chat/completions");
        let body = |p: Value| Some(json!({"messages": [], "max_tokens": 1, "priority": p}));
        let (status, _, b) = call(&client, "POST", url.clone(), body(json!(2))).await;
        assert_eq!(status, 400);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            v["message"],
            "Got priority 2 but Priority scheduling is not enabled."
        );
        assert_eq!(
            call(&client, "POST", url.clone(), body(json!(0))).await.0,
            200
        );

        let (base, client) = start_with(|a| a.scheduling_policy = SchedulingPolicy::Priority).await;
        let url = format!("{base}/v1/chat/completions");
        let (status, headers, _) = call(&client, "POST", url.clone(), body(json!(-4))).await;
        assert_eq!(status, 200);
        assert!(headers["x-sim-queue-ms"]
            .to_str()
            .unwrap()
            .parse::<f64>()
            .is_ok());
        assert_eq!(call(&client, "POST", url, body(json!(0.5))).await.0, 400);
        assert_eq!(
            stats(&client, &base).await["admitted_by_priority"],
            json!({"-4": 1})
        );
    }

    #[tokio::test]
    async fn a_repeated_prompt_head_is_served_from_the_prefix_cache() {
        let (base, client) = start_with(|a| a.kv_tokens = 100_000).await;
        let url = format!("{base}/v1/chat/completions");
        // 640 characters: 160 tokens, ten full blocks, then a short user turn.
        let system = "You are terse. ".repeat(43)[..640].to_string();
        let ask = |user: &str| {
            Some(json!({"max_tokens": 1, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]}))
        };
        let cached = |h: &::http::HeaderMap| h["x-sim-cached-tokens"].to_str().unwrap().to_owned();
        let (_, h, _) = call(&client, "POST", url.clone(), ask("first?")).await;
        assert_eq!(cached(&h), "0");
        let (_, h, _) = call(&client, "POST", url.clone(), ask("second?")).await;
        assert_eq!(cached(&h), "160");
        let s = stats(&client, &base).await;
        assert_eq!(s["prefix_cache_queries_tokens"], 2 * 162);
        assert_eq!(s["prefix_cache_hit_tokens"], 160);
        // Both finished: their blocks stay cached but count as free KV.
        assert_eq!(
            (&s["kv_used_tokens"], &s["kv_cached_free_tokens"]),
            (&json!(0), &json!(160))
        );

        // Off, nothing is looked up.
        let (base, client) = start_with(|a| a.prefix_caching = Switch::Off).await;
        let url = format!("{base}/v1/chat/completions");
        for _ in 0..2 {
            let (_, h, _) = call(&client, "POST", url.clone(), ask("again?")).await;
            assert_eq!(cached(&h), "0");
        }
        assert_eq!(
            stats(&client, &base).await["prefix_cache_queries_tokens"],
            0
        );
    }

    #[tokio::test]
    async fn usage_reports_the_cached_prompt_tokens_when_asked_to() {
        let system = "You are terse. ".repeat(43)[..640].to_string();
        let ask = |user: &str, stream: bool| {
            Some(json!({"max_tokens": 2, "stream": stream,
                "stream_options": {"include_usage": true}, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]}))
        };
        let details = |body: &[u8], stream: bool| -> Value {
            let text = String::from_utf8_lossy(body).to_string();
            let json = if stream {
                text.split("\n\n")
                    .filter_map(|e| e.strip_prefix("data: "))
                    .find(|e| e.contains("\"usage\""))
                    .unwrap()
                    .to_string()
            } else {
                text
            };
            let v: Value = serde_json::from_str(&json).unwrap();
            v["usage"]["prompt_tokens_details"].clone()
        };
        let (base, client) = start_with(|a| a.enable_prompt_tokens_details = true).await;
        let url = format!("{base}/v1/chat/completions");
        let (_, _, b) = call(&client, "POST", url.clone(), ask("first?", false)).await;
        assert_eq!(details(&b, false), json!({"cached_tokens": 0}));
        let (_, _, b) = call(&client, "POST", url.clone(), ask("second?", true)).await;
        assert_eq!(details(&b, true), json!({"cached_tokens": 160}));
        let (_, _, b) = call(&client, "POST", url.clone(), ask("third?", false)).await;
        assert_eq!(details(&b, false), json!({"cached_tokens": 160}));
        // Without the flag, as vLLM: no details.
        let (base, client) = start().await;
        let url = format!("{base}/v1/chat/completions");
        for stream in [false, true] {
            let (_, _, b) = call(&client, "POST", url.clone(), ask("again?", stream)).await;
            assert_eq!(details(&b, stream), Value::Null);
        }
    }

    #[tokio::test]
    async fn lora_adapters_load_route_and_unload() {
        let (base, client) = start_with(|a| a.loras = vec!["fixed=/adapters/fixed".into()]).await;
        let chat = format!("{base}/v1/chat/completions");
        let ask = |m: &str| Some(json!({"model": m, "messages": [], "max_tokens": 1}));
        assert_eq!(
            call(&client, "POST", chat.clone(), ask("fixed")).await.0,
            200
        );
        assert_eq!(
            call(&client, "POST", chat.clone(), ask("late")).await.0,
            404
        );
        let load = Some(json!({"lora_name": "late", "lora_path": "/adapters/late"}));
        let (status, _, b) = call(
            &client,
            "POST",
            format!("{base}/v1/load_lora_adapter"),
            load.clone(),
        )
        .await;
        assert_eq!(
            (status, &b[..]),
            (
                200,
                &b"Success: LoRA adapter 'late' added successfully."[..]
            )
        );
        let (status, _, _) = call(
            &client,
            "POST",
            format!("{base}/v1/load_lora_adapter"),
            load,
        )
        .await;
        assert_eq!(status, 400);
        let (status, headers, b) = call(&client, "POST", chat.clone(), ask("late")).await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-sim-model"], "late");
        assert_eq!(
            serde_json::from_slice::<Value>(&b).unwrap()["model"],
            "late"
        );
        let (_, _, b) = call(&client, "GET", format!("{base}/v1/models"), None).await;
        let ids: Vec<String> = serde_json::from_slice::<Value>(&b).unwrap()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| format!("{}<{}", c["id"].as_str().unwrap(), c["parent"]))
            .collect();
        assert_eq!(ids, ["m1<null", "m2<null", "fixed<\"m1\"", "late<\"m1\""]);
        let (status, _, _) = call(
            &client,
            "POST",
            format!("{base}/v1/unload_lora_adapter"),
            Some(json!({"lora_name": "late"})),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(call(&client, "POST", chat, ask("late")).await.0, 404);
        assert_eq!(
            stats(&client, &base).await["requests_by_model"],
            json!({"fixed": 1, "late": 3})
        );
    }

    /// Reads what a bare connection gets until the simulator closes it: the bytes, and whether
    /// it ended with a reset.
    async fn read_to_end(mut s: tokio::net::TcpStream) -> (Vec<u8>, bool) {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                Ok(Ok(0)) => return (got, false),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => {
                    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
                    return (got, true);
                }
                Err(_) => panic!("the simulator kept the connection open"),
            }
        }
    }

    #[tokio::test]
    async fn admin_fail_resets_cuts_refuses_and_answers_errors() {
        let (base, client) = start().await;
        let fail = |body: Value| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let (status, _, b) =
                    call(&client, "PUT", format!("{base}/admin/fail"), Some(body)).await;
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
            }
        };
        let msgs = json!([{"role": "user", "content": "hello"}]);

        // Reset: the request is read (counted), then the connection is reset before any byte.
        fail(json!({"mode": "reset", "count": 1})).await;
        let conn = raw_chat(&base, json!({"messages": msgs, "max_tokens": 4})).await;
        let (got, reset) = read_to_end(conn).await;
        assert!(got.is_empty() && reset, "{}", String::from_utf8_lossy(&got));
        assert_eq!(stats(&client, &base).await["received"], 1);
        // Counted down: the next one is served.
        let chat = format!("{base}/v1/chat/completions");
        let (status, _, _) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"messages": msgs, "max_tokens": 4})),
        )
        .await;
        assert_eq!(status, 200);

        // A status: completions get it, /health stays up.
        fail(json!({"mode": "status", "status": 502})).await;
        let (status, _, _) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"messages": msgs})),
        )
        .await;
        assert_eq!(status, 502);
        assert_eq!(
            call(&client, "GET", format!("{base}/health"), None).await.0,
            200
        );
        // Unavailable: both answer 503.
        fail(json!({"mode": "unavailable"})).await;
        assert_eq!(
            call(&client, "GET", format!("{base}/health"), None).await.0,
            503
        );
        let (status, _, _) = call(
            &client,
            "POST",
            chat.clone(),
            Some(json!({"messages": msgs})),
        )
        .await;
        assert_eq!(status, 503);

        // Cut: a stream's connection is closed after three events, its chunked body unfinished.
        fail(json!({"mode": "cut", "after_events": 3})).await;
        let conn = raw_chat(
            &base,
            json!({"messages": msgs, "max_tokens": 20, "stream": true}),
        )
        .await;
        let (got, _) = read_to_end(conn).await;
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert_eq!(text.matches("data:").count(), 3, "{text}");
        assert!(
            !text.contains("[DONE]") && !text.ends_with("0\r\n\r\n"),
            "{text}"
        );
        fail(json!({"mode": "none"})).await;

        // Refuse: nothing connects for a while, then the same address serves again.
        fail(json!({"mode": "refuse", "for_ms": 400})).await;
        let addr = base.trim_start_matches("http://").to_string();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let refused = tokio::net::TcpStream::connect(&addr).await;
        assert_eq!(
            refused.map(|_| ()).unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
        let start = std::time::Instant::now();
        loop {
            if tokio::net::TcpStream::connect(&addr).await.is_ok() {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "never listened again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let fresh: TestClient = Client::builder(TokioExecutor::new()).build_http();
        let (status, _, _) = call(
            &fresh,
            "POST",
            chat,
            Some(json!({"messages": msgs, "max_tokens": 2})),
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(stats(&fresh, &base).await["switches"]["fail"], "none");
    }
}
