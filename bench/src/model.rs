//! The deterministic in-process engine: the scenario's arrivals replayed in simulated time
//! against Sluice's pure policy core (`PolicyEngine::observe` / `decide`, with the rules parsed
//! from the same generated config the live run uses) and a model of the simulator's scheduler
//! (KV budget, running limit, FIFO waiting queue, latency growing with KV usage).
//!
//! It is a model, not a replay of the live system: Sluice's admission and queue, health checks
//! and the SLA-rate window are re-implemented here in a few lines each, and the proxy itself
//! costs nothing. Its value is speed (a run takes milliseconds, so scenarios can be calibrated
//! and policies compared) and a cross-check: when model and live disagree, one of them is wrong.

use std::collections::VecDeque;

use sluice_config::Config;
use sluice_policy::adaptive::Outcome;
use sluice_policy::slo::{self, Dim, Measured};
use sluice_policy::{
    tenant_policy::PolicyRules, Action, PolicyEngine, PolicyState, Pool, PoolSignals, Reason,
    RequestFacts, Tier,
};
use sluice_runtime::signals::vllm_text::{DelaySpan, Histogram, QueueStall};

use crate::model_queue::{Joined, Lent, TierQueue, Waiting};
use crate::record::{Mode, RequestRecord, Run, Sample};
use crate::scenario::{Arrival, EventKind, KvReserve, Scenario, SimParams};

/// Simulated-time step. The live simulator paces decode in 3–20 ms batches, so 2 ms is finer
/// than anything the live run can resolve.
const DT_MS: f64 = 2.0;
/// How long after the arrival window the model keeps draining before calling the rest timeouts.
const DRAIN_LIMIT_MS: f64 = 300_000.0;

struct Job {
    rec: usize,
    /// KV held from admission to the end (the reservation).
    need: u64,
    /// KV the request really fills: prompt plus its answer.
    live: u64,
    /// What Sluice counts as its work in flight: prompt plus `max_tokens` after any cap.
    work: u64,
    prompt: u64,
    tokens: u64,
    /// Remaining prefill, set at admission.
    prefill_left: f64,
    decode_left: f64,
    first_token: bool,
    /// The Sluice tier slot this job holds, released when it ends.
    slot: Option<Tier>,
    /// What its admission was charged (fair share), given back with the slot.
    lent: Option<Lent>,
    /// When it joined the engine's waiting queue.
    queued_at: f64,
    /// vLLM's `priority` (lower first).
    priority: i64,
    /// The pool whose admission controller hears of its end (Sluice runs).
    signal_pool: usize,
}

struct Engine {
    p: SimParams,
    kv_used: u64,
    /// What the running requests really fill (equal to `kv_used` unless reservations cover
    /// whole `max_tokens`): a reservation not yet written costs no decode bandwidth.
    kv_live: u64,
    running: Vec<Job>,
    waiting: VecDeque<Job>,
    healthy: bool,
    /// `vllm:request_queue_time_seconds` as vLLM keeps it: cumulative sum and count.
    queue_time: Histogram,
    /// `vllm:inter_token_latency_seconds`: every decode gap of every running request.
    itl: Histogram,
}

/// What a job did during one step.
enum Step {
    FirstToken(usize),
    Done(Job),
}

impl Engine {
    fn new(p: SimParams) -> Self {
        Self {
            p,
            kv_used: 0,
            kv_live: 0,
            running: Vec::new(),
            waiting: VecDeque::new(),
            healthy: true,
            queue_time: Histogram::default(),
            itl: Histogram::default(),
        }
    }

    fn usage(&self) -> f64 {
        (self.kv_used as f64 / self.p.kv_tokens.max(1) as f64).min(1.0)
    }

    fn factor(&self) -> f64 {
        let live = (self.kv_live as f64 / self.p.kv_tokens.max(1) as f64).min(1.0);
        1.0 + self.p.load_slowdown * live
    }

    fn fits(&self, need: u64) -> bool {
        self.running.len() < self.p.max_running && self.kv_used + need <= self.p.kv_tokens
    }

    /// Strict FIFO, as vLLM's scheduler and the simulator: a big head blocks smaller followers.
    fn admit(&mut self, now: f64) {
        while let Some(at) = self.head() {
            if !self.fits(self.waiting[at].need) {
                break;
            }
            let Some(mut job) = self.waiting.remove(at) else {
                break;
            };
            self.kv_used += job.need;
            self.kv_live += job.live;
            self.queue_time.sum += (now - job.queued_at) / 1000.0;
            self.queue_time.count += 1.0;
            // The simulator computes the prefill time after taking the reservation.
            let base = self.p.ttft_ms as f64
                + job.prompt as f64 * self.p.prefill_us_per_token as f64 / 1000.0;
            job.prefill_left = base * self.factor();
            job.decode_left = job.tokens.saturating_sub(1) as f64;
            self.running.push(job);
        }
    }

    /// The waiting request vLLM's scheduler takes next: the lowest `priority`, then the earliest
    /// arrival, as `--scheduling-policy priority` orders it (FIFO while every priority is 0).
    fn head(&self) -> Option<usize> {
        // `min_by_key` keeps the first of equal keys: the earliest arrival.
        (0..self.waiting.len()).min_by_key(|&i| self.waiting[i].priority)
    }

    fn step(&mut self, now: f64, dt: f64, out: &mut Vec<Step>) {
        let itl = self.p.itl_ms * self.factor();
        let mut i = 0;
        while i < self.running.len() {
            let job = &mut self.running[i];
            let mut left = dt;
            if job.prefill_left > 0.0 {
                let used = left.min(job.prefill_left);
                job.prefill_left -= used;
                left -= used;
            }
            if job.prefill_left <= 0.0 && !job.first_token {
                job.first_token = true;
                out.push(Step::FirstToken(job.rec));
            }
            if job.first_token && left > 0.0 {
                let step = if itl > 0.0 { left / itl } else { f64::INFINITY };
                // The gaps decoded this step, each `itl` long, into vLLM's ITL histogram.
                let decoded = step.min(job.decode_left.max(0.0));
                if decoded > 0.0 && decoded.is_finite() {
                    self.itl.sum += decoded * itl / 1000.0;
                    self.itl.count += decoded;
                }
                job.decode_left -= step;
            }
            if job.first_token && job.decode_left <= 0.0 {
                let job = self.running.swap_remove(i);
                self.kv_used -= job.need;
                self.kv_live -= job.live;
                out.push(Step::Done(job));
            } else {
                i += 1;
            }
        }
        self.admit(now + dt);
    }
}

struct Queued {
    rec: usize,
    enqueued: f64,
    target: Target,
}

/// Where an admitted request goes and its `max_tokens` after any cap.
#[derive(Clone, Copy)]
struct Target {
    engine: usize,
    tokens: u64,
    fallback: bool,
    /// The pool whose controller judges it (as `Pool::signal_index`).
    signal_pool: usize,
    /// vLLM's `priority` (lower first): the tier's, on a pool with `vllm_priority`.
    priority: i64,
}

const ON_DEMAND: usize = 0;
const SPOT: usize = 1;

/// Sluice's estimated work in flight per pool (by signal index): every job it sent, prompt plus
/// the completion budget, until it ends, as the live proxy counts it.
fn inflight_work(engines: &[Engine; 2]) -> [f64; 2] {
    let mut w = [0.0; 2];
    for e in engines {
        for j in e.running.iter().chain(e.waiting.iter()) {
            if j.slot.is_some() {
                w[j.signal_pool] += j.work as f64;
            }
        }
    }
    w
}

/// The engine behind the spot pool (and the fallback): on-demand's own when `shared`.
fn spot_engine(s: &Scenario) -> usize {
    if s.backends.shared {
        ON_DEMAND
    } else {
        SPOT
    }
}

/// The proxy's state in the model.
struct Proxy {
    rules: PolicyRules,
    policy: PolicyEngine,
    state: PolicyState,
    scrape_ms: u64,
    next_scrape: f64,
    inflight: [u32; 3],
    queues: [TierQueue<Queued>; 3],
    queue_wait_ms: f64,
    /// Waiters pushed out of a full queue by a tenant with fewer waiters, to answer 429.
    pushed_out: Vec<Queued>,
    weights: std::collections::HashMap<String, f64>,
    has_fallback: bool,
    /// Both pools and the fallback are one engine (`backends.shared`).
    shared: bool,
    /// Outcomes since the last policy sample, by pool.
    outcomes: [Vec<Outcome>; 2],
    /// Each pool's delay histogram at recent samples, read over the span Sluice reads it.
    last_queue_time: [DelaySpan<Histogram>; 2],
    /// How long each pool's vLLM queue has served nobody, as the scrape reads it.
    stall: [QueueStall; 2],
    /// Each pool's inter-token-latency histogram, read over the same span: the batch's pace.
    last_itl: [DelaySpan<Histogram>; 2],
    /// Spot as Sluice's health checks see it.
    spot_seen_healthy: bool,
    hc_interval: f64,
    next_hc: f64,
    hc_fail: usize,
    hc_ok: usize,
    fail_needed: usize,
    ok_needed: usize,
    sla_window_ms: Option<f64>,
    /// By engine: its pool runs vLLM's priority policy (`vllm_priority`).
    vllm_priority: [bool; 2],
}

impl Proxy {
    /// A request holding a slot of `tier` ended: with fair share its charge is service had and
    /// the slot may be kept for its tenant's next request; otherwise it frees.
    fn give_back(&mut self, tier: Tier, lent: Option<Lent>, now: f64) {
        let kept = lent.is_some_and(|l| self.queues[tier.index()].release(l, now));
        if !kept {
            self.inflight[tier.index()] -= 1;
        }
    }
}

pub struct ModelInput<'a> {
    pub scenario: &'a Scenario,
    pub mode: Mode,
    pub arrivals: &'a [Arrival],
    /// The mode's Sluice config (Sluice modes only).
    pub config: Option<&'a Config>,
    /// Feed the SLA-violation rate to the policy, over this window.
    pub sla_window_ms: Option<u64>,
}

pub fn run(input: ModelInput<'_>) -> Run {
    let s = input.scenario;
    let arrivals = input.arrivals;
    let slo = s.objectives();
    let mut engines = [
        Engine::new(s.backends.on_demand),
        Engine::new(s.backends.spot),
    ];
    let mut records: Vec<RequestRecord> = arrivals
        .iter()
        .map(|a| RequestRecord {
            decision: if input.mode.uses_sluice() {
                String::new()
            } else {
                "direct".into()
            },
            ..RequestRecord::pending(a)
        })
        .collect();
    let mut proxy = input.config.map(|cfg| {
        let rules = cfg.policy_rules();
        let spot = cfg.pools.get("spot").or_else(|| cfg.pools.iter().last());
        let hc = spot
            .map(|p| p.config.health_check.clone())
            .unwrap_or_default();
        let hc = &hc;
        let prio = |name: &str| cfg.pools.get(name).is_some_and(|p| p.config.vllm_priority);
        Proxy {
            vllm_priority: [prio("on-demand"), prio("spot")],
            policy: PolicyEngine::new(rules.clone()),
            rules,
            state: PolicyState::initial(),
            scrape_ms: cfg.signals.scrape_interval_ms,
            next_scrape: 0.0,
            inflight: [0; 3],
            queues: std::array::from_fn(|_| {
                TierQueue::new(
                    cfg.queue.max_size,
                    cfg.queue
                        .fair_share
                        .then(|| cfg.queue.fair_share_half_life_ms()),
                )
            }),
            queue_wait_ms: cfg.queue.max_wait_ms() as f64,
            pushed_out: Vec::new(),
            weights: cfg
                .tenants
                .iter()
                .map(|(n, t)| (n.clone(), t.weight))
                .collect(),
            has_fallback: !cfg.fallbacks.is_empty(),
            shared: s.backends.shared,
            outcomes: Default::default(),
            last_queue_time: Default::default(),
            stall: Default::default(),
            last_itl: Default::default(),
            spot_seen_healthy: true,
            hc_interval: hc.interval_ms as f64,
            next_hc: 0.0,
            hc_fail: 0,
            hc_ok: 0,
            fail_needed: hc.consecutive_failure.max(1),
            ok_needed: hc.consecutive_success.max(1),
            sla_window_ms: input.sla_window_ms.map(|w| w as f64),
        }
    });
    let sp_engine = spot_engine(s);
    let mut events = s.events.clone();
    events.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    let mut next_event = 0;
    let mut next_arrival = 0;
    let mut samples = Vec::new();
    let sample_ms = 200.0;
    let mut next_sample = 0.0;
    // Completions in time order, for the SLA-rate window: (end time, violated).
    let mut completions: VecDeque<(f64, bool)> = VecDeque::new();
    let horizon = s.duration_s * 1000.0;
    let mut now = 0.0f64;
    let mut steps = Vec::new();
    let mut open = arrivals.len();
    // When each request's first token came (ms since the start), streamed or not.
    let mut first_token: Vec<Option<f64>> = vec![None; arrivals.len()];

    while (open > 0 || next_arrival < arrivals.len()) && now <= horizon + DRAIN_LIMIT_MS {
        while next_event < events.len() && events[next_event].at_s * 1000.0 <= now {
            match events[next_event].kind {
                EventKind::SpotHealthy(h) => engines[sp_engine].healthy = h,
            }
            next_event += 1;
        }
        if let Some(p) = proxy.as_mut() {
            if now >= p.next_hc {
                p.next_hc += p.hc_interval;
                if engines[sp_engine].healthy {
                    p.hc_fail = 0;
                    p.hc_ok += 1;
                    if p.hc_ok >= p.ok_needed {
                        p.spot_seen_healthy = true;
                    }
                } else {
                    p.hc_ok = 0;
                    p.hc_fail += 1;
                    if p.hc_fail >= p.fail_needed {
                        p.spot_seen_healthy = false;
                    }
                }
            }
            if now >= p.next_scrape {
                p.next_scrape += p.scrape_ms as f64;
                let sla_rate = p.sla_window_ms.and_then(|w| {
                    while completions.front().is_some_and(|c| c.0 < now - w) {
                        completions.pop_front();
                    }
                    (!completions.is_empty()).then(|| {
                        completions.iter().filter(|c| c.1).count() as f64 / completions.len() as f64
                    })
                });
                let work = inflight_work(&engines);
                // Every request Sluice sent and that has not ended, with its age so far, as
                // the live hub reports its in-flight registry at each tick.
                for e in &engines {
                    for j in e.running.iter().chain(e.waiting.iter()) {
                        if j.slot.is_some() {
                            let r = &records[j.rec];
                            let at = r.at_ms as f64;
                            let o = Outcome::pending(now as u64, r.tier, now - at);
                            // A stream's first token, once it came, as the live registry
                            // reports it (ms from receipt).
                            p.outcomes[j.signal_pool].push(if r.stream {
                                o.streamed(first_token[j.rec].map(|f| f - at), None)
                            } else {
                                o
                            });
                        }
                    }
                }
                let od = &engines[ON_DEMAND];
                let sp = &engines[sp_engine];
                // vLLM's queue delay as Sluice derives it from two scrapes of the histogram.
                let mut delay = |pool: usize, e: &Engine| {
                    let waiting = e.waiting.len() as f64;
                    let stalled = p.stall[pool].observe(now, waiting, Some(e.queue_time.count));
                    let prev = p.last_queue_time[pool].push(now, e.queue_time);
                    prev.and_then(|(at, h)| e.queue_time.interval_delay_ms(&h, waiting, now - at))
                        .map(|d| d.max(stalled))
                };
                // vLLM's mean inter-token latency over the same span: the batch's pace.
                let mut pace = |pool: usize, e: &Engine| {
                    let prev = p.last_itl[pool].push(now, e.itl);
                    prev.and_then(|(_, h)| e.itl.mean_ms_since(&h))
                };
                let (od_itl, sp_itl) = (pace(ON_DEMAND, od), pace(SPOT, sp));
                let signals = PoolSignals {
                    pressure: Some(s.forced_pressure_at(now).unwrap_or(od.usage() * 100.0)),
                    queue_depth: Some(od.waiting.len() as f64),
                    sla_violation_rate: sla_rate,
                    queue_time_ms: delay(ON_DEMAND, od),
                    ttft_ms: None,
                    itl_ms: od_itl,
                    inflight_work: Some(work[ON_DEMAND]),
                };
                let spot = PoolSignals {
                    pressure: Some(sp.usage() * 100.0),
                    queue_depth: Some(sp.waiting.len() as f64),
                    sla_violation_rate: None,
                    queue_time_ms: delay(SPOT, sp),
                    ttft_ms: None,
                    itl_ms: sp_itl,
                    inflight_work: Some(work[SPOT]),
                };
                let [o0, o1] = std::mem::take(&mut p.outcomes);
                p.state = p.policy.sample(&signals, &spot, [&o0, &o1], now as u64);
                if std::env::var_os("SLUICE_MODEL_TRACE").is_some() {
                    let c = &p.state.pools[0];
                    // Per tier, each dimension set: headroom, observed quantile / unloaded.
                    let dims: Vec<String> = Tier::ALL
                        .iter()
                        .map(|t| {
                            let d = &c.dims[t.index()];
                            let one: Vec<String> = Dim::ALL
                                .iter()
                                .filter(|x| d[x.index()].target_ms.is_some())
                                .map(|x| {
                                    let r = &d[x.index()];
                                    format!(
                                        "{}:h{}/{}/{}",
                                        x.as_str(),
                                        r.headroom.map_or("-".into(), |h| format!("{h:.2}")),
                                        r.observed_ms.map_or("-".into(), |v| format!("{v:.1}")),
                                        r.unloaded_ms.map_or("-".into(), |v| format!("{v:.1}")),
                                    )
                                })
                                .collect();
                            format!("{}[{}]", &t.as_str()[..1], one.join(" "))
                        })
                        .collect();
                    eprintln!(
                        "t={:.1} L={:.2} delay={:?} itl={:?} kv={:.0} h={:?} lat={:?} lead={:?} moved={:?} w={} {}",
                        now / 1000.0,
                        c.level,
                        c.delay_ms.map(|d| d.round()),
                        signals.itl_ms.map(|d| (d * 100.0).round() / 100.0),
                        od.usage() * 100.0,
                        c.headroom.map(|h| h.map(|h| (h * 100.0).round() / 100.0)),
                        c.latency_ms.map(|h| h.map(|h| h.round())),
                        c.lead_ms.map(|h| h.map(|h| h.round())),
                        c.moved,
                        od.waiting.len(),
                        dims.join(" ")
                    );
                }
            }
        }
        if now >= next_sample {
            next_sample += sample_ms;
            let p = proxy.as_ref();
            samples.push(Sample {
                t_ms: now as u64,
                kv_on_demand: Some(engines[ON_DEMAND].usage() * 100.0),
                kv_spot: Some(engines[sp_engine].usage() * 100.0),
                waiting_on_demand: Some(engines[ON_DEMAND].waiting.len() as f64),
                waiting_spot: Some(engines[sp_engine].waiting.len() as f64),
                policy_pressure: p.and_then(|p| p.state.signals.pressure),
                states: p.map(|p| p.state.tiers.map(|t| t.state)),
                fallback_active: p.map(|p| p.state.fallback_active),
                inflight: p.map(|p| p.inflight.map(u64::from)),
                queued: p.map(|p| p.queues.each_ref().map(|q| q.len() as u64)),
                levels: p
                    .filter(|p| p.rules.mode == sluice_policy::PolicyMode::Adaptive)
                    .map(|p| p.state.pools.each_ref().map(|c| c.level)),
                shaping: p
                    .filter(|p| p.rules.mode == sluice_policy::PolicyMode::Adaptive)
                    .map(|p| p.state.pools.each_ref().map(|c| c.shaping)),
                pace: Some([ON_DEMAND, sp_engine].map(|e| {
                    let e = &engines[e];
                    (e.p.itl_ms * e.factor(), e.p.itl_ms)
                })),
            });
        }
        while next_arrival < arrivals.len() && arrivals[next_arrival].at_ms as f64 <= now {
            let pos = next_arrival;
            let a = &arrivals[pos];
            next_arrival += 1;
            let rec = &mut records[pos];
            match proxy.as_mut() {
                None => {
                    let spot = a.tier == Tier::BestEffort;
                    rec.pool = if spot { "spot" } else { "on-demand" }.into();
                    let t = Target {
                        engine: if spot { sp_engine } else { ON_DEMAND },
                        tokens: a.max_tokens,
                        fallback: false,
                        signal_pool: usize::from(spot),
                        priority: match input.mode {
                            Mode::Priority => a.tier.index() as i64,
                            _ => 0,
                        },
                    };
                    if !dispatch(&mut engines, pos, a, t, (None, None), rec, now) {
                        open -= 1;
                    }
                }
                Some(p) => {
                    if !arrive(p, &mut engines, pos, a, rec, now) {
                        open -= 1;
                    }
                }
            }
        }
        if let Some(p) = proxy.as_mut() {
            for x in p.pushed_out.drain(..) {
                refuse_waiter(&mut records[x.rec], &x, Reason::QueueDropped, now);
                open -= 1;
            }
            for tier in Tier::ALL {
                let q = &mut p.queues[tier.index()];
                while let Some(w) = q.pop_expired(now) {
                    refuse_waiter(
                        &mut records[w.item.rec],
                        &w.item,
                        Reason::QueueTimedOut,
                        now,
                    );
                    open -= 1;
                }
            }
        }
        for engine in engines.iter_mut() {
            steps.clear();
            engine.step(now, DT_MS, &mut steps);
            for st in steps.drain(..) {
                match st {
                    Step::FirstToken(i) => {
                        let r = &mut records[i];
                        first_token[i] = Some(now + DT_MS);
                        if r.stream {
                            r.ttft_ms = Some(now + DT_MS - r.at_ms as f64);
                        }
                    }
                    Step::Done(job) => {
                        let end = now + DT_MS;
                        let r = &mut records[job.rec];
                        r.status = 200;
                        r.latency_ms = end - r.at_ms as f64;
                        r.completion_tokens = job.tokens;
                        // A stream's pace from its first token to its last, as a client (and
                        // Sluice) measures it; a whole answer has none of its own.
                        if r.stream {
                            r.tpot_ms = first_token[job.rec]
                                .and_then(|f| Measured::tpot_of(f, end, job.tokens));
                        }
                        let violated = !r.met(&slo[r.tier.index()]);
                        completions.push_back((end, violated));
                        open -= 1;
                        if let Some(p) = proxy.as_mut() {
                            if let Some(tier) = job.slot {
                                p.give_back(tier, job.lent, end);
                            }
                            let served = Outcome::served(end as u64, r.tier, r.latency_ms)
                                .with_tokens(Some(job.tokens));
                            p.outcomes[job.signal_pool].push(if r.stream {
                                served.streamed(r.ttft_ms, r.tpot_ms)
                            } else {
                                served
                            });
                        }
                    }
                }
            }
        }
        // Slots freed this step go to queued requests (fair share between tenants or FIFO).
        if let Some(p) = proxy.as_mut() {
            for tier in Tier::ALL {
                // Slots kept for a tenant whose next request did not come in the grace.
                let lapsed = p.queues[tier.index()].expire_kept(now);
                p.inflight[tier.index()] -= lapsed;
                let cap = p.rules.tier(tier).inflight_capacity;
                while !p.queues[tier.index()].is_empty()
                    && (cap == 0 || p.inflight[tier.index()] < cap)
                {
                    let Some((Waiting { item: x, .. }, lent)) =
                        p.queues[tier.index()].pop_next(now)
                    else {
                        break;
                    };
                    p.inflight[tier.index()] += 1;
                    let r = &mut records[x.rec];
                    r.decision = "queue".into();
                    r.reason = Reason::QueueReleased.as_str().into();
                    r.queue_wait_ms = Some(now - x.enqueued);
                    let a = &arrivals[x.rec];
                    let slot = (Some(tier), lent.clone());
                    if !dispatch(&mut engines, x.rec, a, x.target, slot, r, now) {
                        p.give_back(tier, lent, now);
                        open -= 1;
                    }
                }
            }
        }
        now += DT_MS;
    }
    for r in &mut records {
        if r.status == 0 {
            r.latency_ms = now - r.at_ms as f64;
        }
    }
    Run {
        scenario: s.name.clone(),
        mode: input.mode,
        engine: "model",
        duration_s: s.duration_s,
        records,
        samples,
        overhead: None,
        cooldown_ms: proxy.as_ref().map_or(0, |p| p.rules.stability.cooldown_ms),
        recovery_marker_ms: s.recovery_marker_s.map(|x| (x * 1000.0) as u64),
        slo,
        sluice_rss_kib: None,
        notes: Vec::new(),
    }
}

/// One arrival through the modelled proxy. Returns false when the request ended right away.
fn arrive(
    p: &mut Proxy,
    engines: &mut [Engine; 2],
    pos: usize,
    a: &Arrival,
    rec: &mut RequestRecord,
    now: f64,
) -> bool {
    // As in the bench's Sluice config: the fallback is served by spot's backend, which is
    // on-demand's own when the backend is shared (the first pool listing it wins).
    let fallback_pool = if p.shared { Pool::OnDemand } else { Pool::Spot };
    let facts = RequestFacts {
        tier: a.tier,
        shapeable: true,
        fallback_available: p.has_fallback && p.spot_seen_healthy,
        spot_healthy: p.spot_seen_healthy,
        fallback_pool: Some(fallback_pool),
        ticket: sluice_policy::adaptive::ticket_of(&crate::live::request_id(a)),
        prompt_tokens: a.prompt_tokens,
        max_tokens: Some(a.max_tokens),
        inflight_work: inflight_work(engines),
    };
    let d = sluice_policy::decide(&p.state, &p.rules, &facts);
    rec.decision = d.action.name().into();
    rec.reason = d.reason.as_str().into();
    let signal_pool = match d.pool {
        Pool::Fallback => fallback_pool,
        pool => pool,
    }
    .signal_index()
    .unwrap_or(ON_DEMAND);
    // The arrival, as Sluice reports it when the policy decides.
    p.outcomes[signal_pool].push(Outcome::arrival(now as u64, a.tier));
    rec.pool = d.pool.as_str().into();
    if d.action == Action::Reject {
        rec.status = 429;
        return false;
    }
    let asked = slo::Asked {
        slo: p.rules.tier(a.tier).slo,
        stream: a.stream,
        max_tokens: a.max_tokens,
    };
    if slo::refused_estimate(&p.state, &d, &asked).is_some() {
        rec.status = 429;
        rec.decision = "reject".into();
        rec.reason = Reason::RejectSloUnattainable.as_str().into();
        return false;
    }
    let tokens = match d.action.max_tokens_cap() {
        Some(cap) => a.max_tokens.min(u64::from(cap)),
        None => a.max_tokens,
    };
    let engine = if d.pool == Pool::OnDemand || p.shared {
        ON_DEMAND
    } else {
        SPOT
    };
    let target = Target {
        engine,
        tokens,
        fallback: d.pool == Pool::Fallback,
        signal_pool,
        // As the proxy writes it (`crates/proxy/src/admit.rs`): the tier, where the pool asks.
        priority: if p.vllm_priority[engine] {
            a.tier.index() as i64
        } else {
            0
        },
    };
    rec.pool = d.pool.as_str().into();
    let tier = a.tier;
    let cap = p.rules.tier(tier).inflight_capacity;
    let weight = p.weights.get(&a.tenant).copied().unwrap_or(1.0);
    let charge = sluice_policy::fair::charge_of(a.prompt_tokens + tokens, weight);
    let q = &mut p.queues[tier.index()];
    // A slot kept for its tenant (fair share) is already counted.
    let kept = q.take_kept(&a.tenant, now);
    if kept || cap == 0 || (p.inflight[tier.index()] < cap && q.is_empty()) {
        if !kept {
            p.inflight[tier.index()] += 1;
        }
        let lent = q.charge(&a.tenant, charge, now);
        if dispatch(
            engines,
            pos,
            a,
            target,
            (Some(tier), lent.clone()),
            rec,
            now,
        ) {
            return true;
        }
        p.give_back(tier, lent, now);
        return false;
    }
    if d.queue_eligible {
        let w = Waiting {
            item: Queued {
                rec: pos,
                enqueued: now,
                target,
            },
            tenant: a.tenant.clone(),
            charge,
            deadline: now + p.queue_wait_ms,
        };
        match q.join(w, now) {
            Joined::Queued => return true,
            Joined::PushedOut(x) => {
                p.pushed_out.push(x.item);
                return true;
            }
            Joined::Full => {}
        }
    }
    rec.status = 429;
    rec.decision = if d.queue_eligible { "queue" } else { "reject" }.into();
    rec.reason = if d.queue_eligible {
        Reason::QueueDropped
    } else {
        Reason::TierAtCapacity
    }
    .as_str()
    .into();
    false
}

/// The proxy's refusal of a Standard or Best-Effort request whose objective its pool cannot
/// meet now (`crates/proxy/src/admit.rs`, `fn unattainable`), after `decide`, for a request
/// neither rejected nor moved to the fallback: a stream of `tokens` at most.
#[cfg(test)]
fn slo_unattainable(
    state: &PolicyState,
    rules: &PolicyRules,
    d: &sluice_policy::Decision,
    stream: bool,
    tokens: u64,
) -> bool {
    let asked = slo::Asked {
        slo: rules.tier(d.tier).slo,
        stream,
        max_tokens: tokens,
    };
    slo::refused_estimate(state, d, &asked).is_some()
}

/// A queued request answered 429 without being served.
fn refuse_waiter(r: &mut RequestRecord, x: &Queued, reason: Reason, now: f64) {
    r.status = 429;
    r.decision = "queue".into();
    r.reason = reason.as_str().into();
    r.latency_ms = now - r.at_ms as f64;
    r.queue_wait_ms = Some(now - x.enqueued);
}

/// Hands a request (its index in the run's records) to a backend; false when the backend
/// refused it at once.
fn dispatch(
    engines: &mut [Engine; 2],
    pos: usize,
    a: &Arrival,
    t: Target,
    (slot, lent): (Option<Tier>, Option<Lent>),
    rec: &mut RequestRecord,
    now: f64,
) -> bool {
    let e = &mut engines[t.engine];
    if t.fallback {
        rec.pool = "fallback".into();
    }
    if !e.healthy {
        rec.status = 503;
        rec.latency_ms = now - a.at_ms as f64;
        return false;
    }
    let answer = a.answer_tokens(t.tokens);
    let live = a.prompt_tokens + answer;
    let need = match e.p.kv_reserve {
        KvReserve::Output => live,
        KvReserve::MaxTokens => a.prompt_tokens + t.tokens,
    };
    if need > e.p.kv_tokens {
        rec.status = 400;
        return false;
    }
    e.waiting.push_back(Job {
        rec: pos,
        need,
        live,
        work: a.prompt_tokens + t.tokens,
        prompt: a.prompt_tokens,
        tokens: answer,
        prefill_left: 0.0,
        decode_left: 0.0,
        first_token: false,
        slot,
        lent,
        queued_at: now,
        signal_pool: t.signal_pool,
        priority: t.priority,
    });
    e.admit(now);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sluice_conf::{self, Addrs, SlaSignal};
    use sluice_policy::{PressureState, Tier};

    fn rules() -> PolicyRules {
        let s = Scenario::built_in("tiny").unwrap().with_slo_x(2.0).unwrap();
        let dir = std::env::temp_dir();
        let cfg = sluice_conf::for_mode(
            &s,
            Mode::Adaptive,
            &Addrs::placeholder(),
            &dir,
            SlaSignal::Off,
        )
        .unwrap();
        sluice_conf::parse(&cfg, &dir).unwrap().policy_rules()
    }

    fn decision(tier: Tier, action: Action, pool: Pool) -> sluice_policy::Decision {
        sluice_policy::Decision {
            tier,
            state: PressureState::Normal,
            action,
            reason: Reason::AdmittedWithinHeadroom,
            pool,
            route_reason: Reason::AdmittedWithinHeadroom,
            queue_eligible: false,
        }
    }

    #[test]
    fn a_first_token_past_the_target_refuses_lower_tiers_as_the_proxy_does() {
        let rules = rules();
        let target = rules.tier(Tier::Standard).slo.ttft_ms.unwrap() as f64;
        let mut state = PolicyState::initial();
        let od = &mut state.pools[0];
        od.dims[Tier::Standard.index()][Dim::Ttft.index()].unloaded_ms = Some(target / 4.0);
        od.delay_ms = Some(target);
        let pass = |t| decision(t, Action::Pass, Pool::OnDemand);
        // Queue delay plus the learned prefill past the target: refused, never Guaranteed.
        assert!(slo_unattainable(
            &state,
            &rules,
            &pass(Tier::Standard),
            true,
            200
        ));
        assert!(!slo_unattainable(
            &state,
            &rules,
            &pass(Tier::Guaranteed),
            true,
            200
        ));
        // Moved to the fallback, or already refused: judged elsewhere.
        let moved = decision(
            Tier::Standard,
            Action::Fallback { max_tokens: None },
            Pool::Fallback,
        );
        assert!(!slo_unattainable(&state, &rules, &moved, true, 200));
        // A whole answer is judged on its deadline: with the pace learned well under its TPOT
        // target, a long one still makes it where a stream's first token cannot; a one-token
        // answer cannot. Unknown pace: judged as a stream.
        let tpot = rules.tier(Tier::Standard).slo.tpot_ms.unwrap() as f64;
        let whole = |state: &PolicyState, tokens| {
            slo_unattainable(state, &rules, &pass(Tier::Standard), false, tokens)
        };
        assert!(whole(&state, 200));
        state.pools[0].dims[Tier::Standard.index()][Dim::Tpot.index()].unloaded_ms =
            Some(tpot / 4.0);
        assert!(!whole(&state, 200));
        assert!(whole(&state, 1));
        // A cap on the answer is its length.
        let capped = decision(
            Tier::Standard,
            Action::Degrade { max_tokens: 1 },
            Pool::OnDemand,
        );
        assert!(slo_unattainable(&state, &rules, &capped, false, 200));
        state.pools[0].dims[Tier::Standard.index()][Dim::Tpot.index()].unloaded_ms = None;
        // A tier without a learned value of its own borrows the lowest another tier learned;
        // within reach, or with no queue reading, it is admitted.
        state.pools[0].delay_ms = Some(target / 2.0);
        assert!(!slo_unattainable(
            &state,
            &rules,
            &pass(Tier::Standard),
            true,
            200
        ));
        state.pools[0].dims[Tier::Standard.index()][Dim::Ttft.index()].unloaded_ms = None;
        state.pools[0].dims[Tier::Guaranteed.index()][Dim::Ttft.index()].unloaded_ms = Some(target);
        assert!(slo_unattainable(
            &state,
            &rules,
            &pass(Tier::Standard),
            true,
            200
        ));
        state.pools[0].delay_ms = None;
        assert!(!slo_unattainable(
            &state,
            &rules,
            &pass(Tier::Standard),
            true,
            200
        ));
    }

    #[test]
    fn a_priority_backend_takes_the_lowest_priority_first_then_the_earliest() {
        // Room for one request at a time: the order they run in is the order they are taken.
        let p = SimParams {
            kv_tokens: 100,
            ..Scenario::built_in("tiny").unwrap().backends.on_demand
        };
        let job = |rec, priority| Job {
            rec,
            need: 100,
            live: 100,
            work: 100,
            prompt: 10,
            tokens: 1,
            prefill_left: 0.0,
            decode_left: 0.0,
            first_token: false,
            slot: None,
            lent: None,
            queued_at: rec as f64,
            signal_pool: ON_DEMAND,
            priority,
        };
        let order = |priorities: &[i64]| {
            let mut e = Engine::new(p);
            for (rec, &pr) in priorities.iter().enumerate() {
                e.waiting.push_back(job(rec, pr));
            }
            let (mut now, mut ran) = (0.0, Vec::new());
            e.admit(now);
            while !e.running.is_empty() {
                ran.push(e.running[0].rec);
                let mut out = Vec::new();
                while !e.running.is_empty() && e.running[0].rec == ran[ran.len() - 1] {
                    e.step(now, DT_MS, &mut out);
                    now += DT_MS;
                }
            }
            assert!(e.waiting.is_empty());
            ran
        };
        assert_eq!(order(&[0, 0, 0, 0]), [0, 1, 2, 3]);
        assert_eq!(order(&[2, 1, 2, 0, 1]), [3, 1, 4, 0, 2]);
    }

    #[test]
    fn ttft_grows_with_queueing_and_tpot_with_the_batch() {
        // Seed's peak, direct, on the slowdown engine: the streams' first tokens wait and
        // their pace slows against the arrivals of the quiet start.
        let s = Scenario::built_in("seed").unwrap().with_slo_x(2.0).unwrap();
        let arrivals = s.arrivals();
        let run = run(ModelInput {
            scenario: &s,
            mode: Mode::Direct,
            arrivals: &arrivals,
            config: None,
            sla_window_ms: None,
        });
        let window = |from: u64, to: u64, f: fn(&RequestRecord) -> Option<f64>| {
            let v: Vec<f64> = run
                .records
                .iter()
                .filter(|r| r.tier == Tier::Guaranteed && (from..to).contains(&r.at_ms))
                .filter_map(f)
                .collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let (quiet_ttft, peak_ttft) = (
            window(0, 10_000, |r| r.ttft_ms),
            window(28_000, 38_000, |r| r.ttft_ms),
        );
        let (quiet_tpot, peak_tpot) = (
            window(0, 10_000, |r| r.tpot_ms),
            window(28_000, 38_000, |r| r.tpot_ms),
        );
        assert!(peak_ttft > 3.0 * quiet_ttft, "{quiet_ttft} → {peak_ttft}");
        assert!(peak_tpot > 1.5 * quiet_tpot, "{quiet_tpot} → {peak_tpot}");
        // Every served stream has both; a whole answer has neither.
        for r in run.records.iter().filter(|r| r.completed()) {
            assert_eq!(r.ttft_ms.is_some(), r.stream, "{r:?}");
            assert_eq!(
                r.tpot_ms.is_some(),
                r.stream && r.completion_tokens >= 2,
                "{r:?}"
            );
        }
    }

    #[test]
    fn mode_priority_serves_the_tiers_in_order_of_their_priority() {
        // One backend for every tier on `reserve`: in seed's peak, FCFS makes Guaranteed's
        // first tokens wait behind Best-Effort's queue; vLLM's priority policy puts them first,
        // and Best-Effort waits for both tiers above it.
        let s = Scenario::built_in("shared-backend")
            .unwrap()
            .on_engine(crate::scenario::EngineModel::Reserve)
            .with_slo_x(4.0)
            .unwrap();
        let arrivals = s.arrivals();
        let ttft_p90 = |mode: Mode, tier: Tier| {
            let run = run(ModelInput {
                scenario: &s,
                mode,
                arrivals: &arrivals,
                config: None,
                sla_window_ms: None,
            });
            let mut v: Vec<f64> = run
                .records
                .iter()
                .filter(|r| r.tier == tier && r.completed())
                .map(|r| r.ttft_ms.unwrap_or(r.latency_ms))
                .collect();
            v.sort_by(f64::total_cmp);
            v[v.len() * 9 / 10]
        };
        let (g_fcfs, g_prio) = (
            ttft_p90(Mode::Direct, Tier::Guaranteed),
            ttft_p90(Mode::Priority, Tier::Guaranteed),
        );
        let (be_fcfs, be_prio) = (
            ttft_p90(Mode::Direct, Tier::BestEffort),
            ttft_p90(Mode::Priority, Tier::BestEffort),
        );
        assert!(g_prio < 0.5 * g_fcfs, "Guaranteed {g_fcfs} → {g_prio}");
        assert!(be_prio > be_fcfs, "Best-Effort {be_fcfs} → {be_prio}");
    }
}
