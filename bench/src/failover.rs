//! `sluice-bench failover`: what a client sees while replicas die, live. Two `sluice sim`
//! replicas of `llama-3-70b` in the on-demand pool, a real `sluice serve` on the shipped
//! `conf/sluice.yaml` with only its addresses and pools changed (so failover, the retry budget
//! and passive ejection act with their shipped defaults), open-loop load from the harness.
//!
//! Two scenarios, each on fresh processes:
//!
//! - `replica-loss`: od-0 is SIGKILLed, restarted on its port, then od-1 answers 503
//!   (`PUT /admin/fail` mode `unavailable`, its `/health` 503 too) for a while. The only
//!   requests allowed to fail are the streams the kill cut after their response head reached the
//!   client; no request may be retried once a byte of its answer went out.
//! - `fleet-503`: both replicas answer 503 at once; the retry budget must keep the upstream
//!   attempts within requests × (1 + ratio) + min_retries.
//!
//! What Sluice did is read from its own outputs: `/status` polled every 250 ms (health,
//! ejections, the retry budget's window), `/metrics` at the end (retries by cause), and its log
//! (one `upstream_retry` line per retry, the decision record of every request with its
//! `attempts`, `tried` and `backend`). The simulators' `/admin/stats` count the attempts they
//! received.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::{json, Value};
use sluice_policy::Tier;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use crate::procs::{self, HttpClient, Proc, WorkDir};
use crate::report::percentile;

const MODEL: &str = "llama-3-70b";
const POOL: &str = "on-demand";
/// An answer not finished by then counts as failed (status 0 when nothing came).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const POLL_EVERY: Duration = Duration::from_millis(250);
/// The tenants of `conf/tenants.yaml` the load alternates between.
const TENANTS: [(&str, Tier); 2] = [
    ("support-bot", Tier::Guaranteed),
    ("coding-assistant", Tier::Standard),
];
/// A stream counts as cut by the kill when it ended within this long after it.
const CUT_WINDOW_MS: f64 = 2000.0;

#[derive(clap::Args, Clone, Debug)]
pub struct FailoverArgs {
    /// The `sluice` binary (default: next to this one).
    #[arg(long)]
    pub sluice_bin: Option<PathBuf>,
    /// The markdown report; the JSON goes alongside (same name, `.json`).
    #[arg(long, default_value = "bench/results/failover.md")]
    pub out: PathBuf,
    /// Repeat both scenarios this many times (fresh processes each time).
    #[arg(long, default_value_t = 1)]
    pub runs: u32,
    /// Requests per second, open loop, evenly spaced.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// Seconds of load in the replica-loss scenario.
    #[arg(long, default_value_t = 36.0)]
    pub duration_s: f64,
    /// od-0 is SIGKILLed at this second ...
    #[arg(long, default_value_t = 8.0)]
    pub kill_at_s: f64,
    /// ... and started again on its port at this one.
    #[arg(long, default_value_t = 16.0)]
    pub restart_at_s: f64,
    /// od-1 answers 503 (`PUT /admin/fail` `unavailable`) from this second ...
    #[arg(long, default_value_t = 24.0)]
    pub unavailable_at_s: f64,
    /// ... to this one.
    #[arg(long, default_value_t = 30.0)]
    pub unavailable_until_s: f64,
    /// Seconds of load in the fleet-503 scenario (0 skips it).
    #[arg(long, default_value_t = 20.0)]
    pub fleet_duration_s: f64,
    /// Both replicas answer 503 from this second of the fleet-503 scenario ...
    #[arg(long, default_value_t = 6.0)]
    pub fleet_outage_at_s: f64,
    /// ... for this many seconds.
    #[arg(long, default_value_t = 6.0)]
    pub fleet_outage_s: f64,
    /// Tokens of every answer (`x-sim-output-tokens`).
    #[arg(long, default_value_t = 48)]
    pub output_tokens: u64,
    /// `max_tokens` of every request (above the answer: it ends with `stop`).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u64,
    /// The replicas' time to first token at idle (`--ttft-ms`).
    #[arg(long, default_value_t = 100)]
    pub ttft_ms: u64,
    /// The replicas' inter-token latency (`--itl-ms`): GPU-like, so a kill finds answers in
    /// flight.
    #[arg(long, default_value_t = 20.0)]
    pub itl_ms: f64,
    /// Ports of od-0 and od-1 on 127.0.0.1 (the killed replica comes back on its own).
    #[arg(long, value_delimiter = ',', default_value = "28121,28122")]
    pub sim_ports: Vec<u16>,
    /// Keep each run's configs and logs (their directory is printed).
    #[arg(long)]
    pub keep: bool,
}

impl FailoverArgs {
    fn check(&self) -> Result<(), String> {
        if self.sim_ports.len() != 2 {
            return Err("--sim-ports takes two ports".into());
        }
        if !(self.rate > 0.0 && self.duration_s > 0.0 && self.runs > 0) {
            return Err("--rate, --duration-s and --runs must be positive".into());
        }
        let order = [
            self.kill_at_s,
            self.restart_at_s,
            self.unavailable_at_s,
            self.unavailable_until_s,
            self.duration_s,
        ];
        if order.windows(2).any(|w| w[0] > w[1]) {
            return Err(
                "need --kill-at-s ≤ --restart-at-s ≤ --unavailable-at-s ≤ --unavailable-until-s ≤ --duration-s"
                    .into(),
            );
        }
        if self.fleet_duration_s > 0.0
            && self.fleet_outage_at_s + self.fleet_outage_s > self.fleet_duration_s
        {
            return Err("the fleet outage must end within --fleet-duration-s".into());
        }
        if self.output_tokens == 0 || self.output_tokens > self.max_tokens {
            return Err("need 0 < --output-tokens ≤ --max-tokens".into());
        }
        Ok(())
    }

    fn sim_flags(&self) -> Vec<String> {
        vec![
            "--model".into(),
            MODEL.into(),
            "--ttft-ms".into(),
            self.ttft_ms.to_string(),
            "--itl-ms".into(),
            self.itl_ms.to_string(),
        ]
    }
}

// ---------------------------------------------------------------------------------------------
// The load

#[derive(Clone)]
struct Planned {
    id: usize,
    at_ms: u64,
    tenant: &'static str,
    tier: Tier,
    stream: bool,
    body: Bytes,
}

/// Evenly spaced arrivals; tenants alternate (Guaranteed, Standard, ...) and streaming
/// alternates by pairs, so each tenant has as many streamed requests as whole ones.
fn plan(args: &FailoverArgs, duration_s: f64) -> Vec<Planned> {
    let n = (args.rate * duration_s).round() as usize;
    (0..n)
        .map(|id| {
            let (tenant, tier) = TENANTS[id % 2];
            let stream = (id / 2) % 2 == 0;
            let mut body = json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": format!(
                    "Request {id}: summarise the incident report in three sentences.")}],
                "max_tokens": args.max_tokens,
                "stream": stream,
            });
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            Planned {
                id,
                at_ms: (id as f64 * 1000.0 / args.rate).round() as u64,
                tenant,
                tier,
                stream,
                body: Bytes::from(body.to_string()),
            }
        })
        .collect()
}

/// What the client saw of one request. Times are ms from the run's start.
#[derive(Debug, Clone, Default, Serialize)]
struct Outcome {
    id: usize,
    request_id: String,
    tenant: &'static str,
    tier: &'static str,
    stream: bool,
    at_ms: u64,
    /// 0: no response head.
    status: u16,
    reason: String,
    sent_ms: f64,
    head_ms: Option<f64>,
    first_token_ms: Option<f64>,
    end_ms: f64,
    /// Token-carrying events of a stream; a whole answer's `usage.completion_tokens`.
    tokens: u64,
    usage_tokens: Option<u64>,
    /// A stream's `data: [DONE]`, a whole answer's parsed body with a `finish_reason`.
    done: bool,
    /// The body broke off after the head (a stream cut, a connection closed).
    cut: bool,
    timed_out: bool,
}

impl Outcome {
    fn full(&self, tokens: u64) -> bool {
        self.status == 200
            && self.done
            && !self.cut
            && self.tokens == tokens
            && self.usage_tokens == Some(tokens)
    }
}

/// Reads a chat stream's server-sent events as they arrive.
#[derive(Default)]
struct Sse {
    buf: Vec<u8>,
    tokens: u64,
    usage: Option<u64>,
    done: bool,
}

impl Sse {
    /// Feeds bytes; true when a token-carrying event completed in them.
    fn feed(&mut self, data: &[u8]) -> bool {
        self.buf.extend_from_slice(data);
        let mut token = false;
        while let Some(i) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..i + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    self.done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if v["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
                {
                    self.tokens += 1;
                    token = true;
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    self.usage = Some(n);
                }
            }
        }
        token
    }
}

fn request_id(label: &str, id: usize) -> String {
    format!("fo-{label}-{id}")
}

async fn send(
    c: &HttpClient,
    url: &str,
    p: &Planned,
    label: &str,
    output_tokens: u64,
    t0: Instant,
) -> Outcome {
    let ms = || t0.elapsed().as_secs_f64() * 1000.0;
    let mut o = Outcome {
        id: p.id,
        request_id: request_id(label, p.id),
        tenant: p.tenant,
        tier: p.tier.as_str(),
        stream: p.stream,
        at_ms: p.at_ms,
        sent_ms: ms(),
        ..Outcome::default()
    };
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("x-tenant-id", p.tenant)
        .header("x-request-id", &o.request_id)
        .header("x-sim-output-tokens", output_tokens.to_string())
        .body(Full::new(p.body.clone()));
    let Ok(req) = req else { return o };
    let exchange = async {
        let Ok(resp) = c.request(req).await else {
            return;
        };
        o.status = resp.status().as_u16();
        o.head_ms = Some(ms());
        o.reason = resp
            .headers()
            .get("x-sluice-reason")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let mut body = resp.into_body();
        let mut sse = Sse::default();
        let mut whole = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                o.cut = true;
                break;
            };
            if let Ok(data) = frame.into_data() {
                if p.stream {
                    if sse.feed(&data) && o.first_token_ms.is_none() {
                        o.first_token_ms = Some(ms());
                    }
                } else {
                    whole.extend_from_slice(&data);
                }
            }
        }
        if p.stream {
            (o.tokens, o.usage_tokens, o.done) = (sse.tokens, sse.usage, sse.done);
        } else if let Ok(v) = serde_json::from_slice::<Value>(&whole) {
            o.usage_tokens = v["usage"]["completion_tokens"].as_u64();
            o.tokens = o.usage_tokens.unwrap_or(0);
            o.done = v["choices"][0]["finish_reason"].is_string();
        }
    };
    if tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .is_err()
    {
        o.timed_out = true;
    }
    o.end_ms = ms();
    o
}

// ---------------------------------------------------------------------------------------------
// Processes and Sluice's outputs

struct Sim {
    name: &'static str,
    addr: String,
    proc: Option<Proc>,
    starts: u32,
}

async fn start_sim(
    args: &FailoverArgs,
    bin: &Path,
    dir: &Path,
    sim: &mut Sim,
) -> Result<(), String> {
    // The killed process's port may take a moment to be free again: a few tries.
    let mut last = String::new();
    for _ in 0..20 {
        sim.starts += 1;
        let log = dir.join(format!("{}-{}.log", sim.name, sim.starts));
        let mut cmd = std::process::Command::new(bin);
        cmd.args(["sim", "--listen", &sim.addr])
            .args(args.sim_flags())
            .env("RUST_LOG", "warn");
        let mut p = Proc::spawn(sim.name, &mut cmd, sim.addr.clone(), Some(log))?;
        match p.wait_ok("/health", Duration::from_secs(10)).await {
            Ok(()) => {
                sim.proc = Some(p);
                return Ok(());
            }
            Err(e) if p.child.try_wait().ok().flatten().is_some() => last = e,
            Err(e) => return Err(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "{} would not start on {} (port taken? pass other --sim-ports): {last}",
        sim.name, sim.addr
    ))
}

/// SIGKILL, as a node or an OOM killer ends a replica; the handle's drop then reaps it.
fn kill(sim: &mut Sim) {
    if let Some(p) = sim.proc.take() {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        unsafe {
            libc::kill(p.pid() as libc::pid_t, libc::SIGKILL);
        }
        drop(p);
    }
}

/// The shipped `conf/sluice.yaml` with only what names this run's processes changed (listen
/// addresses, pid and upgrade files, the tenants of `conf/tenants.yaml` inlined) and the pools:
/// one on-demand pool of the two replicas serving `llama-3-70b`. No routing or policy knob is
/// touched.
fn sluice_config(sims: &[Sim], dir: &Path, sluice: &str, ops: &str) -> Value {
    const SHIPPED: &str = include_str!("../../conf/sluice.yaml");
    const TENANTS_FILE: &str = include_str!("../../conf/tenants.yaml");
    let yaml: serde_yaml::Value = serde_yaml::from_str(SHIPPED).unwrap_or_default();
    let mut cfg = serde_json::to_value(yaml).unwrap_or_default();
    let tenants: serde_yaml::Value = serde_yaml::from_str(TENANTS_FILE).unwrap_or_default();
    let tenants = serde_json::to_value(&tenants["tenants"]).unwrap_or_default();
    if let Some(o) = cfg.as_object_mut() {
        o.remove("tenants_file");
    }
    let mut pool = cfg["pools"][POOL].clone();
    pool["backends"] = json!(sims.iter().map(|s| s.addr.clone()).collect::<Vec<_>>());
    pool["models"] = json!([MODEL]);
    cfg["pools"] = json!({ POOL: pool });
    // The Prometheus selectors name the shipped pools; the one left keeps its own.
    if let Some(sel) = cfg["signals"]["pool_selectors"].as_object_mut() {
        sel.retain(|name, _| name == POOL);
    }
    sluice_testkit::merge(
        &mut cfg,
        &json!({
            "listen": [sluice],
            "ops_listen": [ops],
            "tenants": tenants,
            "server": {
                "grace_period_seconds": 0,
                "graceful_shutdown_timeout_seconds": 1,
                "upgrade_sock": dir.join("upgrade.sock").display().to_string(),
                "pid_file": dir.join("sluice.pid").display().to_string(),
            },
        }),
    );
    cfg
}

/// The routing knobs the report quotes, as the generated config sets them.
#[derive(Debug, Clone, Serialize)]
struct Knobs {
    retries: u64,
    budget_ratio: f64,
    budget_window_ms: u64,
    min_retries: u64,
    consecutive_failures: u64,
    base_ejection_ms: u64,
    health_interval_ms: u64,
    health_consecutive_failure: u64,
}

impl Knobs {
    fn of(cfg: &Value) -> Self {
        let p = &cfg["pools"][POOL];
        let b = &cfg["routing"]["retry_budget"];
        let u = |v: &Value, d: u64| v.as_u64().unwrap_or(d);
        Knobs {
            retries: u(&p["retries"], 2),
            budget_ratio: b["ratio"].as_f64().unwrap_or(0.2),
            budget_window_ms: u(&b["window_ms"], 10_000),
            min_retries: u(&b["min_retries"], 10),
            consecutive_failures: u(&p["ejection"]["consecutive_failures"], 5),
            base_ejection_ms: u(&p["ejection"]["base_ejection_ms"], 30_000),
            health_interval_ms: u(&p["health_check"]["interval_ms"], 1000),
            health_consecutive_failure: u(&p["health_check"]["consecutive_failure"], 2),
        }
    }
}

/// Waits until both replicas are checked healthy and the pool's models are known.
/// Two fresh replicas and a Sluice in front of them, ready: what both scenarios start from.
struct Fleet {
    work: WorkDir,
    dir: PathBuf,
    c: HttpClient,
    sims: Vec<Sim>,
    names: BTreeMap<String, &'static str>,
    knobs: Knobs,
    sluice: Proc,
}

impl Fleet {
    async fn start(args: &FailoverArgs, bin: &Path, work_name: &str) -> Result<Fleet, String> {
        let mut work = WorkDir::new(work_name)?;
        work.keep = args.keep;
        let dir = work.path.clone();
        let c = procs::client();
        let mut sims: Vec<Sim> = ["od-0", "od-1"]
            .into_iter()
            .zip(&args.sim_ports)
            .map(|(name, port)| Sim {
                name,
                addr: format!("127.0.0.1:{port}"),
                proc: None,
                starts: 0,
            })
            .collect();
        for s in &mut sims {
            start_sim(args, bin, &dir, s).await?;
        }
        let names = sims.iter().map(|s| (s.addr.clone(), s.name)).collect();
        let (addr, ops) = (procs::free_addr()?, procs::free_addr()?);
        let cfg = sluice_config(&sims, &dir, &addr, &ops);
        crate::sluice_conf::parse(&cfg, &dir)?;
        let knobs = Knobs::of(&cfg);
        let sluice = procs::start_sluice(bin, &cfg, &dir).await?;
        wait_ready(&c, &sluice).await?;
        Ok(Fleet {
            work,
            dir,
            c,
            sims,
            names,
            knobs,
            sluice,
        })
    }
}

async fn wait_ready(c: &HttpClient, sluice: &Proc) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        if let Ok(st) = procs::get_json(c, &sluice.ops_url("/status")).await {
            let ready = pool_of(&st).is_some_and(|p| {
                p["backends"].as_array().is_some_and(|b| {
                    b.len() == 2
                        && b.iter()
                            .all(|x| x["healthy"] == json!(true) && x["checked"] == json!(true))
                })
            }) && st["routes"]["complete"] == json!(true);
            if ready {
                return Ok(());
            }
            last = st;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "Sluice never reported both replicas healthy; last /status pools {}",
        last["pools"]
    ))
}

fn pool_of(status: &Value) -> Option<&Value> {
    status["pools"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == json!(POOL))
}

/// One `/status` poll of the pool, ms from the run's start.
#[derive(Debug, Clone)]
struct Poll {
    t_ms: f64,
    pool: Value,
}

/// Polls `/status` every 250 ms until `stop`.
fn poller(
    c: &HttpClient,
    url: String,
    t0: Instant,
    stop: &Arc<AtomicBool>,
) -> (tokio::task::JoinHandle<()>, Arc<Mutex<Vec<Poll>>>) {
    let polls = Arc::new(Mutex::new(Vec::new()));
    let (c, stop, out) = (c.clone(), Arc::clone(stop), Arc::clone(&polls));
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(t0, POLL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let t_ms = t0.elapsed().as_secs_f64() * 1000.0;
            if let Ok(st) = procs::get_json(&c, &url).await {
                if let Some(pool) = pool_of(&st) {
                    out.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Poll {
                            t_ms,
                            pool: pool.clone(),
                        });
                }
            }
        }
    });
    (task, polls)
}

/// A counter's series of the pool in a Prometheus text, by one label's value.
fn counter_by(metrics: &str, name: &str, label: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix('{')) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let get = |k: &str| {
            labels.split(',').find_map(|kv| {
                let (key, v) = kv.split_once('=')?;
                (key.trim() == k).then(|| v.trim().trim_matches('"').to_string())
            })
        };
        if get("pool").as_deref() != Some(POOL) {
            continue;
        }
        if let (Some(k), Ok(v)) = (get(label), value.trim().parse::<f64>()) {
            *out.entry(k).or_default() += v as u64;
        }
    }
    out
}

/// What Sluice's log says: its events (`upstream_retry`, `backend_ejected`, ...) and the
/// decision record of each request by id.
#[derive(Default)]
struct Log {
    events: Vec<Value>,
    records: BTreeMap<String, Value>,
}

fn read_log(path: &Path) -> Log {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut log = Log::default();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let Some(m) = v["message"].as_str() {
            if let Ok(e) = serde_json::from_str::<Value>(m) {
                if e["event"].is_string() {
                    log.events.push(e);
                }
            }
        } else if let (Some(id), true) = (v["request_id"].as_str(), v["decision"].is_string()) {
            log.records.insert(id.to_string(), v.clone());
        }
    }
    log
}

fn events<'a>(log: &'a Log, name: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    log.events.iter().filter(move |e| e["event"] == json!(name))
}

/// The sum of every simulator's received completion requests.
async fn sims_received(c: &HttpClient, sims: &[Sim]) -> Result<u64, String> {
    let mut n = 0;
    for s in sims {
        let st = procs::get_json(c, &format!("http://{}/admin/stats", s.addr)).await?;
        n += st["received"].as_u64().unwrap_or(0);
    }
    Ok(n)
}

async fn fail_mode(c: &HttpClient, sim: &Sim, mode: &str) -> Result<(), String> {
    procs::put_json(
        c,
        &format!("http://{}/admin/fail", sim.addr),
        &json!({"mode": mode}),
    )
    .await
}

// ---------------------------------------------------------------------------------------------
// Derived figures

/// A replica's time out of selection, from the `/status` polls (seconds from the run's start).
#[derive(Debug, Clone, Serialize)]
struct OutSpan {
    replica: String,
    /// First poll where it was not usable (health check down or ejected).
    out_at_s: f64,
    /// First poll where it was ejected, and the ejection's cause.
    ejected_at_s: Option<f64>,
    ejection_cause: Option<String>,
    /// First poll where the health check had it down.
    unhealthy_at_s: Option<f64>,
    /// First poll where it was usable again (`None`: still out at the end).
    back_at_s: Option<f64>,
    /// Sluice's `backend_ejected` line for this ejection (cause, for how long, the how-manyth)
    /// and its `backend_returned` line (why).
    log_ejected: Option<String>,
    log_returned: Option<String>,
}

/// Pairs each span with an ejection with the replica's next `backend_ejected` and
/// `backend_returned` log lines, in order.
fn annotate(spans: &mut [OutSpan], log: &Log, names: &BTreeMap<String, &'static str>) {
    let name = |e: &Value| {
        let b = e["backend"].as_str().unwrap_or("?");
        names.get(b).map_or(b.to_string(), |n| n.to_string())
    };
    for &replica in names.values() {
        let ejected: Vec<&Value> = events(log, "backend_ejected")
            .filter(|e| name(e) == replica)
            .collect();
        let returned: Vec<&Value> = events(log, "backend_returned")
            .filter(|e| name(e) == replica)
            .collect();
        for (k, span) in spans
            .iter_mut()
            .filter(|s| s.replica == replica && s.ejected_at_s.is_some())
            .enumerate()
        {
            span.log_ejected = ejected.get(k).map(|e| {
                format!(
                    "{}, {} ms, times {}",
                    e["cause"].as_str().unwrap_or("?"),
                    e["for_ms"],
                    e["times"]
                )
            });
            span.log_returned = returned
                .get(k)
                .map(|e| e["why"].as_str().unwrap_or("?").to_string());
        }
    }
}

fn out_spans(polls: &[Poll], names: &BTreeMap<String, &'static str>) -> Vec<OutSpan> {
    let mut out: Vec<OutSpan> = Vec::new();
    let mut open: BTreeMap<String, usize> = BTreeMap::new();
    for p in polls {
        let t = p.t_ms / 1000.0;
        for b in p.pool["backends"].as_array().into_iter().flatten() {
            let addr = b["backend"].as_str().unwrap_or("?").to_string();
            let name = names.get(&addr).copied().unwrap_or("?").to_string();
            let healthy = b["healthy"] == json!(true);
            let ejected = !b["ejected"].is_null();
            match open.get(&addr) {
                None if !healthy || ejected => {
                    open.insert(addr.clone(), out.len());
                    out.push(OutSpan {
                        replica: name,
                        out_at_s: t,
                        ejected_at_s: None,
                        ejection_cause: None,
                        unhealthy_at_s: None,
                        back_at_s: None,
                        log_ejected: None,
                        log_returned: None,
                    });
                }
                Some(&i) if healthy && !ejected => {
                    out[i].back_at_s = Some(t);
                    open.remove(&addr);
                    continue;
                }
                _ => {}
            }
            if let Some(&i) = open.get(&addr) {
                let s = &mut out[i];
                if ejected && s.ejected_at_s.is_none() {
                    s.ejected_at_s = Some(t);
                    s.ejection_cause = b["ejected"]["cause"].as_str().map(str::to_string);
                }
                if !healthy && s.unhealthy_at_s.is_none() {
                    s.unhealthy_at_s = Some(t);
                }
            }
        }
    }
    out
}

/// The retry budget's window over the run: the most retries it held, the limit then, and the
/// smallest limit seen while retries were being made.
#[derive(Debug, Clone, Default, Serialize)]
struct BudgetUse {
    max_window_retries: u64,
    limit_at_max: u64,
    /// Window requests when it held the most retries.
    requests_at_max: u64,
    /// Highest retries ÷ limit over the polls.
    max_share_of_limit: f64,
}

fn budget_use(polls: &[Poll]) -> BudgetUse {
    let mut b = BudgetUse::default();
    for p in polls {
        let w = &p.pool["retry_budget"];
        let (r, l, q) = (
            w["retries"].as_u64().unwrap_or(0),
            w["limit"].as_u64().unwrap_or(0),
            w["requests"].as_u64().unwrap_or(0),
        );
        if r > b.max_window_retries {
            (b.max_window_retries, b.limit_at_max, b.requests_at_max) = (r, l, q);
        }
        if l > 0 {
            b.max_share_of_limit = b.max_share_of_limit.max(r as f64 / l as f64);
        }
    }
    b
}

fn by_key(v: &Value) -> BTreeMap<String, u64> {
    v.as_object()
        .map(|o| {
            o.iter()
                .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default()
}

fn sum(m: &BTreeMap<String, u64>) -> u64 {
    m.values().sum()
}

/// A failed request, as the report lists it.
#[derive(Debug, Clone, Serialize)]
struct Failure {
    request_id: String,
    stream: bool,
    status: u16,
    reason: String,
    at_s: f64,
    end_s: f64,
    tokens: u64,
    cut: bool,
    timed_out: bool,
    /// From its decision record.
    backend: Option<String>,
    attempts: Option<u64>,
    error: Option<String>,
}

fn failure(o: &Outcome, rec: Option<&Value>, names: &BTreeMap<String, &'static str>) -> Failure {
    let backend = rec
        .and_then(|r| r["backend"].as_str())
        .map(|b| names.get(b).map_or(b.to_string(), |n| n.to_string()));
    Failure {
        request_id: o.request_id.clone(),
        stream: o.stream,
        status: o.status,
        reason: o.reason.clone(),
        at_s: o.sent_ms / 1000.0,
        end_s: o.end_ms / 1000.0,
        tokens: o.tokens,
        cut: o.cut,
        timed_out: o.timed_out,
        backend,
        attempts: rec.and_then(|r| r["attempts"].as_u64()),
        error: rec.and_then(|r| r["error"].as_str()).map(str::to_string),
    }
}

/// Retries as the three outputs count them.
#[derive(Debug, Clone, Default, Serialize)]
struct Retries {
    /// `sluice_upstream_retries_total{pool="on-demand"}` by cause, at the end.
    metrics: BTreeMap<String, u64>,
    /// `upstream_retry` log lines by cause.
    log: BTreeMap<String, u64>,
    /// Σ (attempts − 1) over the decision records.
    records: u64,
    /// Requests whose record has attempts > 1.
    retried_requests: u64,
    /// `/status` `retries_denied` by reason, at the end.
    denied: BTreeMap<String, u64>,
    /// `/status` `ejections` by cause, at the end.
    ejections: BTreeMap<String, u64>,
}

fn retries(metrics: &str, log: &Log, last: Option<&Poll>) -> Retries {
    let mut r = Retries {
        metrics: counter_by(metrics, "sluice_upstream_retries_total", "cause"),
        ..Retries::default()
    };
    for e in events(log, "upstream_retry") {
        *r.log
            .entry(e["cause"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
    }
    for rec in log.records.values() {
        let a = rec["attempts"].as_u64().unwrap_or(0);
        if a > 1 {
            r.records += a - 1;
            r.retried_requests += 1;
        }
    }
    if let Some(p) = last {
        r.denied = by_key(&p.pool["retries_denied"]);
        r.ejections = by_key(&p.pool["ejections"]);
    }
    r
}

fn latency_ms(outcomes: &[&Outcome], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = outcomes.iter().map(|o| o.end_ms - o.sent_ms).collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, q)
}

// ---------------------------------------------------------------------------------------------
// Scenario 1: a replica lost, restarted, then answering 503

#[derive(Debug, Clone, Serialize)]
struct LossRun {
    requests: usize,
    full: usize,
    /// Refused by the policy (4xx with an `x-sluice-reason`), not a failover matter.
    refused: usize,
    failed: usize,
    /// Streams the kill cut after tokens had reached the client ...
    cut_after_tokens: usize,
    /// ... and after their response head but before any token.
    cut_before_token: usize,
    /// Every other failure (target: none).
    other_failures: Vec<Failure>,
    cut_streams: Vec<Failure>,
    retries: Retries,
    /// Requests retried whose client did not get a full answer, and cut streams whose record
    /// shows more than one attempt: a retry after a first byte (target: none).
    retried_not_full: Vec<String>,
    cut_and_retried: Vec<String>,
    budget: BudgetUse,
    out_of_selection: Vec<OutSpan>,
    /// `backend_ejected` / `backend_returned` log lines.
    ejection_log: Vec<Value>,
    /// When each event happened (s from the start): kill, restart issued, restarted replica
    /// listening, 503 on, 503 off.
    events_s: Vec<(String, f64)>,
    latency_p50_ms: Option<f64>,
    latency_p99_ms: Option<f64>,
    /// Full answers that took more than one attempt: their latency p50 / max.
    retried_latency_p50_ms: Option<f64>,
    retried_latency_max_ms: Option<f64>,
    client_lag_max_ms: f64,
}

async fn replica_loss(
    args: &FailoverArgs,
    bin: &Path,
    label: &str,
) -> Result<(LossRun, Knobs), String> {
    let Fleet {
        work: _work,
        dir,
        c,
        mut sims,
        names,
        knobs,
        sluice,
    } = Fleet::start(args, bin, &format!("failover-{label}")).await?;

    let planned = plan(args, args.duration_s);
    let t0 = Instant::now() + Duration::from_millis(300);
    let stop = Arc::new(AtomicBool::new(false));
    let (poll_task, polls) = poller(&c, sluice.ops_url("/status"), t0, &stop);
    let url = sluice.url("/v1/chat/completions");
    let tasks: Vec<_> = planned
        .iter()
        .map(|p| {
            let (c, url, p, label) = (c.clone(), url.clone(), p.clone(), label.to_string());
            let tokens = args.output_tokens;
            tokio::spawn(async move {
                tokio::time::sleep_until(t0 + Duration::from_millis(p.at_ms)).await;
                send(&c, &url, &p, &label, tokens, t0).await
            })
        })
        .collect();

    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    let now_s = || t0.elapsed().as_secs_f64();
    let mut events_s: Vec<(String, f64)> = Vec::new();
    tokio::time::sleep_until(at(args.kill_at_s)).await;
    kill(&mut sims[0]);
    events_s.push(("od-0 SIGKILL".to_string(), now_s()));
    tokio::time::sleep_until(at(args.restart_at_s)).await;
    events_s.push(("od-0 restart".to_string(), now_s()));
    let (first, rest) = sims.split_at_mut(1);
    start_sim(args, bin, &dir, &mut first[0]).await?;
    events_s.push(("od-0 listening".to_string(), now_s()));
    tokio::time::sleep_until(at(args.unavailable_at_s)).await;
    fail_mode(&c, &rest[0], "unavailable").await?;
    events_s.push(("od-1 503 on".to_string(), now_s()));
    tokio::time::sleep_until(at(args.unavailable_until_s)).await;
    fail_mode(&c, &rest[0], "none").await?;
    events_s.push(("od-1 503 off".to_string(), now_s()));

    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.map_err(|e| e.to_string())?);
    }
    // Let the polls see the last returns, and the log writer flush.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    poll_task.await.map_err(|e| e.to_string())?;
    let (_, metrics) = procs::request(&c, "GET", &sluice.ops_url("/metrics"), None).await?;
    let metrics = String::from_utf8_lossy(&metrics).to_string();
    let polls = polls.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let log = read_log(&dir.join("sluice.log"));
    drop(sluice);
    drop(sims);
    if args.keep {
        eprintln!("sluice-bench failover: kept {}", dir.display());
    }

    let kill_ms = events_s[0].1 * 1000.0;
    let killed = format!("127.0.0.1:{}", args.sim_ports[0]);
    let tokens = args.output_tokens;
    let mut run = LossRun {
        requests: outcomes.len(),
        full: 0,
        refused: 0,
        failed: 0,
        cut_after_tokens: 0,
        cut_before_token: 0,
        other_failures: Vec::new(),
        cut_streams: Vec::new(),
        retries: retries(&metrics, &log, polls.last()),
        retried_not_full: Vec::new(),
        cut_and_retried: Vec::new(),
        budget: budget_use(&polls),
        out_of_selection: {
            let mut s = out_spans(&polls, &names);
            annotate(&mut s, &log, &names);
            s
        },
        ejection_log: log
            .events
            .iter()
            .filter(|e| {
                e["event"] == json!("backend_ejected") || e["event"] == json!("backend_returned")
            })
            .cloned()
            .collect(),
        events_s,
        latency_p50_ms: None,
        latency_p99_ms: None,
        retried_latency_p50_ms: None,
        retried_latency_max_ms: None,
        client_lag_max_ms: outcomes
            .iter()
            .map(|o| o.sent_ms - o.at_ms as f64)
            .fold(0.0, f64::max),
    };
    let mut retried_full = Vec::new();
    for o in &outcomes {
        let rec = log.records.get(&o.request_id);
        let attempts = rec.and_then(|r| r["attempts"].as_u64()).unwrap_or(0);
        let full = o.full(tokens);
        if attempts > 1 {
            if full {
                retried_full.push(o);
            } else {
                run.retried_not_full.push(o.request_id.clone());
            }
        }
        if full {
            run.full += 1;
            continue;
        }
        if (400..500).contains(&o.status) && !o.reason.is_empty() {
            run.refused += 1;
            continue;
        }
        run.failed += 1;
        let f = failure(o, rec, &names);
        let by_kill = o.stream
            && o.status == 200
            && o.cut
            && rec.and_then(|r| r["backend"].as_str()) == Some(killed.as_str())
            && (kill_ms - 50.0..=kill_ms + CUT_WINDOW_MS).contains(&o.end_ms);
        if by_kill {
            if attempts > 1 {
                run.cut_and_retried.push(o.request_id.clone());
            }
            if o.tokens > 0 {
                run.cut_after_tokens += 1;
            } else {
                run.cut_before_token += 1;
            }
            run.cut_streams.push(f);
        } else {
            run.other_failures.push(f);
        }
    }
    let full: Vec<&Outcome> = outcomes.iter().filter(|o| o.full(tokens)).collect();
    run.latency_p50_ms = latency_ms(&full, 50.0);
    run.latency_p99_ms = latency_ms(&full, 99.0);
    run.retried_latency_p50_ms = latency_ms(&retried_full, 50.0);
    run.retried_latency_max_ms = latency_ms(&retried_full, 100.0);
    Ok((run, knobs))
}

// ---------------------------------------------------------------------------------------------
// Scenario 2: every replica answering 503 at once

#[derive(Debug, Clone, Serialize)]
struct OutageRun {
    requests: usize,
    full: usize,
    failed: usize,
    /// Failed requests sent before the outage, during it, and after it (while the health
    /// checks had not brought a replica back yet).
    failed_before: usize,
    failed_in_outage: usize,
    failed_after: usize,
    /// When the last failed request was sent, and the first full answer after the outage
    /// (s from the start).
    last_failure_sent_s: Option<f64>,
    first_full_after_s: Option<f64>,
    /// Failed requests by status and reason.
    failures_by: BTreeMap<String, usize>,
    /// Completion requests the replicas received over the run, and during the outage.
    attempts: u64,
    attempts_in_outage: u64,
    requests_in_outage: usize,
    /// requests × (1 + ratio) + min_retries.
    bound: f64,
    retries: Retries,
    budget: BudgetUse,
    out_of_selection: Vec<OutSpan>,
    /// When the outage began and ended (s from the start).
    events_s: Vec<(String, f64)>,
}

async fn fleet_503(args: &FailoverArgs, bin: &Path, label: &str) -> Result<OutageRun, String> {
    let Fleet {
        work: _work,
        dir,
        c,
        sims,
        names,
        knobs,
        sluice,
    } = Fleet::start(args, bin, &format!("failover-fleet-{label}")).await?;
    let received_before = sims_received(&c, &sims).await?;

    let planned = plan(args, args.fleet_duration_s);
    let t0 = Instant::now() + Duration::from_millis(300);
    let stop = Arc::new(AtomicBool::new(false));
    let (poll_task, polls) = poller(&c, sluice.ops_url("/status"), t0, &stop);
    let url = sluice.url("/v1/chat/completions");
    let label2 = format!("{label}-fleet");
    let tasks: Vec<_> = planned
        .iter()
        .map(|p| {
            let (c, url, p, label) = (c.clone(), url.clone(), p.clone(), label2.clone());
            let tokens = args.output_tokens;
            tokio::spawn(async move {
                tokio::time::sleep_until(t0 + Duration::from_millis(p.at_ms)).await;
                send(&c, &url, &p, &label, tokens, t0).await
            })
        })
        .collect();
    let at = |s: f64| t0 + Duration::from_secs_f64(s);
    let now_s = || t0.elapsed().as_secs_f64();
    let mut events_s: Vec<(String, f64)> = Vec::new();
    tokio::time::sleep_until(at(args.fleet_outage_at_s)).await;
    let at_on = sims_received(&c, &sims).await?;
    for s in &sims {
        fail_mode(&c, s, "unavailable").await?;
    }
    events_s.push(("503 on (both)".to_string(), now_s()));
    tokio::time::sleep_until(at(args.fleet_outage_at_s + args.fleet_outage_s)).await;
    for s in &sims {
        fail_mode(&c, s, "none").await?;
    }
    events_s.push(("503 off (both)".to_string(), now_s()));
    let at_off = sims_received(&c, &sims).await?;

    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.map_err(|e| e.to_string())?);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    poll_task.await.map_err(|e| e.to_string())?;
    let received_after = sims_received(&c, &sims).await?;
    let (_, metrics) = procs::request(&c, "GET", &sluice.ops_url("/metrics"), None).await?;
    let metrics = String::from_utf8_lossy(&metrics).to_string();
    let polls = polls.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let log = read_log(&dir.join("sluice.log"));
    drop(sluice);
    drop(sims);
    if args.keep {
        eprintln!("sluice-bench failover: kept {}", dir.display());
    }

    let (on_ms, off_ms) = (events_s[0].1 * 1000.0, events_s[1].1 * 1000.0);
    let in_outage = |o: &Outcome| (on_ms..off_ms).contains(&o.sent_ms);
    let mut run = OutageRun {
        requests: outcomes.len(),
        full: 0,
        failed: 0,
        failed_before: 0,
        failed_in_outage: 0,
        failed_after: 0,
        last_failure_sent_s: None,
        first_full_after_s: None,
        failures_by: BTreeMap::new(),
        attempts: received_after - received_before,
        attempts_in_outage: at_off - at_on,
        requests_in_outage: outcomes.iter().filter(|o| in_outage(o)).count(),
        bound: outcomes.len() as f64 * (1.0 + knobs.budget_ratio) + knobs.min_retries as f64,
        retries: retries(&metrics, &log, polls.last()),
        budget: budget_use(&polls),
        out_of_selection: {
            let mut s = out_spans(&polls, &names);
            annotate(&mut s, &log, &names);
            s
        },
        events_s,
    };
    for o in &outcomes {
        if o.full(args.output_tokens) {
            run.full += 1;
            if o.sent_ms >= off_ms && run.first_full_after_s.is_none() {
                run.first_full_after_s = Some(o.sent_ms / 1000.0);
            }
            continue;
        }
        run.failed += 1;
        run.last_failure_sent_s = Some(o.sent_ms / 1000.0);
        if in_outage(o) {
            run.failed_in_outage += 1;
        } else if o.sent_ms < on_ms {
            run.failed_before += 1;
        } else {
            run.failed_after += 1;
        }
        let key = if o.reason.is_empty() {
            o.status.to_string()
        } else {
            format!("{} {}", o.status, o.reason)
        };
        *run.failures_by.entry(key).or_default() += 1;
    }
    Ok(run)
}

// ---------------------------------------------------------------------------------------------
// Checks and the report

#[derive(Debug, Clone, Serialize)]
struct Check {
    run: u32,
    scenario: &'static str,
    what: String,
    detail: String,
    pass: bool,
}

#[derive(Debug, Clone, Serialize)]
struct RunOut {
    run: u32,
    replica_loss: LossRun,
    fleet_503: Option<OutageRun>,
}

fn checks(args: &FailoverArgs, r: &RunOut, knobs: &Knobs) -> Vec<Check> {
    let mut out = Vec::new();
    let mut push = |scenario, what: &str, detail: String, pass| {
        out.push(Check {
            run: r.run,
            scenario,
            what: what.to_string(),
            detail,
            pass,
        })
    };
    let l = &r.replica_loss;
    push(
        "replica-loss",
        "failed requests other than the streams the kill cut: 0",
        format!(
            "{} (of {} requests: {} full, {} refused, {} failed: {} streams cut by the kill after tokens, {} after their head only)",
            l.other_failures.len(),
            l.requests,
            l.full,
            l.refused,
            l.failed,
            l.cut_after_tokens,
            l.cut_before_token
        ),
        l.other_failures.is_empty(),
    );
    let log_total = sum(&l.retries.log);
    let metric_total = sum(&l.retries.metrics);
    push(
        "replica-loss",
        "no retry after a first byte: every request with attempts > 1 got a full answer, no cut stream was retried, every retry is in a record",
        format!(
            "{} retried requests ({} retries by their records, {} log lines, {} in /metrics); not full: {}; cut and retried: {}",
            l.retries.retried_requests,
            l.retries.records,
            log_total,
            metric_total,
            l.retried_not_full.len(),
            l.cut_and_retried.len()
        ),
        l.retried_not_full.is_empty()
            && l.cut_and_retried.is_empty()
            && l.retries.records == log_total
            && log_total == metric_total,
    );
    push(
        "replica-loss",
        "retries within the budget (window retries ≤ limit) and none denied",
        format!(
            "max {} retries in a {} ms window (limit then {}, {} requests); denied {:?}",
            l.budget.max_window_retries,
            knobs.budget_window_ms,
            l.budget.limit_at_max,
            l.budget.requests_at_max,
            l.retries.denied
        ),
        l.budget.max_window_retries <= l.budget.limit_at_max.max(knobs.min_retries)
            && sum(&l.retries.denied) == 0,
    );
    let span = |name: &str, from: f64| {
        l.out_of_selection
            .iter()
            .find(|s| s.replica == name && s.out_at_s + 0.5 >= from)
    };
    let od0 = span("od-0", args.kill_at_s);
    push(
        "replica-loss",
        "the killed replica leaves selection and is back after its restart",
        od0.map_or("never left selection".into(), |s| {
            format!(
                "out at {:.2} s (ejected {}), back at {}",
                s.out_at_s,
                s.ejected_at_s
                    .map_or("never".into(), |t| format!("{t:.2} s")),
                s.back_at_s.map_or("never".into(), |t| format!("{t:.2} s"))
            )
        }),
        od0.is_some_and(|s| s.back_at_s.is_some_and(|b| b >= args.restart_at_s)),
    );
    let od1 = span("od-1", args.unavailable_at_s);
    push(
        "replica-loss",
        "the 503 replica leaves selection and is back once it answers again",
        od1.map_or("never left selection".into(), |s| {
            format!(
                "out at {:.2} s (ejected {}), back at {}",
                s.out_at_s,
                s.ejected_at_s
                    .map_or("never".into(), |t| format!("{t:.2} s")),
                s.back_at_s.map_or("never".into(), |t| format!("{t:.2} s"))
            )
        }),
        od1.is_some_and(|s| s.back_at_s.is_some_and(|b| b >= args.unavailable_until_s)),
    );
    if let Some(f) = &r.fleet_503 {
        push(
            "fleet-503",
            "upstream attempts ≤ requests × (1 + ratio) + min_retries",
            format!(
                "{} attempts for {} requests: bound {:.0} ({} × {} + {}); during the outage {} attempts for {} requests",
                f.attempts,
                f.requests,
                f.bound,
                f.requests,
                1.0 + knobs.budget_ratio,
                knobs.min_retries,
                f.attempts_in_outage,
                f.requests_in_outage
            ),
            f.attempts as f64 <= f.bound,
        );
    }
    out
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn shell(cmd: &str, args: &[&str]) -> Option<String> {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn environment() -> String {
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(", "))
        .unwrap_or_default();
    let commit =
        shell("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = shell("git", &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|s| !s.is_empty());
    format!(
        "nproc {}, {}, shared with other work; load average {load} before the runs. Commit {commit}{}. {} build.",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model(),
        if dirty { " with uncommitted changes" } else { "" },
        if cfg!(debug_assertions) { "Debug (not a result)" } else { "Release" }
    )
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("target/release/sluice-bench {}", args.join(" "))
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.0}"))
}

fn opt_s(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.2}"))
}

fn causes(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
    format!("{} ({})", sum(m), parts.join(", "))
}

fn render(
    args: &FailoverArgs,
    knobs: &Knobs,
    runs: &[RunOut],
    checks: &[Check],
    env: &str,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## Failover: replicas dying under load\n");
    let _ = writeln!(md, "Command: `{}`  ", command_line());
    let _ = writeln!(
        md,
        "Date: {}  ",
        shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default()
    );
    let _ = writeln!(md, "Machine: {env}\n");
    let _ = writeln!(
        md,
        "Fleet: two `sluice sim {}` replicas (od-0, od-1 on 127.0.0.1 ports {} and {}) in the pool \
         `{POOL}` serving `{MODEL}`. Sluice runs the shipped `conf/sluice.yaml` (tenants from \
         `conf/tenants.yaml`) with only addresses and pools changed: retries {}, retry budget \
         {} of the requests over {} ms or {} (more of the two), ejection after {} failures in a \
         row for {} ms × times, health checks every {} ms ({} failures mark a replica down).\n",
        args.sim_flags()[2..].join(" "),
        args.sim_ports[0],
        args.sim_ports[1],
        knobs.retries,
        knobs.budget_ratio,
        knobs.budget_window_ms,
        knobs.min_retries,
        knobs.consecutive_failures,
        knobs.base_ejection_ms,
        knobs.health_interval_ms,
        knobs.health_consecutive_failure
    );
    let _ = writeln!(
        md,
        "Load: open loop, {} requests/s evenly spaced, tenants support-bot (Guaranteed) and \
         coding-assistant (Standard) alternately, streaming alternating by pairs (half of each \
         tenant's requests streamed), every answer {} tokens (`x-sim-output-tokens`, max_tokens \
         {}). A full answer: 200, the whole body (a stream's `[DONE]`, {} token events and its \
         usage; a whole answer's usage), nothing cut.\n",
        args.rate, args.output_tokens, args.max_tokens, args.output_tokens
    );
    let _ = writeln!(
        md,
        "### replica-loss\n\n{} s of load: od-0 SIGKILLed at {} s and started again on its port \
         at {} s; od-1 answers 503 (`PUT /admin/fail` `unavailable`, `/health` 503 too) from {} s \
         to {} s. A stream counts as cut by the kill when its head and possibly tokens came from \
         od-0 (its decision record's `backend`) and its body broke off within {} s of the kill. \
         Retries: `sluice_upstream_retries_total` at the end, the `upstream_retry` log lines, and \
         Σ (attempts − 1) over the decision records (the request log). Budget: `/status` \
         `retry_budget` polled every {} ms.\n",
        args.duration_s,
        args.kill_at_s,
        args.restart_at_s,
        args.unavailable_at_s,
        args.unavailable_until_s,
        CUT_WINDOW_MS / 1000.0,
        POLL_EVERY.as_millis()
    );
    let _ = writeln!(
        md,
        "| run | requests | full | refused | failed | cut by kill after tokens / head only | other failures | retries (/metrics) | retry log lines | Σ(attempts−1) / requests retried | retried but not full | max window retries / limit | denied | ejections | latency p50 / p99 ms | retried p50 / max ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        let l = &r.replica_loss;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} / {} | {} | {} | {} | {} / {} | {} | {} / {} | {} | {} | {} / {} | {} / {} |",
            r.run,
            l.requests,
            l.full,
            l.refused,
            l.failed,
            l.cut_after_tokens,
            l.cut_before_token,
            l.other_failures.len(),
            causes(&l.retries.metrics),
            causes(&l.retries.log),
            l.retries.records,
            l.retries.retried_requests,
            l.retried_not_full.len(),
            l.budget.max_window_retries,
            l.budget.limit_at_max,
            causes(&l.retries.denied.iter().filter(|(_, v)| **v > 0).map(|(k, v)| (k.clone(), *v)).collect()),
            causes(&l.retries.ejections.iter().filter(|(_, v)| **v > 0).map(|(k, v)| (k.clone(), *v)).collect()),
            opt_ms(l.latency_p50_ms),
            opt_ms(l.latency_p99_ms),
            opt_ms(l.retried_latency_p50_ms),
            opt_ms(l.retried_latency_max_ms),
        );
    }
    let _ = writeln!(
        md,
        "\nOut of selection (from `/status` polls, s from the start; usable = health check up and not ejected; the log columns are Sluice's `backend_ejected` and `backend_returned` lines):\n\n| run | events | replica | out at | ejected at (cause) | health check down at | back at | log: ejected | log: returned |\n|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        let l = &r.replica_loss;
        let ev: Vec<String> = l
            .events_s
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect();
        for (i, s) in l.out_of_selection.iter().enumerate() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.2} | {}{} | {} | {} | {} | {} |",
                r.run,
                if i == 0 { ev.join(", ") } else { String::new() },
                s.replica,
                s.out_at_s,
                opt_s(s.ejected_at_s),
                s.ejection_cause
                    .as_ref()
                    .map_or(String::new(), |c| format!(" ({c})")),
                opt_s(s.unhealthy_at_s),
                opt_s(s.back_at_s),
                s.log_ejected.as_deref().unwrap_or("-"),
                s.log_returned.as_deref().unwrap_or("-")
            );
        }
    }
    let failures: Vec<(u32, &Failure)> = runs
        .iter()
        .flat_map(|r| {
            r.replica_loss
                .other_failures
                .iter()
                .map(move |f| (r.run, f))
        })
        .collect();
    if !failures.is_empty() {
        let _ = writeln!(
            md,
            "\nOther failures:\n\n| run | request | stream | status | reason | sent s | ended s | tokens | cut | backend | attempts | error |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for (run, f) in failures {
            let _ = writeln!(
                md,
                "| {run} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {} | {} | {} |",
                f.request_id,
                f.stream,
                f.status,
                f.reason,
                f.at_s,
                f.end_s,
                f.tokens,
                f.cut,
                f.backend.as_deref().unwrap_or("-"),
                f.attempts.map_or("-".into(), |a| a.to_string()),
                f.error.as_deref().unwrap_or("-")
            );
        }
    }
    if runs.iter().any(|r| r.fleet_503.is_some()) {
        let _ = writeln!(
            md,
            "\n### fleet-503\n\n{} s of the same load on fresh processes; both replicas answer 503 \
             (`unavailable`, `/health` too) from {} s for {} s. Attempts: completion requests \
             the replicas received (`/admin/stats` `received`, 503s included). Bound: requests × \
             (1 + {}) + {}.\n",
            args.fleet_duration_s,
            args.fleet_outage_at_s,
            args.fleet_outage_s,
            knobs.budget_ratio,
            knobs.min_retries
        );
        let _ = writeln!(
            md,
            "| run | requests | upstream attempts | bound | in the outage: requests / attempts | retries (/metrics) | denied | max window retries / limit | failed: before / in / after the outage | failures by status and reason | last failure sent at s | od-0 out → back s | od-1 out → back s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for r in runs {
            let Some(f) = &r.fleet_503 else { continue };
            let spans = |name: &str| {
                let v: Vec<String> = f
                    .out_of_selection
                    .iter()
                    .filter(|s| s.replica == name)
                    .map(|s| format!("{:.2} → {}", s.out_at_s, opt_s(s.back_at_s)))
                    .collect();
                if v.is_empty() {
                    "-".into()
                } else {
                    v.join("; ")
                }
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.0} | {} / {} | {} | {} | {} / {} | {} / {} / {} | {} | {} | {} | {} |",
                r.run,
                f.requests,
                f.attempts,
                f.bound,
                f.requests_in_outage,
                f.attempts_in_outage,
                causes(&f.retries.metrics),
                causes(
                    &f.retries
                        .denied
                        .iter()
                        .filter(|(_, v)| **v > 0)
                        .map(|(k, v)| (k.clone(), *v))
                        .collect()
                ),
                f.budget.max_window_retries,
                f.budget.limit_at_max,
                f.failed_before,
                f.failed_in_outage,
                f.failed_after,
                f.failures_by
                    .iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                opt_s(f.last_failure_sent_s),
                spans("od-0"),
                spans("od-1"),
            );
        }
    }
    let _ = writeln!(md, "\n### Targets\n");
    for c in checks {
        let _ = writeln!(
            md,
            "- run {} {}: **{}** {}: {}",
            c.run,
            c.scenario,
            if c.pass { "PASS" } else { "FAIL" },
            c.what,
            c.detail
        );
    }
    md
}

pub async fn run(args: &FailoverArgs) -> Result<(), String> {
    args.check()?;
    let bin = procs::sluice_bin(args.sluice_bin.as_deref())?;
    let env = environment();
    let mut runs = Vec::new();
    let mut all_checks = Vec::new();
    let mut knobs = None;
    for run in 1..=args.runs {
        eprintln!(
            "sluice-bench failover: run {run}/{}: replica-loss, {} s",
            args.runs, args.duration_s
        );
        let (loss, k) = replica_loss(args, &bin, &format!("r{run}")).await?;
        eprintln!(
            "  {} requests, {} full, {} refused, {} failed ({} cut by the kill after tokens, {} head only, {} other); retries {}",
            loss.requests,
            loss.full,
            loss.refused,
            loss.failed,
            loss.cut_after_tokens,
            loss.cut_before_token,
            loss.other_failures.len(),
            causes(&loss.retries.metrics)
        );
        let fleet = if args.fleet_duration_s > 0.0 {
            eprintln!(
                "sluice-bench failover: run {run}/{}: fleet-503, {} s",
                args.runs, args.fleet_duration_s
            );
            let f = fleet_503(args, &bin, &format!("r{run}")).await?;
            eprintln!(
                "  {} requests, {} upstream attempts (bound {:.0}), {} failed",
                f.requests, f.attempts, f.bound, f.failed
            );
            Some(f)
        } else {
            None
        };
        let r = RunOut {
            run,
            replica_loss: loss,
            fleet_503: fleet,
        };
        let cs = checks(args, &r, &k);
        for c in &cs {
            eprintln!(
                "  {} {}: {}",
                if c.pass { "PASS" } else { "FAIL" },
                c.what,
                c.detail
            );
        }
        all_checks.extend(cs);
        runs.push(r);
        knobs = Some(k);
    }
    let knobs = knobs.ok_or("no run")?;
    let md = render(args, &knobs, &runs, &all_checks, &env);
    print!("{md}");
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    std::fs::write(&args.out, &md).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let json_path = args.out.with_extension("json");
    let doc = json!({
        "command": command_line(),
        "date": shell("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        "environment": env,
        "knobs": knobs,
        "sim_flags": args.sim_flags(),
        "rate": args.rate,
        "output_tokens": args.output_tokens,
        "runs": runs,
        "checks": all_checks,
        "pass": all_checks.iter().all(|c| c.pass),
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(&json_path, text).map_err(|e| format!("{}: {e}", json_path.display()))?;
    eprintln!(
        "sluice-bench failover: wrote {} and {}",
        args.out.display(),
        json_path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_counts_tokens_across_chunk_boundaries() {
        let mut s = Sse::default();
        let ev =
            |c: &str| format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{c}\"}}}}]}}\n\n");
        let all = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"role\":\"assistant\"}}}}]}}\n\n{}{}data: {{\"choices\":[],\"usage\":{{\"completion_tokens\":2}}}}\n\ndata: [DONE]\n\n",
            ev("tok "),
            ev("tok ")
        );
        let (a, b) = all.as_bytes().split_at(37);
        assert!(!s.feed(a));
        assert!(s.feed(b));
        assert_eq!((s.tokens, s.usage, s.done), (2, Some(2), true));
    }

    #[test]
    fn counters_are_read_by_label_for_the_pool() {
        let m = "# TYPE sluice_upstream_retries_total counter\n\
                 sluice_upstream_retries_total{pool=\"on-demand\",cause=\"connect\"} 4\n\
                 sluice_upstream_retries_total{pool=\"on-demand\",cause=\"5xx\"} 7\n\
                 sluice_upstream_retries_total{pool=\"spot\",cause=\"5xx\"} 9\n\
                 sluice_upstream_retries_totalx{pool=\"on-demand\",cause=\"5xx\"} 1\n";
        let c = counter_by(m, "sluice_upstream_retries_total", "cause");
        assert_eq!(c.get("connect"), Some(&4));
        assert_eq!(c.get("5xx"), Some(&7));
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn spans_follow_health_and_ejection() {
        let poll = |t: f64, healthy: bool, ejected: bool| Poll {
            t_ms: t * 1000.0,
            pool: json!({"backends": [{"backend": "a", "healthy": healthy,
                "ejected": if ejected { json!({"cause": "connect"}) } else { Value::Null }}]}),
        };
        let polls = [
            poll(1.0, true, false),
            poll(2.0, true, true),
            poll(3.0, false, true),
            poll(4.0, true, false),
        ];
        let names = BTreeMap::from([("a".to_string(), "od-0")]);
        let s = out_spans(&polls, &names);
        assert_eq!(s.len(), 1);
        assert_eq!(
            (
                s[0].out_at_s,
                s[0].ejected_at_s,
                s[0].unhealthy_at_s,
                s[0].back_at_s
            ),
            (2.0, Some(2.0), Some(3.0), Some(4.0))
        );
        assert_eq!(s[0].ejection_cause.as_deref(), Some("connect"));
    }

    #[test]
    fn the_plan_alternates_tenants_and_streams_half_of_each() {
        let args = FailoverArgs {
            sluice_bin: None,
            out: PathBuf::new(),
            runs: 1,
            rate: 20.0,
            duration_s: 2.0,
            kill_at_s: 0.5,
            restart_at_s: 1.0,
            unavailable_at_s: 1.5,
            unavailable_until_s: 2.0,
            fleet_duration_s: 0.0,
            fleet_outage_at_s: 0.0,
            fleet_outage_s: 0.0,
            output_tokens: 48,
            max_tokens: 64,
            ttft_ms: 100,
            itl_ms: 20.0,
            sim_ports: vec![1, 2],
            keep: false,
        };
        args.check().unwrap();
        let p = plan(&args, args.duration_s);
        assert_eq!(p.len(), 40);
        assert_eq!(p[1].at_ms, 50);
        for tier in [Tier::Guaranteed, Tier::Standard] {
            let mine: Vec<&Planned> = p.iter().filter(|x| x.tier == tier).collect();
            assert_eq!(mine.len(), 20);
            assert_eq!(mine.iter().filter(|x| x.stream).count(), 10);
        }
    }
}
