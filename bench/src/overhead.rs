//! Proxy overhead at fixed concurrency, measured with `wrk` against a simulator that answers
//! instantly: straight to the backend, through Sluice (full policy pipeline, in-process
//! admission), through Sluice with the PostgreSQL ledger and Redis admission, and through nginx
//! as a plain reverse proxy, all in the same run so the ratios to nginx compare like with like.
//!
//! nginx is our own instance (`nginx -p <temp prefix> -c <generated conf>`) on a free port, with
//! as many workers as Sluice has threads; the system nginx is never touched.
//!
//! Two more Sluice targets measure distributed tracing (`telemetry.tracing`): on, sampling every
//! request, exporting to a stand-in OTLP/HTTP collector in this process ([`OtlpSink`]), and
//! configured but off (`enabled: false`); the plain Sluice row is tracing off by default.

use serde_json::{json, Value};
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::flame;
use crate::procs::{self, HttpClient, Proc, WorkDir};
use crate::report;
use crate::results::{self, Environment};
use crate::sluice_conf::LEDGER_URL;
use crate::Common;

const REDIS_URL: &str = "redis://127.0.0.1:6379";
const THREADS: u32 = 2;
const WRK_SCRIPT: &str = include_str!("../chat.lua");

/// One wrk measurement.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WrkResult {
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub non_2xx: u64,
    pub errors: u64,
}

/// Parses wrk's `--latency` output.
pub fn parse_wrk(out: &str) -> Option<WrkResult> {
    let mut r = WrkResult::default();
    let mut have = (false, false, false);
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["50%", v] => {
                r.p50_ms = duration_ms(v)?;
                have.0 = true;
            }
            ["99%", v] => {
                r.p99_ms = duration_ms(v)?;
                have.1 = true;
            }
            ["Requests/sec:", v] => {
                r.rps = v.parse().ok()?;
                have.2 = true;
            }
            ["Non-2xx", "or", "3xx", "responses:", n] => r.non_2xx = n.parse().ok()?,
            ["Socket", "errors:", rest @ ..] => {
                // "connect 0, read 0, write 0, timeout 0"
                r.errors = rest
                    .iter()
                    .filter_map(|x| x.trim_end_matches(',').parse::<u64>().ok())
                    .sum();
            }
            _ => {}
        }
    }
    (have.0 && have.1 && have.2).then_some(r)
}

fn duration_ms(v: &str) -> Option<f64> {
    let (num, mult) = if let Some(x) = v.strip_suffix("us") {
        (x, 0.001)
    } else if let Some(x) = v.strip_suffix("ms") {
        (x, 1.0)
    } else if let Some(x) = v.strip_suffix('s') {
        (x, 1000.0)
    } else if let Some(x) = v.strip_suffix('m') {
        (x, 60_000.0)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * mult)
}

struct Target {
    name: &'static str,
    url: String,
    /// Why this target could not be measured, if it could not.
    skipped: Option<String>,
    /// The proxy process, kept alive for the runs.
    process: Option<Proc>,
}

/// What a Sluice target has on besides the policy pipeline.
#[derive(Clone, Copy, PartialEq)]
enum Extras {
    None,
    Ledger,
    LedgerAndRedis,
    /// Tracing on, every request sampled, spans exported to the stand-in collector.
    Tracing,
    /// The same tracing block with `enabled: false`.
    TracingOff,
}

/// The two tracing targets' names, and the row they are compared with.
const TRACED: &str = "sluice + tracing 100 %";
const TRACING_OFF: &str = "sluice + tracing configured off";
const UNTRACED: &str = "sluice";

/// A stand-in OTLP/HTTP trace collector: answers every `POST /v1/traces` with 200 and an empty
/// `ExportTraceServiceResponse` once it has read the body, counting requests and bytes. It does
/// not decode the spans (the testkit's receiver keeps every span, which at tens of thousands of
/// spans a second would grow without bound and take the proxy's cores to decode them); what
/// Sluice exported is read from its own `sluice_trace_spans_total`.
struct OtlpSink {
    addr: String,
    posts: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpSink {
    async fn start() -> Result<Self, String> {
        use http_body_util::{BodyExt, Full};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("OTLP sink: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| e.to_string())?
            .to_string();
        let (posts, bytes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (p, b) = (Arc::clone(&posts), Arc::clone(&bytes));
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let (p, b) = (Arc::clone(&p), Arc::clone(&b));
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (p, b) = (Arc::clone(&p), Arc::clone(&b));
                        async move {
                            let traces = req.method() == hyper::Method::POST
                                && req.uri().path() == "/v1/traces";
                            let n = req
                                .into_body()
                                .collect()
                                .await
                                .map(|c| c.to_bytes().len())
                                .unwrap_or(0);
                            let status = if traces {
                                p.fetch_add(1, Ordering::Relaxed);
                                b.fetch_add(n as u64, Ordering::Relaxed);
                                200
                            } else {
                                404
                            };
                            hyper::Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(bytes::Bytes::new()))
                        }
                    },
                );
                tokio::spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                });
            }
        });
        Ok(Self {
            addr,
            posts,
            bytes,
            task,
        })
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> (u64, u64) {
        (
            self.posts.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn sluice_config(
    listen: &str,
    od: &str,
    spot: &str,
    dir: &Path,
    extras: Extras,
    otlp: &str,
) -> Value {
    let mut cfg = json!({
        "listen": [listen],
        "ops_listen": [sluice_testkit::free_addr()],
        "server": {"threads": THREADS, "grace_period_seconds": 0, "graceful_shutdown_timeout_seconds": 1,
                   "upgrade_sock": dir.join("upgrade.sock").display().to_string(),
                   "pid_file": dir.join("sluice.pid").display().to_string()},
        "tenants": {"support-bot": "Guaranteed", "coding-assistant": "Standard", "batch-analytics": "Best-Effort"},
        "pools": {"on-demand": {"backends": [od]}, "spot": {"backends": [spot]}},
        // A capacity makes every request take and release an admission slot, as in production.
        "tiers": {"Guaranteed": {"inflight_capacity": 10000}},
    });
    // Only the ledger targets: the tracing ones differ from plain Sluice by their tracing block
    // alone, so their ratio to it is tracing's cost.
    if matches!(extras, Extras::Ledger | Extras::LedgerAndRedis) {
        crate::sluice_conf::merge(
            &mut cfg,
            &json!({
                "database_url": LEDGER_URL,
                "ledger": {"schema": "sluice_bench", "spool_dir": dir.join("spool").display().to_string()},
            }),
        );
    }
    if extras == Extras::LedgerAndRedis {
        crate::sluice_conf::merge(
            &mut cfg,
            &json!({"redis_url": REDIS_URL, "coordination": {"redis_prefix": "sluice-bench"}}),
        );
    }
    if matches!(extras, Extras::Tracing | Extras::TracingOff) {
        // The shipped sampler (parent-based, ratio 1: wrk sends no traceparent, so every
        // request starts a sampled trace) and export settings.
        crate::sluice_conf::merge(
            &mut cfg,
            &json!({"telemetry": {"tracing": {
                "enabled": extras == Extras::Tracing,
                "endpoint": otlp,
                "sampler": "parentbased_traceidratio",
                "ratio": 1.0,
            }}}),
        );
    }
    cfg
}

/// Starts Sluice with its extras and checks they are really in use.
async fn start_with(
    bin: &Path,
    cfg: &Value,
    dir: &Path,
    c: &HttpClient,
    extras: Extras,
) -> Result<Proc, String> {
    let p = procs::start_sluice(bin, cfg, dir).await?;
    let mut last = Value::Null;
    for _ in 0..50 {
        let st = procs::get_json(c, &p.ops_url("/status")).await?;
        let deps = &st["dependencies"];
        let tracing = &st["telemetry"]["tracing"]["enabled"];
        let ready = match extras {
            Extras::None => true,
            Extras::Tracing => *tracing == json!(true),
            Extras::TracingOff => *tracing == json!(false),
            Extras::Ledger => deps["ledger"] == json!(true) && st["coordinator"] == json!("local"),
            Extras::LedgerAndRedis => {
                st["coordinator"] != json!("local")
                    && deps["ledger"] == json!(true)
                    && deps["coordinator"] == json!(true)
            }
        };
        if ready {
            return Ok(p);
        }
        last = st;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "started, but not using its extras: coordinator {}, dependencies {}, tracing {}",
        last["coordinator"], last["dependencies"], last["telemetry"]["tracing"]
    ))
}

/// What the instant backend answers: a one-token chat completion, vLLM's health and metrics.
const STATIC_COMPLETION: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"llama-3-70b","choices":[{"index":0,"message":{"role":"assistant","content":"tok "},"finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
const STATIC_METRICS: &str = "vllm:kv_cache_usage_perc{model_name=\"llama-3-70b\",engine=\"0\"} 0.1\nvllm:num_requests_waiting{model_name=\"llama-3-70b\",engine=\"0\"} 0\n";

/// nginx's role in the run.
enum Nginx<'a> {
    /// A plain reverse proxy to this upstream, with as many workers as Sluice has threads.
    Proxy(&'a str),
    /// The instant backend: fixed answers, one worker.
    Backend,
}

fn nginx_conf(prefix: &Path, listen: &str, role: &Nginx<'_>) -> String {
    let p = prefix.display();
    let (workers, body) = match role {
        Nginx::Proxy(upstream) => (
            THREADS,
            format!(
                "  upstream backend {{ server {upstream}; keepalive 256; }}\n  \
                 server {{\n    listen {listen};\n    location / {{\n      proxy_pass http://backend;\n      \
                 proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n"
            ),
        ),
        Nginx::Backend => (
            1,
            format!(
                "  server {{\n    listen {listen};\n    keepalive_requests 1000000;\n    \
                 location = /health {{ return 200; }}\n    \
                 location = /metrics {{ default_type text/plain; return 200 '{}'; }}\n    \
                 location / {{ default_type application/json; return 200 '{}'; }}\n  }}\n",
                STATIC_METRICS.replace('\n', "\\n"),
                STATIC_COMPLETION
            ),
        ),
    };
    format!(
        "worker_processes {workers};\ndaemon off;\npid {p}/nginx.pid;\nerror_log {p}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n  \
         fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n{body}}}\n"
    )
}

fn start_nginx(dir: &Path, name: &str, role: &Nginx<'_>) -> Result<Proc, String> {
    let prefix = dir.join(name);
    std::fs::create_dir_all(&prefix).map_err(|e| e.to_string())?;
    let listen = procs::free_addr()?;
    let conf = prefix.join("nginx.conf");
    std::fs::write(&conf, nginx_conf(&prefix, &listen, role)).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("nginx");
    cmd.arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(&conf)
        .arg("-e")
        .arg(prefix.join("error.log"));
    Proc::spawn(name, &mut cmd, listen, Some(prefix.join("stderr.log")))
}

fn wrk(url: &str, conns: u32, secs: u64, script: &Path) -> Result<WrkResult, String> {
    let threads = conns.clamp(1, THREADS);
    let out = Command::new("wrk")
        .args([
            format!("-t{threads}"),
            format!("-c{conns}"),
            format!("-d{secs}s"),
            "--latency".into(),
            "-s".into(),
        ])
        .arg(script)
        .arg(url)
        .output()
        .map_err(|e| format!("cannot run wrk: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_wrk(&text).ok_or_else(|| {
        format!(
            "unreadable wrk output: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

pub async fn run(
    common: &Common,
    secs: u64,
    rounds: u32,
    conns: &[u32],
    flamegraphs: Option<&Path>,
) -> Result<(), String> {
    if flamegraphs.is_some() {
        flame::check_tools()?;
    }
    for tool in ["wrk", "nginx"] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| !o.status.success())
            .unwrap_or(true)
        {
            return Err(format!(
                "{tool} is required for the overhead bench (apt-get install {tool})"
            ));
        }
    }
    let env = Environment::capture();
    let bin = procs::sluice_bin(common.sluice_bin.as_deref())?;
    let wd = WorkDir::new("overhead")?;
    let c = procs::client();
    // The simulator rounds even zero delays up to tokio's 1 ms timer tick (about 2 ms a
    // request), which would hide the proxies' cost; a static nginx answers in microseconds.
    let mut od = start_nginx(&wd.path, "backend-on-demand", &Nginx::Backend)?;
    od.wait_ok("/health", Duration::from_secs(10)).await?;
    let mut spot = start_nginx(&wd.path, "backend-spot", &Nginx::Backend)?;
    spot.wait_ok("/health", Duration::from_secs(10)).await?;
    let script = wd.path.join("chat.lua");
    std::fs::write(&script, WRK_SCRIPT).map_err(|e| e.to_string())?;
    let path = "/v1/chat/completions";

    let mut targets = vec![Target {
        name: "direct",
        url: od.url(path),
        skipped: None,
        process: None,
    }];
    let mut nginx = start_nginx(&wd.path, "nginx-proxy", &Nginx::Proxy(&od.addr))?;
    nginx.wait_ok("/health", Duration::from_secs(10)).await?;
    targets.push(Target {
        name: "nginx",
        url: nginx.url(path),
        skipped: None,
        process: None,
    });
    let bare_dir = wd.path.join("pingora");
    std::fs::create_dir_all(&bare_dir).map_err(|e| e.to_string())?;
    let bare = procs::start_bare_pingora(&od.addr, THREADS, &bare_dir).await?;
    targets.push(Target {
        name: "pingora (bare)",
        url: bare.url(path),
        skipped: None,
        process: Some(bare),
    });
    let otlp = OtlpSink::start().await?;
    // The tracing targets right after plain Sluice: their ratios to it are the point, and the
    // ledger's PostgreSQL work (writeback after its runs) must not land on them alone.
    for (name, extras) in [
        (UNTRACED, Extras::None),
        (TRACED, Extras::Tracing),
        (TRACING_OFF, Extras::TracingOff),
        ("sluice + ledger", Extras::Ledger),
        ("sluice + ledger + redis", Extras::LedgerAndRedis),
    ] {
        let dir = wd.path.join(name.replace([' ', '+', '%'], ""));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let cfg = sluice_config(
            &procs::free_addr()?,
            &od.addr,
            &spot.addr,
            &dir,
            extras,
            &otlp.endpoint(),
        );
        match start_with(&bin, &cfg, &dir, &c, extras).await {
            Ok(s) => targets.push(Target {
                name,
                url: s.url(path),
                skipped: None,
                process: Some(s),
            }),
            Err(e) => {
                eprintln!("sluice-bench: {name} not measured: {e}");
                targets.push(Target {
                    name,
                    url: String::new(),
                    skipped: Some(e),
                    process: None,
                })
            }
        }
    }

    // Warm every connection pool once so the first measured run is not the cold one.
    for t in targets.iter().filter(|t| t.skipped.is_none()) {
        let _ = wrk(&t.url, 16, 1, &script);
    }
    // Each round measures every target once, in the same order, so a slow spell of the shared
    // machine lands on one round's targets alike instead of on one target's runs.
    let rounds = rounds.max(1);
    let mut rounds_rows: Vec<Vec<Row>> = Vec::new();
    let mut steal = Vec::new();
    let mut cpu: Vec<CpuUse> = Vec::new();
    for round in 1..=rounds {
        let before = CpuTicks::read();
        let mut rows: Vec<Row> = Vec::new();
        for &n in conns {
            for t in &targets {
                let r = match &t.skipped {
                    Some(e) => Err(e.clone()),
                    None => {
                        eprintln!(
                            "sluice-bench: round {round}/{rounds}: wrk {} connections → {} ({secs} s)",
                            n, t.name
                        );
                        // The Sluice targets' own CPU, and this process's (the stand-in
                        // collector's), over the run.
                        let pid = t
                            .process
                            .as_ref()
                            .filter(|_| t.name.starts_with("sluice"))
                            .map(Proc::pid);
                        let start = pid
                            .and_then(|p| cpu_seconds(Some(p)))
                            .zip(cpu_seconds(None));
                        let r = wrk(&t.url, n, secs, &script);
                        let end = pid
                            .and_then(|p| cpu_seconds(Some(p)))
                            .zip(cpu_seconds(None));
                        if let (Some((p0, h0)), Some((p1, h1)), Ok(w)) = (start, end, &r) {
                            cpu.push(CpuUse {
                                conns: n,
                                target: t.name,
                                proxy_us_per_request: (p1 - p0) * 1e6
                                    / (w.rps * secs as f64).max(1.0),
                                harness_cores: (h1 - h0) / secs as f64,
                            });
                        }
                        r
                    }
                };
                rows.push((n, t.name, r));
            }
        }
        rounds_rows.push(rows);
        steal.push(
            before
                .zip(CpuTicks::read())
                .map(|(b, a)| a.steal_share_since(&b)),
        );
    }
    let rows = median_rows(&rounds_rows);
    let mut own = Vec::new();
    let mut spans = None;
    for t in &targets {
        if let Some(p) = t.process.as_ref().filter(|_| t.name.starts_with("sluice")) {
            let (_, body) = procs::request(&c, "GET", &p.ops_url("/metrics"), None).await?;
            let text = String::from_utf8_lossy(&body);
            if t.name == TRACED {
                spans = Some(trace_spans(&text));
            }
            if let Some((n, p50, p99)) =
                report::histogram_quantiles(&text, "sluice_proxy_overhead_seconds")
            {
                own.push(format!(
                    "{}: {n:.0} requests, p50 {:.1} µs, p99 {:.1} µs",
                    t.name,
                    p50 * 1e6,
                    p99 * 1e6
                ));
            }
        }
    }
    let mut md = table(&rows, conns);
    if rounds_rows.len() > 1 {
        md.push_str(&format!(
            "\nEach row is the median of {} rounds (req/s, p50 and p99 each). Sluice's req/s ÷ bare Pingora's in each round:\n\n",
            rounds_rows.len()
        ));
        md.push_str(&spread_table(&rounds_rows, conns));
    }
    md.push_str(&steal_line(&steal));
    let tracing_md = tracing_section(
        &rounds_rows,
        &cpu,
        conns,
        spans.as_ref(),
        otlp.seen(),
        secs,
        rounds,
    );
    md.push_str(&tracing_md);
    println!("{md}");
    if targets
        .iter()
        .any(|t| t.name == TRACED && t.skipped.is_none())
    {
        let path = common.out.join("overhead-tracing.md");
        let mut file = String::from("## Request-path overhead of distributed tracing\n\n");
        let _ = writeln!(file, "Command: `{}`  \n{}\n", command_line(), env.line());
        file.push_str(&table(&rows, conns));
        if rounds_rows.len() > 1 {
            let _ = writeln!(
                file,
                "\nEach row is the median of {} rounds. Sluice's req/s ÷ bare Pingora's in each round:\n",
                rounds_rows.len()
            );
            file.push_str(&spread_table(&rounds_rows, conns));
        }
        file.push_str(&steal_line(&steal));
        file.push_str(&tracing_md);
        std::fs::create_dir_all(&common.out)
            .map_err(|e| format!("{}: {e}", common.out.display()))?;
        std::fs::write(&path, file).map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("sluice-bench: wrote {}", path.display());
    }
    if let Some(dir) = flamegraphs {
        flame_runs(&targets, dir, secs, &script, &wd.path)?;
    }
    let mut section = String::new();
    section.push_str("## Proxy overhead against nginx\n\n");
    let _ = writeln!(
        section,
        "Command: `target/release/sluice-bench overhead --seconds {secs} --rounds {rounds}` (also part of `bench/run.sh`)  \n{}\n",
        env.line()
    );
    let _ = writeln!(
        section,
        "wrk ({} threads at most, `bench/chat.lua`: a 1-token chat completion from a Guaranteed tenant) \
         against a backend that answers instantly: a static nginx (one worker) returning a fixed \
         1-token completion, `/health` and a vLLM `/metrics` text (`sluice sim` with zero delays \
         still takes about 2 ms a request, its timer tick). Targets: that backend \
         directly; nginx {} as a plain reverse proxy (our own instance, {THREADS} workers, upstream \
         keepalive, buffering off, no access log); the smallest Pingora proxy (`sluice-bench \
         bare-proxy`: one upstream, no filters, {THREADS} threads, the same allocator), which shows \
         what Pingora itself costs here; Sluice ({THREADS} threads, the shipped log level: one JSON \
         line per request to a file) with the full policy pipeline and in-process admission; the \
         same with the PostgreSQL decision ledger (`{LEDGER_URL}`, schema `sluice_bench`); and with \
         the ledger and Redis admission (`{REDIS_URL}`, prefix `sluice-bench`). Everything — wrk, \
         backend, proxy — shares the machine's cores, so absolute numbers are low and noisy; the \
         ratios measured in the same run are the point; the two tracing targets are described \
         under \"Tracing\" below. *Added* is the target's latency minus direct's at the same \
         concurrency.\n",
        THREADS,
        nginx_version()
    );
    section.push_str(&md);
    if !own.is_empty() {
        section.push_str("\nSluice's own `sluice_proxy_overhead_seconds` over all the runs above (arrival → upstream chosen):\n\n");
        for o in own {
            let _ = writeln!(section, "- {o}");
        }
    }
    let _ = writeln!(section, "\nLoad after the runs: {}", results::uptime());
    if let Some(path) = &common.results_md {
        results::update_section(path, "overhead", &section)?;
    }
    drop(targets);
    drop(nginx);
    drop(spot);
    drop(od);
    Ok(())
}

/// Connections of the recorded run: the issue-13 table's first column.
const FLAME_CONNS: u32 = 16;

/// The file name of a target's flame graph.
fn flame_stem(target: &str) -> String {
    match target {
        "pingora (bare)" => "pingora-bare".into(),
        other => other.replace(" + ", "-").replace(' ', "-"),
    }
}

/// Frame families compared across the graphs in SHARES.md: each is the share of the proxy's
/// samples whose stack holds a frame containing one of the substrings.
const FAMILIES: &[(&str, &[&str])] = &[
    (
        "every ProxyHttp hook of the proxy",
        &[
            "<sluice_proxy::Sluice as pingora_proxy::proxy_trait::ProxyHttp>::",
            "<sluice_bench::bare::Bare as pingora_proxy::proxy_trait::ProxyHttp>::",
        ],
    ),
    ("request_filter", &["ProxyHttp>::request_filter"]),
    (
        "· admission (decide_and_admit)",
        &["sluice_proxy::admit::decide_and_admit"],
    ),
    (
        "· request body facts (shaping::facts)",
        &["sluice_proxy::shaping::facts"],
    ),
    ("upstream_peer", &["ProxyHttp>::upstream_peer"]),
    (
        "upstream_request_filter",
        &["ProxyHttp>::upstream_request_filter"],
    ),
    ("response_filter", &["ProxyHttp>::response_filter"]),
    (
        "· decision headers (respond::decision_headers)",
        &["sluice_proxy::respond::decision_headers"],
    ),
    (
        "response_body_filter",
        &["ProxyHttp>::response_body_filter"],
    ),
    ("logging hook", &["ProxyHttp>::logging"]),
    ("· outcome::logging", &["sluice_proxy::outcome::logging"]),
    (
        "· json_line (the log line, ledger inputs)",
        &["sluice_record::line::"],
    ),
    (
        "header inserts, Pingora's and Sluice's",
        &["insert_header", "append_header"],
    ),
    ("log writer thread (sluice-log)", &["sluice-log;"]),
    ("ledger (any sluice_ledger frame)", &["sluice_ledger::"]),
    ("redis (any redis:: frame)", &["redis::"]),
    ("metrics (prometheus)", &["prometheus::"]),
    ("malloc/free (mimalloc)", &["mi_malloc", "mi_free", "_mi_"]),
    ("kernel (syscalls)", &["entry_SYSCALL_64"]),
];

/// One more wrk run per proxy at 16 connections, each recorded by perf, drawn by inferno.
fn flame_runs(
    targets: &[Target],
    dir: &Path,
    secs: u64,
    script: &Path,
    work: &Path,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Flame-graph shares\n\n`sluice-bench overhead --flamegraphs {}` (bench/flamegraphs.sh): \
         `perf record -e cpu-clock -F 999 --call-graph {}` of each proxy process during one \
         {secs} s wrk run at {FLAME_CONNS} connections. Percentages are of the proxy's own samples \
         (every thread; idle time is not sampled). \"Inclusive\": the sample's stack holds the \
         frame. Inlined functions are part of their caller.\n",
        dir.display(),
        flame::call_graph_mode()
    );
    let mut compare: Vec<(String, u64, f64, std::collections::BTreeMap<String, f64>)> = Vec::new();
    for t in targets {
        let Some(p) = t.process.as_ref().filter(|_| t.skipped.is_none()) else {
            continue;
        };
        let stem = flame_stem(t.name);
        eprintln!(
            "sluice-bench: perf record {} during wrk {FLAME_CONNS} connections ({secs} s)",
            t.name
        );
        let rec = flame::Recording::start(p.pid(), &work.join(format!("{stem}.perf.data")))?;
        let r = wrk(&t.url, FLAME_CONNS, secs, script);
        let data = rec.stop()?;
        let rps = r.map(|r| r.rps).unwrap_or(0.0);
        eprintln!(
            "sluice-bench: folding {} ({rps:.0} req/s under perf)",
            t.name
        );
        let folded = flame::fold(&data)?;
        let _ = std::fs::remove_file(&data);
        let title = format!(
            "{} — wrk {FLAME_CONNS} connections, {secs} s, {rps:.0} req/s under perf (cpu-clock 999 Hz, {})",
            t.name,
            flame::call_graph_mode()
        );
        let svg = dir.join(format!("{stem}.svg"));
        flame::draw(&folded, &title, &svg)?;
        flame::write_gz(&folded, &dir.join(format!("{stem}.folded.gz")))?;
        let s = flame::shares(&folded, flame::is_own_frame);
        md.push_str(&flame::summary(t.name, &s, 25));
        compare.push((
            t.name.to_string(),
            s.total,
            rps,
            flame::family_shares(&folded, FAMILIES),
        ));
        eprintln!("sluice-bench: wrote {}", svg.display());
    }
    let _ = write!(
        md,
        "## Compared\n\nEach cell: the share of the proxy's samples whose stack holds such a frame, \
         and that share of its CPU per request (µs).\n\n| frames |"
    );
    for (name, ..) in &compare {
        let _ = write!(md, " {name} |");
    }
    let _ = write!(
        md,
        "\n|---|{}\n| CPU recorded |",
        "---|".repeat(compare.len())
    );
    for (_, total, ..) in &compare {
        let _ = write!(md, " {:.0} ms |", *total as f64 / 1e6);
    }
    md.push_str("\n| req/s under perf |");
    for (_, _, rps, _) in &compare {
        let _ = write!(md, " {rps:.0} |");
    }
    // CPU per request: the recorded CPU over the requests wrk completed (rate × duration).
    let per_req = |total: u64, rps: f64| total as f64 / 1e3 / (rps * secs as f64).max(1.0);
    md.push_str("\n| CPU per request |");
    for (_, total, rps, _) in &compare {
        let _ = write!(md, " {:.1} µs |", per_req(*total, *rps));
    }
    md.push('\n');
    for (family, _) in FAMILIES {
        let _ = write!(md, "| {family} |");
        for (_, total, rps, f) in &compare {
            let pct = f.get(*family).copied().unwrap_or(0.0);
            let _ = write!(
                md,
                " {pct:.1} % · {:.1} µs |",
                pct / 100.0 * per_req(*total, *rps)
            );
        }
        md.push('\n');
    }
    let path = dir.join("SHARES.md");
    std::fs::write(&path, &md).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("{md}");
    Ok(())
}

/// The command as run, for the results file.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("target/release/sluice-bench {}", args.join(" "))
}

/// `sluice_trace_spans_total` by outcome (exported, dropped, failed).
fn trace_spans(metrics: &str) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("sluice_trace_spans_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let outcome = labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == "outcome").then(|| v.trim().trim_matches('"').to_string())
        });
        if let (Some(o), Ok(v)) = (outcome, value.trim().parse::<f64>()) {
            *out.entry(o).or_default() += v as u64;
        }
    }
    out
}

/// A Sluice target's CPU over one wrk run.
struct CpuUse {
    conns: u32,
    target: &'static str,
    /// The proxy process's user + system CPU over the requests wrk completed.
    proxy_us_per_request: f64,
    /// This harness process's CPU (the stand-in OTLP collector; wrk is a child, not counted)
    /// in cores over the run.
    harness_cores: f64,
}

/// User + system CPU seconds of a process (`None`: this one), from `/proc/<pid>/stat`.
fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = pid.map_or("/proc/self/stat".to_string(), |p| format!("/proc/{p}/stat"));
    let stat = std::fs::read_to_string(path).ok()?;
    // After the command name (in parentheses, which may hold spaces): state is field 3, utime
    // and stime fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// One target's wrk result in a round.
fn found<'a>(rows: &'a [Row], n: u32, name: &str) -> Option<&'a WrkResult> {
    rows.iter()
        .find(|r| r.0 == n && r.1 == name)
        .and_then(|r| r.2.as_ref().ok())
}

/// The tracing targets against plain Sluice (tracing off), round by round: req/s ratios with
/// their medians, the added latency, the issue's targets, and what was exported.
fn tracing_section(
    rounds: &[Vec<Row>],
    cpu: &[CpuUse],
    conns: &[u32],
    spans: Option<&std::collections::BTreeMap<String, u64>>,
    (posts, bytes): (u64, u64),
    secs: u64,
    n_rounds: u32,
) -> String {
    let mut s = String::new();
    let measured = rounds
        .iter()
        .any(|rows| rows.iter().any(|r| r.1 == TRACED && r.2.is_ok()));
    if !measured {
        return s;
    }
    let _ = writeln!(
        s,
        "\n### Tracing\n\n`{TRACED}`: `telemetry.tracing` on with the shipped sampler \
         (`parentbased_traceidratio`, ratio 1: wrk sends no `traceparent`, so every request starts \
         a sampled trace: a SERVER span and a CLIENT span per upstream attempt) and the shipped \
         export settings, exporting OTLP/HTTP protobuf to a stand-in collector inside the harness \
         (reads each POST whole and answers 200 without decoding; on the same 2 cores). \
         `{TRACING_OFF}`: the same block with `enabled: false`. `{UNTRACED}`: no tracing block \
         (off, the default). Ratios are req/s within the same round ({n_rounds} rounds of {secs} s \
         per target); added latency is the per-round-median p50 / p99 minus `{UNTRACED}`'s.\n"
    );
    let _ = writeln!(
        s,
        "| connections | traced ÷ off, per round | median | added p50 / p99 traced | configured off ÷ off, per round | median | {UNTRACED} ÷ bare Pingora, median |\n|---|---|---|---|---|---|---|"
    );
    let mut verdicts = Vec::new();
    for &n in conns {
        let ratios = |name: &str, base: &str| -> Vec<f64> {
            rounds
                .iter()
                .filter_map(|rows| {
                    let b = found(rows, n, base).filter(|b| b.rps > 0.0)?;
                    Some(found(rows, n, name)?.rps / b.rps)
                })
                .collect()
        };
        let each = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let med = |v: &[f64]| {
            if v.is_empty() {
                "–".to_string()
            } else {
                format!("{:.3}×", median(v.to_vec()))
            }
        };
        let traced = ratios(TRACED, UNTRACED);
        let off = ratios(TRACING_OFF, UNTRACED);
        let vs_bare = ratios(UNTRACED, "pingora (bare)");
        let lat = |name: &str, f: fn(&WrkResult) -> f64| {
            median(
                rounds
                    .iter()
                    .filter_map(|rows| found(rows, n, name).map(f))
                    .collect(),
            )
        };
        let added = format!(
            "{:+.3} / {:+.3} ms",
            lat(TRACED, |r| r.p50_ms) - lat(UNTRACED, |r| r.p50_ms),
            lat(TRACED, |r| r.p99_ms) - lat(UNTRACED, |r| r.p99_ms)
        );
        let _ = writeln!(
            s,
            "| {n} | {} | {} | {added} | {} | {} | {} |",
            each(&traced),
            med(&traced),
            each(&off),
            med(&off),
            med(&vs_bare)
        );
        if !traced.is_empty() {
            let m = median(traced.clone());
            verdicts.push(format!(
                "- {n} connections: **{}** sampling 100 % within 10 % of off (median traced ÷ off {m:.3} ≥ 0.90)",
                if m >= 0.90 { "PASS" } else { "FAIL" }
            ));
        }
        if !off.is_empty() {
            let m = median(off.clone());
            verdicts.push(format!(
                "- {n} connections: **{}** tracing configured off costs nothing measurable (median configured off ÷ off {m:.3}, within ±5 %)",
                if (m - 1.0).abs() <= 0.05 { "PASS" } else { "FAIL" }
            ));
        }
    }
    let _ = writeln!(
        s,
        "\nThe proxy's own CPU per request (user + system of its process over a run ÷ the requests \
         wrk completed; less exposed to the machine's drift than req/s, since wrk, the backend and \
         the proxy share 2 cores), per round and median, and the stand-in collector's CPU (this \
         harness process) during the run:\n\n\
         | connections | target | proxy CPU µs/request, per round | median | ÷ `{UNTRACED}`'s | collector, cores |\n|---|---|---|---|---|---|"
    );
    for &n in conns {
        let of = |name: &str| -> Vec<&CpuUse> {
            cpu.iter()
                .filter(|c| c.conns == n && c.target == name)
                .collect()
        };
        let base = median(
            of(UNTRACED)
                .iter()
                .map(|c| c.proxy_us_per_request)
                .collect(),
        );
        for name in [UNTRACED, TRACED, TRACING_OFF] {
            let v = of(name);
            if v.is_empty() {
                continue;
            }
            let each: Vec<String> = v
                .iter()
                .map(|c| format!("{:.1}", c.proxy_us_per_request))
                .collect();
            let m = median(v.iter().map(|c| c.proxy_us_per_request).collect());
            let _ = writeln!(
                s,
                "| {n} | {name} | {} | {m:.1} | {:.2}× | {:.2} |",
                each.join(" "),
                m / base,
                median(v.iter().map(|c| c.harness_cores).collect())
            );
        }
    }
    let _ = writeln!(s, "\nTargets:\n\n{}", verdicts.join("\n"));
    if let Some(spans) = spans {
        let by: Vec<String> = spans.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            s,
            "\nThe traced Sluice's `sluice_trace_spans_total` over all its runs (warm-up included): {}; \
             the collector received {posts} POSTs, {:.1} MB.",
            if by.is_empty() { "none".to_string() } else { by.join(", ") },
            bytes as f64 / 1e6
        );
    }
    s
}

fn nginx_version() -> String {
    Command::new("nginx")
        .arg("-v")
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(&o.stderr)
                .trim()
                .replace("nginx version: ", "")
        })
        .unwrap_or_default()
}

/// One measurement: connections, target, what wrk saw.
type Row = (u32, &'static str, Result<WrkResult, String>);

/// The machine's CPU ticks from `/proc/stat`: a virtual machine's host can take a share of its
/// cores (steal), which moves every req/s here as much as a change to the proxy does.
#[derive(Debug, Clone, Copy, PartialEq)]
struct CpuTicks {
    steal: u64,
    total: u64,
}

impl CpuTicks {
    fn read() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The aggregate `cpu` line: user nice system idle iowait irq softirq steal ...
    fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        Some(Self {
            steal: *v.get(7)?,
            total: v.iter().sum(),
        })
    }

    fn steal_share_since(&self, before: &Self) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            return 0.0;
        }
        self.steal.saturating_sub(before.steal) as f64 / total as f64
    }
}

/// Each round's steal share, so a round the host slowed can be told from a slower proxy.
fn steal_line(steal: &[Option<f64>]) -> String {
    let each: Vec<String> = steal
        .iter()
        .map(|s| s.map_or("?".into(), |s| format!("{:.0} %", s * 100.0)))
        .collect();
    format!(
        "\nCPU taken by the virtual machine's host (steal, `/proc/stat`) in each round: {}.\n",
        each.join(" · ")
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Every round's rows in the same order, folded into one row per (connections, target): the
/// median of each figure over the rounds that measured it, the failures summed; a target no
/// round measured keeps the first round's error.
fn median_rows(rounds: &[Vec<Row>]) -> Vec<Row> {
    let Some(first) = rounds.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, (n, name, first_result))| {
            let ok: Vec<&WrkResult> = rounds
                .iter()
                .filter_map(|r| r.get(i).and_then(|row| row.2.as_ref().ok()))
                .collect();
            if ok.is_empty() {
                return (*n, *name, first_result.clone());
            }
            let m = |f: fn(&WrkResult) -> f64| median(ok.iter().map(|r| f(r)).collect());
            let result = WrkResult {
                rps: m(|r| r.rps),
                p50_ms: m(|r| r.p50_ms),
                p99_ms: m(|r| r.p99_ms),
                non_2xx: ok.iter().map(|r| r.non_2xx).sum(),
                errors: ok.iter().map(|r| r.errors).sum(),
            };
            (*n, *name, Ok(result))
        })
        .collect()
}

/// Each Sluice target's req/s ÷ bare Pingora's within every round, and their median: how far
/// the ratio moves from one round to the next on this machine.
fn spread_table(rounds: &[Vec<Row>], conns: &[u32]) -> String {
    let mut s = String::from("| connections | target | per round | median |\n|---|---|---|---|\n");
    let rps = |rows: &[Row], n: u32, name: &str| {
        rows.iter()
            .find(|r| r.0 == n && r.1 == name)
            .and_then(|r| r.2.as_ref().ok())
            .map(|r| r.rps)
    };
    let Some(first) = rounds.first() else {
        return s;
    };
    for &n in conns {
        for (_, name, _) in first
            .iter()
            .filter(|r| r.0 == n && r.1.starts_with("sluice"))
        {
            let ratios: Vec<f64> = rounds
                .iter()
                .filter_map(|rows| {
                    let bare = rps(rows, n, "pingora (bare)").filter(|b| *b > 0.0)?;
                    Some(rps(rows, n, name)? / bare)
                })
                .collect();
            if ratios.is_empty() {
                continue;
            }
            let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
            let _ = writeln!(
                s,
                "| {n} | {name} | {} | {:.2}× |",
                each.join(" "),
                median(ratios.clone())
            );
        }
    }
    s
}

fn table(rows: &[Row], conns: &[u32]) -> String {
    let mut s = String::new();
    s.push_str("| connections | target | req/s | p50 | p99 | added p50 | added p99 | added p50 ÷ nginx's | req/s ÷ nginx's | req/s ÷ bare Pingora's |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|\n");
    for &n in conns {
        let get = |name: &str| {
            rows.iter()
                .find(|r| r.0 == n && r.1 == name)
                .and_then(|r| r.2.as_ref().ok())
        };
        let direct = get("direct");
        let nginx = get("nginx");
        let bare = get("pingora (bare)");
        for (_, name, r) in rows.iter().filter(|r| r.0 == n) {
            match r {
                Err(e) => {
                    let _ = writeln!(
                        s,
                        "| {n} | {name} | not measured: {} | | | | | | | |",
                        e.replace('|', "/").lines().next().unwrap_or("")
                    );
                }
                Ok(r) => {
                    let added = |f: fn(&WrkResult) -> f64| direct.map(|d| f(r) - f(d));
                    let a50 = added(|x| x.p50_ms);
                    let a99 = added(|x| x.p99_ms);
                    let n50 = nginx.zip(direct).map(|(g, d)| g.p50_ms - d.p50_ms);
                    let ratio = match (*name, a50, n50) {
                        ("direct", _, _) | ("nginx", _, _) => "".into(),
                        (_, Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
                        _ => "–".into(),
                    };
                    let tput = match (*name, nginx) {
                        ("direct", _) | ("nginx", _) => "".into(),
                        (_, Some(g)) if g.rps > 0.0 => format!("{:.2}×", r.rps / g.rps),
                        _ => "–".into(),
                    };
                    let vs_bare = match (*name, bare) {
                        (n, Some(b)) if n.starts_with("sluice") && b.rps > 0.0 => {
                            format!("{:.2}×", r.rps / b.rps)
                        }
                        _ => "".into(),
                    };
                    let fmt_added = |v: Option<f64>| {
                        if *name == "direct" {
                            String::new()
                        } else {
                            v.map_or("–".into(), |x| format!("{x:+.3} ms"))
                        }
                    };
                    let bad = if r.non_2xx + r.errors > 0 {
                        format!(" ({} non-2xx, {} socket errors)", r.non_2xx, r.errors)
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        s,
                        "| {n} | {name}{bad} | {:.0} | {:.3} ms | {:.3} ms | {} | {} | {ratio} | {tput} | {vs_bare} |",
                        r.rps,
                        r.p50_ms,
                        r.p99_ms,
                        fmt_added(a50),
                        fmt_added(a99),
                    );
                }
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wrk_result(rps: f64, p50_ms: f64, errors: u64) -> Result<WrkResult, String> {
        Ok(WrkResult {
            rps,
            p50_ms,
            p99_ms: p50_ms * 4.0,
            non_2xx: 0,
            errors,
        })
    }

    #[test]
    fn steal_is_read_from_the_cpu_line_and_shared_over_all_ticks() {
        let before = CpuTicks::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3 4 5 6 7 8\n");
        assert_eq!(
            before,
            Some(CpuTicks {
                steal: 35,
                total: 1000
            })
        );
        let after = CpuTicks::parse("cpu  200 0 100 1400 10 0 5 285 0 0\n").unwrap();
        // 250 of the 1000 ticks in between were stolen.
        assert!((after.steal_share_since(&before.unwrap()) - 0.25).abs() < 1e-9);
        assert_eq!(CpuTicks::parse("intr 1 2 3\n"), None);
        assert_eq!(
            steal_line(&[Some(0.031), None]),
            "\nCPU taken by the virtual machine's host (steal, `/proc/stat`) in each round: 3 % · ?.\n"
        );
    }

    #[test]
    fn rounds_fold_into_medians_and_per_round_ratios() {
        let round = |bare: f64, sluice: f64, errors: u64| -> Vec<Row> {
            vec![
                (16, "pingora (bare)", wrk_result(bare, 0.5, 0)),
                (16, "sluice", wrk_result(sluice, 0.7, errors)),
                (16, "sluice + ledger", Err("no database".into())),
            ]
        };
        let rounds = vec![
            round(30000.0, 24000.0, 0),
            round(20000.0, 19000.0, 2),
            round(32000.0, 25600.0, 1),
        ];
        let rows = median_rows(&rounds);
        let sluice = rows[1].2.as_ref().unwrap();
        assert_eq!(sluice.rps, 24000.0);
        assert_eq!(sluice.errors, 3);
        assert_eq!(rows[0].2.as_ref().unwrap().rps, 30000.0);
        assert_eq!(rows[2].2, Err("no database".into()));
        let spread = spread_table(&rounds, &[16]);
        assert!(
            spread.contains("| 16 | sluice | 0.80 0.95 0.80 | 0.80× |"),
            "{spread}"
        );
        assert!(!spread.contains("sluice + ledger |"), "{spread}");
    }

    #[test]
    fn trace_spans_and_own_cpu_are_read() {
        let m = "# TYPE sluice_trace_spans_total counter\n\
                 sluice_trace_spans_total{outcome=\"exported\"} 1200\n\
                 sluice_trace_spans_total{outcome=\"dropped\"} 3\n\
                 sluice_trace_spans_totalx{outcome=\"failed\"} 9\n";
        let s = trace_spans(m);
        assert_eq!(s.get("exported"), Some(&1200));
        assert_eq!(s.get("dropped"), Some(&3));
        assert_eq!(s.len(), 2);
        assert!(cpu_seconds(None).is_some_and(|c| c >= 0.0));
    }

    #[test]
    fn the_tracing_section_compares_within_each_round() {
        let round = |off: f64, traced: f64, conf: f64| -> Vec<Row> {
            vec![
                (16, "pingora (bare)", wrk_result(20000.0, 0.5, 0)),
                (16, UNTRACED, wrk_result(off, 0.6, 0)),
                (16, TRACED, wrk_result(traced, 0.7, 0)),
                (16, TRACING_OFF, wrk_result(conf, 0.6, 0)),
            ]
        };
        let rounds = vec![
            round(18000.0, 16920.0, 18000.0),
            round(12000.0, 11400.0, 12120.0),
        ];
        let s = tracing_section(&rounds, &[], &[16], None, (0, 0), 5, 2);
        assert!(s.contains("| 16 | 0.940 0.950 | 0.945× |"), "{s}");
        assert!(s.contains("**PASS** sampling 100 %"), "{s}");
        assert!(tracing_section(&[], &[], &[16], None, (0, 0), 5, 1).is_empty());
    }

    #[test]
    fn parses_wrk_latency_output() {
        let out = "Running 8s test @ http://127.0.0.1:1/v1/chat/completions\n  2 threads and 16 connections\n  Thread Stats   Avg      Stdev     Max   +/- Stdev\n    Latency     2.44ms  312.00us   9.11ms   80.00%\n  Latency Distribution\n     50%  812.00us\n     75%    2.60ms\n     90%    2.90ms\n     99%    1.02s\n  52941 requests in 8.00s, 30.00MB read\n  Socket errors: connect 0, read 2, write 0, timeout 1\n  Non-2xx or 3xx responses: 12\nRequests/sec:   6617.78\nTransfer/sec:      3.75MB\n";
        let r = parse_wrk(out).unwrap();
        assert!((r.p50_ms - 0.812).abs() < 1e-9);
        assert!((r.p99_ms - 1020.0).abs() < 1e-9);
        assert!((r.rps - 6617.78).abs() < 1e-9);
        assert_eq!((r.non_2xx, r.errors), (12, 3));
        assert!(parse_wrk("garbage").is_none());
    }

    #[test]
    fn nginx_conf_keeps_everything_under_the_prefix() {
        let conf = nginx_conf(
            Path::new("/tmp/x"),
            "127.0.0.1:9",
            &Nginx::Proxy("127.0.0.1:8"),
        );
        assert!(conf.contains("pid /tmp/x/nginx.pid;"));
        assert!(conf.contains("listen 127.0.0.1:9;"));
        assert!(conf.contains("server 127.0.0.1:8;"));
        assert!(!conf.contains("/var/"));
        let backend = nginx_conf(Path::new("/tmp/x"), "127.0.0.1:7", &Nginx::Backend);
        assert!(backend.contains("worker_processes 1;"));
        assert!(backend.contains(r#""completion_tokens":1"#));
        // nginx sees the metrics text with escaped newlines inside one quoted string.
        assert!(backend.contains(r"0.1\nvllm:num_requests_waiting"));
    }
}
