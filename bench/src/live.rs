//! The live engine: the scenario's arrivals sent over real HTTP, on their scheduled times, to
//! real `sluice sim` backends — straight (direct, baseline) or through a real `sluice serve`
//! (phase 1, phase 2). Alongside, a sampler reads the simulators' `/metrics` and Sluice's
//! `/status` every 200 ms, timed events flip the spot simulator's health, a forced pressure
//! timeline is written to Sluice's `/admin/pressure`, and Sluice's RSS is watched.
//!
//! Pressure in the policy comes from Sluice scraping the simulators' `/metrics` (the product
//! path) unless the scenario forces a timeline. Pinning the simulator's KV with `/admin/kv`
//! would change only what it reports, never its latency, so load is always what makes it slow.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use sluice_policy::slo::Measured;
use sluice_policy::{PressureState, Tier};
use sluice_record::usage::usage_of;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use crate::procs::{self, HttpClient, Proc};
use crate::record::{HistQuantiles, Mode, RequestRecord, Run, Sample};
use crate::report;
use crate::scenario::{Arrival, EventKind, Scenario};
use crate::sluice_conf::{self, Addrs, SlaSignal, MODEL};

/// A generation that has not finished by then counts as a timeout (status 0).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

pub struct LiveInput<'a> {
    pub scenario: &'a Scenario,
    pub mode: Mode,
    pub arrivals: &'a [Arrival],
    pub bin: &'a Path,
    pub dir: &'a Path,
    pub sla: SlaSignal,
}

/// Completed requests as (end ms since start, violated), for the harness's SLA-rate feed.
type Completions = Arc<Mutex<Vec<(u64, bool)>>>;

pub async fn run(input: LiveInput<'_>) -> Result<Run, String> {
    let s = input.scenario;
    let c = procs::client();
    let spot_models = format!("{MODEL},{}", sluice_conf::FALLBACK_MODEL);
    // A shared backend is one simulator serving both pools and the fallback model.
    let priority = input.mode == Mode::Priority;
    let policy: &[&str] = match priority {
        true => &["--scheduling-policy", "priority"],
        false => &[],
    };
    let od = procs::start_sim_with(
        input.bin,
        "on-demand",
        if s.backends.shared {
            &spot_models
        } else {
            MODEL
        },
        &s.backends.on_demand,
        input.dir,
        policy,
    )
    .await?;
    let own_spot = match s.backends.shared {
        true => None,
        false => Some(
            procs::start_sim_with(
                input.bin,
                "spot",
                &spot_models,
                &s.backends.spot,
                input.dir,
                policy,
            )
            .await?,
        ),
    };
    let spot = own_spot.as_ref().unwrap_or(&od);
    let addrs = Addrs {
        sluice: procs::free_addr()?,
        ops: procs::free_addr()?,
        on_demand: od.addr.clone(),
        spot: spot.addr.clone(),
    };
    let cfg = sluice_conf::for_mode(s, input.mode, &addrs, input.dir, input.sla);
    let mut notes = Vec::new();
    let (sluice, cooldown_ms, sla_window) = match &cfg {
        Some(cfg) => {
            let parsed = sluice_conf::parse(cfg, input.dir)?;
            let p = procs::start_sluice(input.bin, cfg, input.dir).await?;
            wait_for_signals(
                &c,
                &p,
                input.mode == Mode::Phase2 && input.sla == SlaSignal::Ledger,
            )
            .await?;
            let window = sluice_conf::sla_window_ms(cfg);
            if input.mode == Mode::Phase2 {
                notes.push(format!(
                    "SLA-violation-rate signal: {} ({} s window)",
                    match input.sla {
                        SlaSignal::Ledger => "Sluice's PostgreSQL ledger",
                        SlaSignal::Harness => "harness-fed via /admin/sla-violation-rate",
                        SlaSignal::Off => "off",
                    },
                    window / 1000
                ));
            }
            (Some(p), parsed.policy_rules().stability.cooldown_ms, window)
        }
        None => (None, 0, 0),
    };
    if !s.forced_pressure.is_empty() && sluice.is_some() {
        notes.push("pressure forced through PUT /admin/pressure".into());
    }

    let slo = s.objectives();
    let start = Instant::now() + Duration::from_millis(300);
    let stop = Arc::new(AtomicBool::new(false));
    let completions: Completions = Arc::default();
    let peak_rss = Arc::new(AtomicU64::new(0));

    let sampler = tokio::spawn(sample_loop(
        c.clone(),
        od.url("/metrics"),
        spot.url("/metrics"),
        sluice.as_ref().map(|p| p.ops_url("/status")),
        sluice.as_ref().map(Proc::pid),
        start,
        Arc::clone(&stop),
        Arc::clone(&peak_rss),
    ));
    let mut side = Vec::new();
    for e in &s.events {
        let c = c.clone();
        let url = spot.url("/admin/health");
        let e = e.clone();
        side.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(e.at_s)).await;
            match e.kind {
                EventKind::SpotHealthy(h) => {
                    if let Err(err) = procs::put_json(&c, &url, &json!({"healthy": h})).await {
                        eprintln!("sluice-bench: event failed: {err}");
                    }
                }
            }
        }));
    }
    if let (Some(p), false) = (&sluice, s.forced_pressure.is_empty()) {
        side.push(tokio::spawn(force_pressure(
            c.clone(),
            p.ops_url("/admin/pressure"),
            s.clone(),
            start,
            Arc::clone(&stop),
        )));
    }
    if let (Some(p), Mode::Phase2, SlaSignal::Harness) = (&sluice, input.mode, input.sla) {
        side.push(tokio::spawn(feed_sla(
            c.clone(),
            p.ops_url("/admin/sla-violation-rate"),
            Arc::clone(&completions),
            sla_window,
            start,
            Arc::clone(&stop),
        )));
    }

    let mut tasks = Vec::with_capacity(input.arrivals.len());
    for a in input.arrivals {
        let url = match (&sluice, a.tier) {
            (Some(p), _) => p.url("/v1/chat/completions"),
            (None, Tier::BestEffort) => spot.url("/v1/chat/completions"),
            (None, _) => od.url("/v1/chat/completions"),
        };
        let direct_pool = if a.tier == Tier::BestEffort {
            "spot"
        } else {
            "on-demand"
        };
        let c = c.clone();
        let a = a.clone();
        let completions = Arc::clone(&completions);
        let objective = slo[a.tier.index()];
        let proxied = sluice.is_some();
        tasks.push(tokio::spawn(async move {
            let due = start + Duration::from_millis(a.at_ms);
            tokio::time::sleep_until(due).await;
            let mut r = send(&c, &url, &a, priority, due).await;
            if !proxied {
                r.decision = "direct".into();
                r.pool = direct_pool.into();
            }
            if r.completed() {
                let end = (Instant::now() - start).as_millis() as u64;
                completions
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((end, !r.met(&objective)));
            }
            r
        }));
    }
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        records.push(t.await.map_err(|e| e.to_string())?);
    }
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.await.map_err(|e| e.to_string())?;
    for t in side {
        t.abort();
    }
    let overhead = match &sluice {
        Some(p) => {
            let (_, body) = procs::request(&c, "GET", &p.ops_url("/metrics"), None).await?;
            report::histogram_quantiles(
                &String::from_utf8_lossy(&body),
                "sluice_proxy_overhead_seconds",
            )
        }
        None => None,
    };
    let rss = peak_rss.load(Ordering::Relaxed);
    drop(sluice);
    drop(own_spot);
    drop(od);
    Ok(Run {
        scenario: s.name.clone(),
        mode: input.mode,
        engine: "live",
        duration_s: s.duration_s,
        records,
        samples,
        overhead: overhead.map(|(count, p50, p99)| HistQuantiles {
            count,
            p50_ms: p50 * 1000.0,
            p99_ms: p99 * 1000.0,
        }),
        cooldown_ms,
        recovery_marker_ms: s.recovery_marker_s.map(|x| (x * 1000.0) as u64),
        slo,
        sluice_rss_kib: (rss > 0).then_some(rss),
        notes,
    })
}

/// Waits for the first scrape of both pools so the run starts with the policy informed, and,
/// when the ledger feeds the SLA rate, for the ledger to be reachable.
async fn wait_for_signals(c: &HttpClient, p: &Proc, ledger: bool) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        if let Ok(st) = procs::get_json(c, &p.ops_url("/status")).await {
            let have = |pool: &str| st["signals"][pool]["pressure"]["value"].is_number();
            let ledger_ok = !ledger
                || (st["dependencies"]["ledger"] == json!(true)
                    && st["signals"]["on-demand"]["sla_violation_rate"]["value"].is_number());
            if have("on-demand") && have("spot") && ledger_ok {
                return Ok(());
            }
            last = st;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "Sluice never reported both pools' pressure{}; last /status: signals {} dependencies {} ledger {}",
        if ledger { " and a reachable ledger (try --sla-signal harness)" } else { "" },
        last["signals"],
        last["dependencies"],
        last["ledger"]
    ))
}

/// Sends one request and records what came back.
/// `priority`: the tier goes as vLLM's `priority` (mode `priority`, no proxy in between).
async fn send(
    c: &HttpClient,
    url: &str,
    a: &Arrival,
    priority: bool,
    due: Instant,
) -> RequestRecord {
    let mut body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "x".repeat(a.prompt_tokens as usize * 4)}],
        "max_tokens": a.max_tokens,
    });
    if priority {
        body["priority"] = json!(a.tier.index());
    }
    if a.stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    let sent = Instant::now();
    let mut r = RequestRecord {
        send_lag_ms: (sent - due).as_secs_f64() * 1000.0,
        ..RequestRecord::pending(a)
    };
    let mut req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("x-tenant-id", &a.tenant)
        .header("x-request-id", request_id(a));
    // The simulator's stand-in for a model that stops on its own before `max_tokens`.
    if let Some(n) = a.output_tokens {
        req = req.header("x-sim-output-tokens", n);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string())));
    let Ok(req) = req else { return r };
    let mut last_token_ms: Option<f64> = None;
    let exchange = async {
        let resp = c.request(req).await.map_err(|_| ())?;
        r.status = resp.status().as_u16();
        let h = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        r.decision = h("x-sluice-decision");
        r.reason = h("x-sluice-reason");
        r.pool = h("x-sluice-pool");
        r.queue_wait_ms = h("x-sluice-queue-wait-ms").parse().ok();
        let mut body = resp.into_body();
        let mut tail: Vec<u8> = Vec::new();
        let mut tokens = ContentScan::default();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| ())?;
            if let Ok(data) = frame.into_data() {
                // A stream's first and last token: the chunks that carry content (the opening
                // role chunk and the closing finish, usage and [DONE] chunks carry none).
                if a.stream && tokens.feed(&data) {
                    let at = sent.elapsed().as_secs_f64() * 1000.0;
                    r.ttft_ms.get_or_insert(at);
                    last_token_ms = Some(at);
                }
                tail.extend_from_slice(&data);
                // A stream's usage chunk comes last: keep its tail only, so memory stays flat.
                // A plain body is parsed whole.
                if a.stream && tail.len() > 8192 {
                    tail.drain(..tail.len() - 4096);
                }
            }
        }
        Ok::<_, ()>(tail)
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
        Ok(Ok(tail)) => {
            r.latency_ms = sent.elapsed().as_secs_f64() * 1000.0;
            if r.completed() {
                // The very reader Sluice uses for its own records.
                r.completion_tokens = usage_of(&tail, a.stream).1.unwrap_or(0);
                r.tpot_ms = r
                    .ttft_ms
                    .zip(last_token_ms)
                    .and_then(|(first, last)| Measured::tpot_of(first, last, r.completion_tokens));
            } else {
                r.ttft_ms = None;
            }
        }
        _ => {
            // No complete response: a timeout or a cut connection counts as an error.
            r.status = if r.status == 200 { 0 } else { r.status };
            r.latency_ms = sent.elapsed().as_secs_f64() * 1000.0;
            r.ttft_ms = None;
        }
    }
    r
}

#[allow(clippy::too_many_arguments)]
async fn sample_loop(
    c: HttpClient,
    od_metrics: String,
    spot_metrics: String,
    status: Option<String>,
    sluice_pid: Option<u32>,
    start: Instant,
    stop: Arc<AtomicBool>,
    peak_rss: Arc<AtomicU64>,
) -> Vec<Sample> {
    let mut out = Vec::new();
    let mut tick = tokio::time::interval_at(start, SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let t_ms = (Instant::now() - start).as_millis() as u64;
        let (od, sp, st) = tokio::join!(
            procs::request(&c, "GET", &od_metrics, None),
            procs::request(&c, "GET", &spot_metrics, None),
            async {
                match &status {
                    Some(u) => procs::get_json(&c, u).await.ok(),
                    None => None,
                }
            }
        );
        let kv = |m: &Result<(u16, Bytes), String>, name: &str| {
            m.as_ref()
                .ok()
                .and_then(|(_, b)| procs::gauge_sum(&String::from_utf8_lossy(b), name))
        };
        let mut s = Sample {
            t_ms,
            kv_on_demand: kv(&od, "vllm:kv_cache_usage_perc").map(|v| v * 100.0),
            kv_spot: kv(&sp, "vllm:kv_cache_usage_perc").map(|v| v * 100.0),
            waiting_on_demand: kv(&od, "vllm:num_requests_waiting"),
            waiting_spot: kv(&sp, "vllm:num_requests_waiting"),
            ..Default::default()
        };
        if let Some(st) = st {
            s.policy_pressure = st["signals"]["on-demand"]["pressure"]["value"].as_f64();
            s.fallback_active = st["fallback"]["active"].as_bool();
            let tiers = st["tiers"].as_array().cloned().unwrap_or_default();
            let find = |t: Tier| tiers.iter().find(|x| x["tier"] == t.as_str()).cloned();
            let state = |v: &Value| match v["state"].as_str() {
                Some("Elevated") => PressureState::Elevated,
                Some("Critical") => PressureState::Critical,
                _ => PressureState::Normal,
            };
            if Tier::ALL.iter().all(|&t| find(t).is_some()) {
                let get = |t: Tier| find(t).unwrap_or(Value::Null);
                s.states = Some(Tier::ALL.map(|t| state(&get(t))));
                s.inflight = Some(Tier::ALL.map(|t| get(t)["inflight"].as_u64().unwrap_or(0)));
                s.queued = Some(Tier::ALL.map(|t| get(t)["queued"].as_u64().unwrap_or(0)));
            }
            let ac = &st["admission_control"];
            if ac["enabled"].as_bool() == Some(true) {
                let level = |p: &str| ac["pools"][p]["level"].as_f64().unwrap_or(0.0);
                s.levels = Some([level("on-demand"), level("spot")]);
                let shaping = |p: &str| ac["pools"][p]["shaping"].as_bool().unwrap_or(false);
                s.shaping = Some([shaping("on-demand"), shaping("spot")]);
            }
        }
        if let Some(pid) = sluice_pid {
            if let Some(rss) = procs::rss_kib(pid) {
                peak_rss.fetch_max(rss, Ordering::Relaxed);
            }
        }
        out.push(s);
    }
    out
}

async fn force_pressure(
    c: HttpClient,
    url: String,
    s: Scenario,
    start: Instant,
    stop: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval_at(start, Duration::from_millis(250));
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let t = (Instant::now() - start).as_secs_f64() * 1000.0;
        if let Some(p) = s.forced_pressure_at(t) {
            let _ = procs::put_json(&c, &url, &json!({"value": p})).await;
        }
    }
}

async fn feed_sla(
    c: HttpClient,
    url: String,
    completions: Completions,
    window_ms: u64,
    start: Instant,
    stop: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval_at(start, Duration::from_millis(500));
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let now = (Instant::now() - start).as_millis() as u64;
        let rate = {
            let all = completions.lock().unwrap_or_else(PoisonError::into_inner);
            let recent: Vec<bool> = all
                .iter()
                .filter(|(end, _)| *end + window_ms >= now)
                .map(|(_, v)| *v)
                .collect();
            if recent.is_empty() {
                0.0
            } else {
                recent.iter().filter(|v| **v).count() as f64 / recent.len() as f64
            }
        };
        let _ = procs::put_json(&c, &url, &json!({"value": rate})).await;
    }
}

/// Finds token content in a server-sent event stream read chunk by chunk: a `"content":"…"`
/// or `"text":"…"` field with at least one character (chat chunks and completion chunks),
/// across chunk boundaries.
#[derive(Default)]
pub struct ContentScan {
    /// The last bytes of the previous chunk, so a field split between two is still found.
    carry: Vec<u8>,
}

impl ContentScan {
    const KEYS: [&'static [u8]; 2] = [b"\"content\":", b"\"text\":"];

    /// Whether `data` carries token content.
    pub fn feed(&mut self, data: &[u8]) -> bool {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(data);
        let found = Self::KEYS.iter().any(|k| has_nonempty_string(&buf, k));
        let keep = buf.len().min(16);
        self.carry = buf[buf.len() - keep..].to_vec();
        found
    }
}

/// `key` followed (after optional spaces) by a JSON string of at least one character.
fn has_nonempty_string(buf: &[u8], key: &[u8]) -> bool {
    let mut from = 0;
    while let Some(i) = buf[from..].windows(key.len()).position(|w| w == key) {
        let mut j = from + i + key.len();
        while buf.get(j) == Some(&b' ') {
            j += 1;
        }
        if buf.get(j) == Some(&b'"') && buf.get(j + 1).is_some_and(|c| *c != b'"') {
            return true;
        }
        from = from + i + 1;
    }
    false
}

/// The id a request is sent with; the model derives the same policy ticket from it.
pub fn request_id(a: &Arrival) -> String {
    format!("bench-{}", a.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_found_in_token_chunks_only() {
        let mut s = ContentScan::default();
        let role =
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
        assert!(!s.feed(role));
        assert!(s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"tok \"}}]}\n\n"));
        // Split across two reads.
        let mut s = ContentScan::default();
        assert!(!s.feed(b"data: {\"choices\":[{\"delta\":{\"cont"));
        assert!(s.feed(b"ent\": \"x\"}}]}\n\n"));
        // Completions carry text; the usage and [DONE] chunks carry none.
        assert!(ContentScan::default().feed(b"{\"choices\":[{\"text\":\"a\"}]}"));
        assert!(!ContentScan::default().feed(
            b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\ndata: [DONE]\n\n"
        ));
        assert!(!ContentScan::default()
            .feed(b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"));
    }
}
