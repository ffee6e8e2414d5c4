//! `sluice-bench fleet`: replica selection inside a pool, live. Real `sluice sim` replicas (prefix
//! caching on), a real `sluice serve` on the shipped `conf/sluice.yaml` with only its addresses,
//! pools, backends and `selection` changed, real streamed HTTP, open-loop Poisson arrivals from a
//! fixed seed, the same arrivals for every selection.
//!
//! The fleet: `llama-3-70b` on the on-demand pool `on-demand` (three replicas) and the spot pool
//! `spot` (one), `llama-3-8b` on its own on-demand pool `small` (one). The 70b traffic shares a
//! few long system prompts, each followed by a unique user turn: the case prefix affinity is for.
//! Three scenarios:
//!
//! - `shared` (default workload): round robin, least load and prefix affinity compared on time
//!   to first token, SLA violations, goodput and the replicas' prefix-cache hit rate;
//! - `no-shared-prefix`: the same arrivals with every prompt unique, where affinity has nothing
//!   to win and must not lose (judged against round robin's own spread, by bootstrap);
//! - `slow-replica`: one on-demand replica answers slower (`PUT /admin/latency`); least load
//!   should send it far fewer requests than round robin, and Guaranteed keep its SLA.
//!
//! Two more, at GPU-like timings (a decode step of 15 ms, prefill paid per uncached token) and
//! at fractions of the on-demand pool's capacity (0.6 and 0.9 by default), each over several
//! seeds: `heads-fit`, a few system prompts that the homes' prefix caches hold, and
//! `heads-thrash`, more system prompts than the pool's free cache holds. Each reports the
//! on-demand pool's hit rate against its ceiling (the system prompts' share of its prompt
//! tokens) and each tier's TTFT p95 for round robin, least load and prefix affinity, with the
//! spread over seeds. The replicas report the cached tokens in `usage` (vLLM's
//! `--enable-prompt-tokens-details`), from which prefix affinity judges whether its homes pay.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde_json::{json, Value};
use sluice_policy::slo::Slo;
use sluice_policy::Tier;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

use crate::procs::{self, HttpClient, Proc, WorkDir};
use crate::record::RequestRecord;
use crate::report::{self, percentile};
use crate::scenario::{Arrival, Rng};

const MAIN_MODEL: &str = "llama-3-70b";
const SMALL_MODEL: &str = "llama-3-8b";
/// A generation not finished by then counts as an error (status 0).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Resamples of round robin's records for its spread.
const BOOTSTRAP: usize = 400;
/// Arrivals resampled together for round robin's spread.
const BLOCK_MS: u64 = 5000;

/// How a pool picks its replica (`pools.<name>.selection`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
pub enum Selection {
    #[value(name = "round_robin")]
    #[serde(rename = "round_robin")]
    RoundRobin,
    #[value(name = "least_load")]
    #[serde(rename = "least_load")]
    LeastLoad,
    #[value(name = "prefix_affinity")]
    #[serde(rename = "prefix_affinity")]
    PrefixAffinity,
}

impl Selection {
    fn as_str(self) -> &'static str {
        match self {
            Selection::RoundRobin => "round_robin",
            Selection::LeastLoad => "least_load",
            Selection::PrefixAffinity => "prefix_affinity",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Scenario {
    Shared,
    NoSharedPrefix,
    SlowReplica,
    HeadsFit,
    HeadsThrash,
}

impl Scenario {
    fn as_str(self) -> &'static str {
        match self {
            Scenario::Shared => "shared",
            Scenario::NoSharedPrefix => "no-shared-prefix",
            Scenario::SlowReplica => "slow-replica",
            Scenario::HeadsFit => "heads-fit",
            Scenario::HeadsThrash => "heads-thrash",
        }
    }

    fn heads(self) -> bool {
        matches!(self, Scenario::HeadsFit | Scenario::HeadsThrash)
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct FleetArgs {
    /// The `sluice` binary (default: next to this one).
    #[arg(long)]
    pub sluice_bin: Option<PathBuf>,
    /// The markdown report; the JSON goes alongside (same name, `.json`).
    #[arg(long, default_value = "bench/results/fleet.md")]
    pub out: PathBuf,
    /// Run the shared-system-prompt scenario (without any scenario flag: all three).
    #[arg(long)]
    pub shared_prefix: bool,
    /// Run the scenario where every prompt is unique.
    #[arg(long)]
    pub no_shared_prefix: bool,
    /// Run the scenario with one on-demand replica slowed through PUT /admin/latency.
    #[arg(long)]
    pub slow_replica: bool,
    /// Run the GPU-like workload whose system prompts fit in the homes' prefix caches (not
    /// part of the default three).
    #[arg(long)]
    pub heads_fit: bool,
    /// Run the GPU-like workload with more system prompts than the pool's free cache holds
    /// (not part of the default three).
    #[arg(long)]
    pub heads_thrash: bool,
    /// heads-*: arrival rates as fractions of the on-demand pool's capacity with nothing cached.
    #[arg(long, value_delimiter = ',', default_value = "0.6,0.9")]
    pub loads: Vec<f64>,
    /// heads-*: seeds per load and selection (`--seed`, `--seed` + 1, ...), for the spread.
    #[arg(long, default_value_t = 2)]
    pub seeds: u64,
    /// heads-*: seconds of arrivals per run.
    #[arg(long, default_value_t = 30.0)]
    pub heads_duration_s: f64,
    /// heads-*: the first seconds of arrivals are sent but not measured (caches fill, prefix
    /// affinity learns whether its homes pay); the simulators' hit counters are read from then.
    #[arg(long, default_value_t = 10.0)]
    pub heads_warmup_s: f64,
    /// heads-fit: distinct system prompts.
    #[arg(long, default_value_t = 6)]
    pub heads_fit_prompts: usize,
    /// heads-thrash: distinct system prompts.
    #[arg(long, default_value_t = 32)]
    pub heads_thrash_prompts: usize,
    /// heads-*: tokens of the unique user turn after the system prompt: min,max.
    #[arg(long, value_delimiter = ',', default_value = "200,1500")]
    pub heads_user_tokens: Vec<u64>,
    /// heads-*: max_tokens (the answer's length): min,max.
    #[arg(long, value_delimiter = ',', default_value = "32,96")]
    pub heads_max_tokens: Vec<u64>,
    /// heads-*: a 70b replica's decode step, ms (a GPU's: 15-40).
    #[arg(long, default_value_t = 15.0)]
    pub heads_itl_ms: f64,
    /// heads-*: a 70b replica's prefill cost per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 100)]
    pub heads_prefill_us_per_token: u64,
    /// heads-*: running sequences per replica.
    #[arg(long, default_value_t = 8)]
    pub heads_max_running: usize,
    /// heads-*: KV-cache tokens per replica: room for the running batch...
    #[arg(long, default_value_t = 65_536)]
    pub heads_kv_tokens: u64,
    /// heads-*: ... and tokens of cached blocks no request uses that a replica keeps (`sluice
    /// sim --prefix-cache-tokens`): three 2,000-token system prompts. heads-fit's prompts, two a
    /// replica when each stays on one, fit; on every replica they do not, nor do heads-thrash's.
    #[arg(long, default_value_t = 6144)]
    pub heads_prefix_cache_tokens: u64,
    /// Replicas without vLLM's `--enable-prompt-tokens-details`: answers do not say what was
    /// cached, and prefix affinity keeps its homes without judging them.
    #[arg(long)]
    pub no_prompt_tokens_details: bool,
    /// Selections of the shared and no-shared-prefix scenarios (round_robin first: the yardstick).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round_robin,least_load,prefix_affinity"
    )]
    pub selections: Vec<Selection>,
    /// Selections of the slow-replica scenario (prefix affinity too: it is the shipped default).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round_robin,least_load,prefix_affinity"
    )]
    pub slow_selections: Vec<Selection>,
    /// Seconds of arrivals per run.
    #[arg(long, default_value_t = 60.0)]
    pub duration_s: f64,
    /// Arrivals per second over the whole fleet (Poisson).
    #[arg(long, default_value_t = 40.0)]
    pub rate: f64,
    /// Share of the arrivals for llama-3-8b.
    #[arg(long, default_value_t = 0.22)]
    pub small_share: f64,
    /// Tenant weights of support-bot (Guaranteed), coding-assistant (Standard) and
    /// batch-analytics (Best-Effort), for each model.
    #[arg(long, value_delimiter = ',', default_value = "40,40,20")]
    pub tier_weights: Vec<f64>,
    #[arg(long, default_value_t = 20_251)]
    pub seed: u64,
    /// Distinct system prompts the 70b traffic shares.
    #[arg(long, default_value_t = 8)]
    pub shared_prompts: usize,
    /// Tokens of each system prompt (4 characters a token).
    #[arg(long, default_value_t = 2000)]
    pub system_tokens: u64,
    /// Tokens of the unique user turn after it: min,max.
    #[arg(long, value_delimiter = ',', default_value = "50,150")]
    pub user_tokens: Vec<u64>,
    /// Tokens of a llama-3-8b prompt (unique): min,max.
    #[arg(long, value_delimiter = ',', default_value = "200,600")]
    pub small_prompt_tokens: Vec<u64>,
    /// max_tokens of every request: min,max (the simulator generates exactly max_tokens).
    #[arg(long, value_delimiter = ',', default_value = "32,64")]
    pub max_tokens: Vec<u64>,
    /// KV-cache tokens of each replica: room for about half the shared prompts, so the share
    /// affinity gives a replica fits but not all of them (when every replica can hold every
    /// shared prompt, round robin ends up caching them all too).
    #[arg(long, default_value_t = 8192)]
    pub kv_tokens: u64,
    /// Running sequences per replica (vLLM max_num_seqs).
    #[arg(long, default_value_t = 4)]
    pub max_running: usize,
    #[arg(long, default_value_t = 20)]
    pub ttft_ms: u64,
    /// Prefill cost per uncached prompt token of a 70b replica (the 8b one: a quarter).
    #[arg(long, default_value_t = 100)]
    pub prefill_us_per_token: u64,
    /// Inter-token latency of a 70b replica (the 8b one: half).
    #[arg(long, default_value_t = 3.0)]
    pub itl_ms: f64,
    #[arg(long, default_value_t = 0.3)]
    pub load_slowdown: f64,
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// Added to the slowed replica's time to first token in the slow-replica scenario.
    #[arg(long, default_value_t = 1000.0)]
    pub slow_extra_ms: f64,
    /// Ports of od-0, od-1, od-2, spot-0 and small-0 on 127.0.0.1, the same in every run:
    /// prefix affinity's Ketama ring hashes the backends' addresses, so fixed addresses give
    /// every run (and every rerun) the same prompt → replica map.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "28101,28102,28103,28104,28105"
    )]
    pub sim_ports: Vec<u16>,
    /// Keep each run's configs and logs (their directory is printed).
    #[arg(long)]
    pub keep: bool,
}

impl FleetArgs {
    fn scenarios(&self) -> Vec<Scenario> {
        let picked: Vec<Scenario> = [
            (self.shared_prefix, Scenario::Shared),
            (self.no_shared_prefix, Scenario::NoSharedPrefix),
            (self.slow_replica, Scenario::SlowReplica),
            (self.heads_fit, Scenario::HeadsFit),
            (self.heads_thrash, Scenario::HeadsThrash),
        ]
        .into_iter()
        .filter_map(|(on, s)| on.then_some(s))
        .collect();
        if picked.is_empty() {
            vec![
                Scenario::Shared,
                Scenario::NoSharedPrefix,
                Scenario::SlowReplica,
            ]
        } else {
            picked
        }
    }

    fn check(&self) -> Result<(), String> {
        let pair = |name: &str, v: &[u64]| match v {
            [lo, hi] if lo <= hi => Ok(()),
            _ => Err(format!("--{name} takes min,max")),
        };
        pair("user-tokens", &self.user_tokens)?;
        pair("small-prompt-tokens", &self.small_prompt_tokens)?;
        pair("max-tokens", &self.max_tokens)?;
        pair("heads-user-tokens", &self.heads_user_tokens)?;
        pair("heads-max-tokens", &self.heads_max_tokens)?;
        if self.loads.is_empty()
            || self.loads.iter().any(|l| l.is_nan() || *l <= 0.0)
            || self.seeds == 0
        {
            return Err("--loads takes positive fractions, --seeds at least 1".into());
        }
        if !(self.heads_duration_s > self.heads_warmup_s && self.heads_warmup_s >= 0.0) {
            return Err("--heads-duration-s must exceed --heads-warmup-s".into());
        }
        if self.heads_fit_prompts == 0 || self.heads_thrash_prompts == 0 {
            return Err("--heads-*-prompts must be at least 1".into());
        }
        if self.tier_weights.len() != 3 || self.tier_weights.iter().any(|w| *w < 0.0) {
            return Err("--tier-weights takes three non-negative weights".into());
        }
        if !(self.rate > 0.0 && self.duration_s > 0.0) {
            return Err("--rate and --duration-s must be positive".into());
        }
        if self.sim_ports.len() != 5 {
            return Err("--sim-ports takes five ports".into());
        }
        if !(0.0..=1.0).contains(&self.small_share) || self.shared_prompts == 0 {
            return Err("--small-share must be in 0..=1, --shared-prompts at least 1".into());
        }
        Ok(())
    }

    fn range(v: &[u64]) -> [u64; 2] {
        [v[0], v[1]]
    }
}

/// One run's replicas and traffic: the flags' shared-prompt workload, or a heads workload at a
/// load and seed.
#[derive(Debug, Clone, Serialize)]
struct Workload {
    kv_tokens: u64,
    max_running: usize,
    ttft_ms: u64,
    prefill_us_per_token: u64,
    itl_ms: f64,
    load_slowdown: f64,
    block_size: u64,
    prefix_cache_tokens: Option<u64>,
    /// `sluice sim --serial-prefill`: prefills take turns on the replica's compute.
    serial_prefill: bool,
    prompt_tokens_details: bool,
    rate: f64,
    duration_s: f64,
    /// Arrivals before this are not measured.
    warmup_s: f64,
    seed: u64,
    shared_prompts: usize,
    system_tokens: u64,
    user_tokens: [u64; 2],
    max_tokens: [u64; 2],
    small_share: f64,
    small_prompt_tokens: [u64; 2],
    tier_weights: Vec<f64>,
    /// The rate as a fraction of the on-demand pool's capacity (heads workloads).
    load: Option<f64>,
}

/// On-demand replicas in the fleet (od-0, od-1, od-2).
const ON_DEMAND_REPLICAS: f64 = 3.0;

impl Workload {
    fn of(args: &FleetArgs) -> Self {
        Workload {
            kv_tokens: args.kv_tokens,
            max_running: args.max_running,
            ttft_ms: args.ttft_ms,
            prefill_us_per_token: args.prefill_us_per_token,
            itl_ms: args.itl_ms,
            load_slowdown: args.load_slowdown,
            block_size: args.block_size,
            prefix_cache_tokens: None,
            serial_prefill: false,
            prompt_tokens_details: !args.no_prompt_tokens_details,
            rate: args.rate,
            duration_s: args.duration_s,
            warmup_s: 0.0,
            seed: args.seed,
            shared_prompts: args.shared_prompts,
            system_tokens: args.system_tokens,
            user_tokens: FleetArgs::range(&args.user_tokens),
            max_tokens: FleetArgs::range(&args.max_tokens),
            small_share: args.small_share,
            small_prompt_tokens: FleetArgs::range(&args.small_prompt_tokens),
            tier_weights: args.tier_weights.clone(),
            load: None,
        }
    }

    /// A heads workload: GPU-like replicas, `load` × the on-demand pool's capacity.
    fn heads(args: &FleetArgs, sc: Scenario, load: f64, seed: u64) -> Self {
        let mut w = Workload {
            kv_tokens: args.heads_kv_tokens,
            max_running: args.heads_max_running,
            prefill_us_per_token: args.heads_prefill_us_per_token,
            itl_ms: args.heads_itl_ms,
            prefix_cache_tokens: Some(args.heads_prefix_cache_tokens),
            serial_prefill: true,
            duration_s: args.heads_duration_s,
            warmup_s: args.heads_warmup_s,
            seed,
            shared_prompts: match sc {
                Scenario::HeadsThrash => args.heads_thrash_prompts,
                _ => args.heads_fit_prompts,
            },
            user_tokens: FleetArgs::range(&args.heads_user_tokens),
            max_tokens: FleetArgs::range(&args.heads_max_tokens),
            load: Some(load),
            ..Workload::of(args)
        };
        // Guaranteed and Standard 70b requests go on-demand; Best-Effort's to spot.
        let w_sum: f64 = w.tier_weights.iter().sum();
        let on_demand = (1.0 - w.small_share) * (w.tier_weights[0] + w.tier_weights[1])
            / w_sum.max(f64::MIN_POSITIVE);
        w.rate = load * ON_DEMAND_REPLICAS * w.replica_capacity() / on_demand.max(0.01);
        w
    }

    /// Requests a second a 70b replica serves with nothing cached: its batch (by sequences or
    /// by KV, whichever binds) over one request's time, prefill of the whole prompt and decode,
    /// both slowed by the KV a full batch writes (`load_slowdown`), as the simulator slows them;
    /// with prefills taking turns, no more than its compute prefills whole prompts, if fewer.
    fn replica_capacity(&self) -> f64 {
        let mean = |r: [u64; 2]| (r[0] + r[1]) as f64 / 2.0;
        let prompt = self.system_tokens as f64 + mean(self.user_tokens);
        let out = mean(self.max_tokens);
        let batch = (self.max_running as f64).min(self.kv_tokens as f64 / (prompt + out));
        let written = (batch * (prompt + out) / self.kv_tokens as f64).min(1.0);
        let slow = 1.0 + self.load_slowdown * written;
        let prefill_ms = self.ttft_ms as f64 + prompt * self.prefill_us_per_token as f64 / 1000.0;
        let service_ms = (prefill_ms + (out - 1.0).max(0.0) * self.itl_ms) * slow;
        let by_batch = batch / (service_ms / 1000.0);
        if self.serial_prefill {
            // Unslowed: traffic this bound holds keeps a small batch, which writes little KV.
            let compute_ms = prompt * self.prefill_us_per_token as f64 / 1000.0;
            by_batch.min(1000.0 / compute_ms.max(f64::MIN_POSITIVE))
        } else {
            by_batch
        }
    }

    /// One replica's flags; the 8b model prefills four times and decodes twice as fast.
    fn sim_flags(&self, model: &str) -> Vec<String> {
        let small = model == SMALL_MODEL;
        let prefill = if small {
            (self.prefill_us_per_token / 4).max(1)
        } else {
            self.prefill_us_per_token
        };
        let itl = if small {
            self.itl_ms / 2.0
        } else {
            self.itl_ms
        };
        let mut flags: Vec<String> = [
            ("--model", model.to_string()),
            ("--kv-tokens", self.kv_tokens.to_string()),
            ("--max-running", self.max_running.to_string()),
            ("--ttft-ms", self.ttft_ms.to_string()),
            ("--prefill-us-per-token", prefill.to_string()),
            ("--itl-ms", itl.to_string()),
            ("--load-slowdown", self.load_slowdown.to_string()),
            ("--block-size", self.block_size.to_string()),
            ("--prefix-caching", "on".to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(t) = self.prefix_cache_tokens {
            flags.extend(["--prefix-cache-tokens".to_string(), t.to_string()]);
        }
        if self.prompt_tokens_details {
            flags.push("--enable-prompt-tokens-details".to_string());
        }
        if self.serial_prefill {
            flags.push("--serial-prefill".to_string());
        }
        flags
    }

    /// The on-demand pool's ceiling: the system prompts' share of the prompt tokens of the
    /// requests it serves (Guaranteed and Standard 70b), measured from `warmup_s`.
    fn ceiling(&self, planned: &[Planned]) -> f64 {
        let (shared, all) = planned
            .iter()
            .filter(|p| p.prompt.is_some() && p.arrival.tier != Tier::BestEffort)
            .filter(|p| p.arrival.at_ms as f64 >= self.warmup_s * 1000.0)
            .fold((0u64, 0u64), |(s, a), p| {
                (s + self.system_tokens, a + p.arrival.prompt_tokens)
            });
        shared as f64 / all.max(1) as f64
    }
}

// ---------------------------------------------------------------------------------------------
// Workload

const TENANTS: [(&str, Tier); 3] = [
    ("support-bot", Tier::Guaranteed),
    ("coding-assistant", Tier::Standard),
    ("batch-analytics", Tier::BestEffort),
];

const WORDS: &[&str] = &[
    "account",
    "billing",
    "cluster",
    "deploy",
    "error",
    "format",
    "gateway",
    "history",
    "invoice",
    "journal",
    "kernel",
    "ledger",
    "metric",
    "network",
    "order",
    "policy",
    "query",
    "region",
    "schema",
    "tenant",
    "update",
    "volume",
    "window",
    "yield",
    "zone",
    "always",
    "briefly",
    "clearly",
    "never",
    "only",
    "politely",
    "quickly",
    "answer",
    "check",
    "explain",
    "refuse",
    "summarise",
    "translate",
    "verify",
    "escalate",
    "customer",
    "engineer",
    "analyst",
    "reviewer",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "with",
    "for",
    "when",
    "before",
    "after",
    "unless",
];

/// About `chars` characters of words, after `head` (which makes the text distinct from its
/// first characters).
fn text(head: &str, chars: usize, rng: &mut Rng) -> String {
    let mut s = String::with_capacity(chars + 16);
    s.push_str(head);
    while s.len() < chars {
        s.push(' ');
        s.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
    }
    s.truncate(chars.max(head.len()));
    s
}

/// One request of a run, its body ready to send.
#[derive(Clone)]
struct Planned {
    arrival: Arrival,
    /// The shared system prompt it starts with (70b traffic of the shared scenarios).
    prompt: Option<usize>,
    body: Bytes,
}

/// The arrivals of a run: a pure function of the arguments and `shared`, so every selection of
/// a scenario replays the very same requests.
fn plan(w: &Workload, shared: bool) -> Vec<Planned> {
    let mut rng = Rng::new(w.seed);
    let systems: Vec<String> = (0..w.shared_prompts)
        .map(|k| {
            let mut r = Rng::new(w.seed ^ (0x5157_0000 + k as u64));
            text(
                &format!("System prompt {k}: you are assistant number {k} of the support desk."),
                (w.system_tokens * 4) as usize,
                &mut r,
            )
        })
        .collect();
    let mut out = Vec::new();
    let mut t_s = 0.0;
    loop {
        // Exponential gaps: a Poisson process of rate `w.rate`.
        t_s += -(1.0 - rng.unit()).ln() / w.rate;
        if t_s >= w.duration_s {
            break;
        }
        let id = out.len();
        let small = rng.unit() < w.small_share;
        let (tenant, tier) = TENANTS[rng.pick(&w.tier_weights)];
        let max_tokens = rng.range(w.max_tokens);
        let k = (rng.next_u64() % w.shared_prompts as u64) as usize;
        let user = rng.range(w.user_tokens);
        let small_prompt = rng.range(w.small_prompt_tokens);
        // Every request's own text comes from its own stream: the draws above stay the same
        // whichever scenario is planned.
        let mut own = Rng::new(w.seed ^ 0x00c0_ffee ^ ((id as u64) << 20));
        let (messages, prompt_tokens, prompt) = if small {
            let u = text(
                &format!("Question {id}:"),
                small_prompt as usize * 4,
                &mut own,
            );
            (json!([{"role": "user", "content": u}]), small_prompt, None)
        } else {
            let sys = if shared {
                systems[k].clone()
            } else {
                text(
                    &format!("System prompt of request {id}: you are a one-off assistant."),
                    (w.system_tokens * 4) as usize,
                    &mut own,
                )
            };
            let u = text(&format!("Question {id}:"), user as usize * 4, &mut own);
            (
                json!([{"role": "system", "content": sys}, {"role": "user", "content": u}]),
                w.system_tokens + user,
                shared.then_some(k),
            )
        };
        let model = if small { SMALL_MODEL } else { MAIN_MODEL };
        let body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        out.push(Planned {
            arrival: Arrival {
                id,
                at_ms: (t_s * 1000.0) as u64,
                tenant: tenant.to_string(),
                tier,
                prompt_tokens,
                max_tokens,
                stream: true,
                output_tokens: None,
            },
            prompt,
            body: Bytes::from(body.to_string()),
        });
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The Sluice config

/// The shipped `conf/sluice.yaml` with only what names this run's processes changed (listen
/// addresses, pid and upgrade files, the tenants of `conf/tenants.yaml` inlined since the file
/// is written elsewhere) and the pools: their backends, models and `selection`. No policy knob
/// is touched.
fn sluice_config(fleet: &Fleet, sel: Selection, dir: &Path, sluice: &str, ops: &str) -> Value {
    const SHIPPED: &str = include_str!("../../conf/sluice.yaml");
    const TENANTS_FILE: &str = include_str!("../../conf/tenants.yaml");
    let yaml: serde_yaml::Value = serde_yaml::from_str(SHIPPED).unwrap_or_default();
    let mut cfg = serde_json::to_value(yaml).unwrap_or_default();
    let tenants: serde_yaml::Value = serde_yaml::from_str(TENANTS_FILE).unwrap_or_default();
    let tenants = serde_json::to_value(&tenants["tenants"]).unwrap_or_default();
    if let Some(o) = cfg.as_object_mut() {
        o.remove("tenants_file");
    }
    let shipped_pool = cfg["pools"]["on-demand"].clone();
    let shipped_spot = cfg["pools"]["spot"].clone();
    let pool = |base: &Value, backends: Vec<&str>, model: &str, class: Option<&str>| {
        let mut p = base.clone();
        p["backends"] = json!(backends);
        p["models"] = json!([model]);
        p["selection"] = json!(sel.as_str());
        if let Some(c) = class {
            p["class"] = json!(c);
        }
        p
    };
    let addrs = |pool: &str| -> Vec<&str> {
        fleet
            .sims
            .iter()
            .filter(|s| s.pool == pool)
            .map(|s| s.proc.addr.as_str())
            .collect()
    };
    let mut pools = serde_json::Map::new();
    pools.insert(
        "on-demand".into(),
        pool(&shipped_pool, addrs("on-demand"), MAIN_MODEL, None),
    );
    pools.insert(
        "spot".into(),
        pool(&shipped_spot, addrs("spot"), MAIN_MODEL, None),
    );
    pools.insert(
        "small".into(),
        pool(
            &shipped_pool,
            addrs("small"),
            SMALL_MODEL,
            Some("on-demand"),
        ),
    );
    cfg["pools"] = Value::Object(pools);
    sluice_testkit::merge(
        &mut cfg,
        &json!({
            "listen": [sluice],
            "ops_listen": [ops],
            "tenants": tenants,
            "server": {
                "threads": 2,
                "grace_period_seconds": 0,
                "graceful_shutdown_timeout_seconds": 1,
                "upgrade_sock": dir.join("upgrade.sock").display().to_string(),
                "pid_file": dir.join("sluice.pid").display().to_string(),
            },
        }),
    );
    cfg
}

/// Each tier's objective in the generated (shipped) config, as Sluice reads it: `slo`, with
/// `sla_target_ms` as its end-to-end target.
fn objectives(cfg: &Value) -> [Slo; 3] {
    Tier::ALL.map(|t| {
        let c = &cfg["tiers"][t.as_str()];
        Slo {
            ttft_ms: c["slo"]["ttft_ms"].as_u64(),
            tpot_ms: c["slo"]["tpot_ms"].as_u64(),
            e2e_ms: c["slo"]["e2e_ms"]
                .as_u64()
                .or_else(|| c["sla_target_ms"].as_u64()),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Processes

struct Sim {
    name: String,
    pool: &'static str,
    proc: Proc,
}

struct Fleet {
    sims: Vec<Sim>,
}

async fn start_fleet(
    args: &FleetArgs,
    w: &Workload,
    bin: &Path,
    dir: &Path,
) -> Result<Fleet, String> {
    let layout: [(&str, &'static str, &str); 5] = [
        ("od-0", "on-demand", MAIN_MODEL),
        ("od-1", "on-demand", MAIN_MODEL),
        ("od-2", "on-demand", MAIN_MODEL),
        ("spot-0", "spot", MAIN_MODEL),
        ("small-0", "small", SMALL_MODEL),
    ];
    let mut sims = Vec::new();
    for ((name, pool, model), port) in layout.into_iter().zip(&args.sim_ports) {
        let addr = format!("127.0.0.1:{port}");
        let mut cmd = std::process::Command::new(bin);
        cmd.args(["sim", "--listen", &addr])
            .args(w.sim_flags(model))
            .env("RUST_LOG", "warn");
        let log = Some(dir.join(format!("{name}.log")));
        let mut proc = Proc::spawn(name, &mut cmd, addr, log)?;
        proc.wait_ok("/health", Duration::from_secs(15))
            .await
            .map_err(|e| format!("{e} (port {port} taken? pass other --sim-ports)"))?;
        sims.push(Sim {
            name: name.to_string(),
            pool,
            proc,
        });
    }
    Ok(Fleet { sims })
}

/// Waits until every pool has all its backends checked healthy, every pool's models are
/// known and the on-demand pool's pressure has been scraped once.
async fn wait_ready(c: &HttpClient, sluice: &Proc, fleet: &Fleet) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        if let Ok(st) = procs::get_json(c, &sluice.ops_url("/status")).await {
            let pools = st["pools"].as_array().cloned().unwrap_or_default();
            let healthy = ["on-demand", "spot", "small"].iter().all(|name| {
                let want = fleet.sims.iter().filter(|s| s.pool == *name).count();
                pools.iter().any(|p| {
                    p["name"] == *name
                        && p["backends"].as_array().is_some_and(|b| {
                            b.len() == want
                                && b.iter().all(|x| {
                                    x["healthy"] == json!(true) && x["checked"] == json!(true)
                                })
                        })
                })
            });
            let complete = st["routes"]["complete"] == json!(true);
            let scraped = st["signals"]["on-demand"]["pressure"]["value"].is_number();
            if healthy && complete && scraped {
                return Ok(());
            }
            last = st;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "Sluice never reported every backend healthy, routes complete and on-demand signals; last /status pools {} routes {}",
        last["pools"], last["routes"]
    ))
}

// ---------------------------------------------------------------------------------------------
// One run

/// What a simulator saw over a run.
#[derive(Debug, Clone, Default, Serialize)]
struct SimOutcome {
    name: String,
    pool: String,
    received: u64,
    completed: u64,
    aborted: u64,
    prefix_cache_queries_tokens: u64,
    prefix_cache_hit_tokens: u64,
    /// Mean running sequences over the run, as a share of `max_running`.
    busy: f64,
    mean_waiting: f64,
    peak_waiting: u64,
    /// Time admitted requests waited in its queue, p95 (of the admissions seen).
    queue_p95_ms: Option<f64>,
    /// Its received requests over its pool's.
    share: f64,
}

#[derive(Debug, Clone, Serialize)]
struct TierRow {
    tier: &'static str,
    /// The tier's objective (`TTFT 500 / TPOT 50 ms`).
    objective: String,
    requests: usize,
    completed: usize,
    ttft_p50_ms: Option<f64>,
    ttft_p95_ms: Option<f64>,
    latency_p95_ms: Option<f64>,
    /// Over target, refused or failed, over all requests (the project's `viol % all`).
    sla_viol_pct: Option<f64>,
    goodput_rps: f64,
    refused: usize,
    errors: usize,
    /// Requests by the pool that served them (`x-sluice-pool`).
    pools: BTreeMap<String, usize>,
    /// Requests not completed, by `x-sluice-reason` (429) or status.
    refusals: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, Serialize)]
struct RunOut {
    scenario: Scenario,
    selection: Selection,
    /// heads-*: the rate as a fraction of the on-demand pool's capacity.
    load: Option<f64>,
    seed: u64,
    /// The on-demand pool's hit-rate ceiling: its system prompts' share of its prompt tokens.
    ceiling: f64,
    /// Prefix affinity's verdict on the on-demand pool at the end (`/status` `affinity`).
    judged: Option<Value>,
    /// Requests measured (after the warm-up) and the seconds of arrivals they came in.
    requests: usize,
    duration_s: f64,
    tiers: Vec<TierRow>,
    goodput_rps: f64,
    /// Prompt tokens the prefix caches served over prompt tokens asked, by pool and in all.
    hit_rate: BTreeMap<String, f64>,
    sims: Vec<SimOutcome>,
    affinity: Option<Affinity>,
    /// Sluice's own `/status` pools at the end (in flight, share, scraped KV and waiting).
    sluice_pools: Value,
    /// The slowed replica, in the slow-replica scenario.
    slowed: Option<String>,
    /// Client lag: how late requests left against their schedule, p99 ms.
    send_lag_p99_ms: f64,
    #[serde(skip)]
    records: Vec<RequestRecord>,
    /// Request index → the replica that admitted it (from the simulators' admission lists).
    #[serde(skip)]
    replica_of: BTreeMap<usize, String>,
    #[serde(skip)]
    slo: [Slo; 3],
}

#[derive(Default, Clone)]
struct Load {
    running: f64,
    waiting: f64,
    peak_waiting: u64,
    n: u64,
    /// Admissions seen in the simulator's recent list: request index → (cached prompt tokens,
    /// ms it waited in the simulator's queue).
    admitted: BTreeMap<usize, (u64, f64)>,
}

impl Load {
    fn admissions(&mut self, st: &Value) {
        for a in st["admissions"].as_array().into_iter().flatten() {
            let id = a["request_id"]
                .as_str()
                .and_then(|r| r.strip_prefix("fleet-"))
                .and_then(|n| n.parse().ok());
            if let Some(id) = id {
                let cached = a["cached_tokens"].as_u64().unwrap_or(0);
                let queue = a["queue_ms"].as_f64().unwrap_or(0.0);
                self.admitted.insert(id, (cached, queue));
            }
        }
    }
}

/// Where the requests of each shared system prompt were served in the on-demand pool.
#[derive(Debug, Clone, Default, Serialize)]
struct Affinity {
    /// Requests served by their prompt's busiest replica, over all the prompt requests seen.
    concentration: f64,
    /// Per prompt: requests by replica.
    prompts: Vec<BTreeMap<String, usize>>,
    /// Admissions seen (the simulators list their last 50) over requests received.
    coverage: f64,
    /// Prompt tokens served from the cache on the prompt's busiest replica, and elsewhere.
    home_hit_rate: f64,
    away_hit_rate: f64,
}

fn affinity(planned: &[Planned], sims: &[Sim], loads: &[Load], received: u64) -> Affinity {
    let n = planned
        .iter()
        .filter_map(|p| p.prompt)
        .max()
        .map_or(0, |m| m + 1);
    let mut prompts = vec![BTreeMap::<String, usize>::new(); n];
    let mut seen = 0usize;
    for (s, l) in sims.iter().zip(loads) {
        if s.pool != "on-demand" {
            continue;
        }
        for id in l.admitted.keys() {
            if let Some(k) = planned.get(*id).and_then(|p| p.prompt) {
                *prompts[k].entry(s.name.clone()).or_default() += 1;
                seen += 1;
            }
        }
    }
    let top: usize = prompts
        .iter()
        .map(|m| m.values().max().copied().unwrap_or(0))
        .sum();
    let home = |k: usize| {
        prompts[k]
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(s, _)| s.clone())
    };
    // (cached, queried) prompt tokens at home and away.
    let mut tokens = [(0u64, 0u64); 2];
    for (s, l) in sims.iter().zip(loads) {
        if s.pool != "on-demand" {
            continue;
        }
        for (id, (cached, _)) in &l.admitted {
            let Some(p) = planned.get(*id) else { continue };
            let Some(k) = p.prompt else { continue };
            let at = usize::from(home(k).as_deref() != Some(s.name.as_str()));
            tokens[at].0 += cached;
            tokens[at].1 += p.arrival.prompt_tokens;
        }
    }
    let rate = |(c, q): (u64, u64)| c as f64 / q.max(1) as f64;
    Affinity {
        concentration: top as f64 / seen.max(1) as f64,
        prompts,
        coverage: seen as f64 / received.max(1) as f64,
        home_hit_rate: rate(tokens[0]),
        away_hit_rate: rate(tokens[1]),
    }
}

async fn run_one(
    args: &FleetArgs,
    w: &Workload,
    bin: &Path,
    scenario: Scenario,
    sel: Selection,
    planned: &[Planned],
) -> Result<RunOut, String> {
    let mut work = WorkDir::new(&format!("fleet-{}-{}", scenario.as_str(), sel.as_str()))?;
    work.keep = args.keep;
    let dir = work.path.clone();
    let c = procs::client();
    let fleet = start_fleet(args, w, bin, &dir).await?;
    let (addr, ops) = (procs::free_addr()?, procs::free_addr()?);
    let cfg = sluice_config(&fleet, sel, &dir, &addr, &ops);
    crate::sluice_conf::parse(&cfg, &dir)?;
    let slo = objectives(&cfg);
    let sluice = procs::start_sluice(bin, &cfg, &dir).await?;
    wait_ready(&c, &sluice, &fleet).await?;
    let slowed = match scenario {
        Scenario::SlowReplica => {
            let s = &fleet.sims[0];
            procs::put_json(
                &c,
                &s.proc.url("/admin/latency"),
                &json!({"extra_ms": args.slow_extra_ms}),
            )
            .await?;
            Some(s.name.clone())
        }
        _ => None,
    };

    let start = Instant::now() + Duration::from_millis(300);
    let stop = Arc::new(AtomicBool::new(false));
    let loads: Arc<Mutex<Vec<Load>>> = Arc::new(Mutex::new(vec![Load::default(); 5]));
    let sampler = {
        let urls: Vec<String> = fleet
            .sims
            .iter()
            .map(|s| s.proc.url("/admin/stats"))
            .collect();
        let (c, stop, loads) = (c.clone(), Arc::clone(&stop), Arc::clone(&loads));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start, SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for (i, u) in urls.iter().enumerate() {
                    if let Ok(st) = procs::get_json(&c, u).await {
                        let mut l = loads.lock().unwrap_or_else(PoisonError::into_inner);
                        l[i].admissions(&st);
                        let w = st["waiting"].as_u64().unwrap_or(0);
                        l[i].running += st["running"].as_f64().unwrap_or(0.0);
                        l[i].waiting += w as f64;
                        l[i].peak_waiting = l[i].peak_waiting.max(w);
                        l[i].n += 1;
                    }
                }
            }
        })
    };
    // The hit counters as the warm-up ends: what is measured is what came after.
    let at_warmup = {
        let urls: Vec<String> = fleet
            .sims
            .iter()
            .map(|s| s.proc.url("/admin/stats"))
            .collect();
        let (c, due) = (c.clone(), start + Duration::from_secs_f64(w.warmup_s));
        tokio::spawn(async move {
            let mut counters = vec![(0u64, 0u64); urls.len()];
            if due <= start {
                return counters;
            }
            tokio::time::sleep_until(due).await;
            for (i, u) in urls.iter().enumerate() {
                if let Ok(st) = procs::get_json(&c, u).await {
                    counters[i] = (
                        st["prefix_cache_queries_tokens"].as_u64().unwrap_or(0),
                        st["prefix_cache_hit_tokens"].as_u64().unwrap_or(0),
                    );
                }
            }
            counters
        })
    };

    let url = sluice.url("/v1/chat/completions");
    let mut tasks = Vec::with_capacity(planned.len());
    for p in planned {
        let (c, url, p) = (c.clone(), url.clone(), p.clone());
        tasks.push(tokio::spawn(async move {
            let due = start + Duration::from_millis(p.arrival.at_ms);
            tokio::time::sleep_until(due).await;
            send(&c, &url, &p, due).await
        }));
    }
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        records.push(t.await.map_err(|e| e.to_string())?);
    }
    stop.store(true, Ordering::Relaxed);
    sampler.await.map_err(|e| e.to_string())?;
    let at_warmup = at_warmup.await.map_err(|e| e.to_string())?;

    let sluice_pools = procs::get_json(&c, &sluice.ops_url("/status"))
        .await
        .map(|st| st["pools"].clone())
        .unwrap_or(Value::Null);
    let mut loads = loads.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let mut sims = Vec::new();
    for ((s, l), (q0, h0)) in fleet.sims.iter().zip(loads.iter_mut()).zip(&at_warmup) {
        let st = procs::get_json(&c, &s.proc.url("/admin/stats")).await?;
        l.admissions(&st);
        let n = l.n.max(1) as f64;
        let mut queue: Vec<f64> = l.admitted.values().map(|(_, q)| *q).collect();
        queue.sort_by(f64::total_cmp);
        sims.push(SimOutcome {
            name: s.name.clone(),
            pool: s.pool.to_string(),
            received: st["received"].as_u64().unwrap_or(0),
            completed: st["completed"].as_u64().unwrap_or(0),
            aborted: st["aborted"].as_u64().unwrap_or(0),
            prefix_cache_queries_tokens: st["prefix_cache_queries_tokens"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(*q0),
            prefix_cache_hit_tokens: st["prefix_cache_hit_tokens"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(*h0),
            busy: l.running / n / w.max_running as f64,
            mean_waiting: l.waiting / n,
            peak_waiting: l.peak_waiting,
            queue_p95_ms: percentile(&queue, 95.0),
            share: 0.0,
        });
    }
    let pool_total = |pool: &str, sims: &[SimOutcome]| -> u64 {
        sims.iter()
            .filter(|s| s.pool == pool)
            .map(|s| s.received)
            .sum()
    };
    let totals: Vec<u64> = sims.iter().map(|s| pool_total(&s.pool, &sims)).collect();
    for (s, total) in sims.iter_mut().zip(totals) {
        s.share = s.received as f64 / total.max(1) as f64;
    }
    let mut hit_rate = BTreeMap::new();
    for pool in ["on-demand", "spot", "small", "all"] {
        let (q, h) = sims
            .iter()
            .filter(|s| pool == "all" || s.pool == pool)
            .fold((0u64, 0u64), |(q, h), s| {
                (
                    q + s.prefix_cache_queries_tokens,
                    h + s.prefix_cache_hit_tokens,
                )
            });
        hit_rate.insert(pool.to_string(), h as f64 / q.max(1) as f64);
    }
    let od_received = sims
        .iter()
        .filter(|s| s.pool == "on-demand")
        .map(|s| s.received)
        .sum();
    let replica_of: BTreeMap<usize, String> = fleet
        .sims
        .iter()
        .zip(&loads)
        .flat_map(|(s, l)| l.admitted.keys().map(|id| (*id, s.name.clone())))
        .collect();
    let affinity = (scenario != Scenario::NoSharedPrefix)
        .then(|| affinity(planned, &fleet.sims, &loads, od_received));
    drop(sluice);
    drop(fleet);
    if args.keep {
        eprintln!("sluice-bench fleet: kept {}", dir.display());
    }
    let warm_ms = w.warmup_s * 1000.0;
    let records: Vec<RequestRecord> = records
        .into_iter()
        .filter(|r| r.at_ms as f64 >= warm_ms)
        .collect();
    let measured_s = w.duration_s - w.warmup_s;
    let tiers = tier_rows(&records, &slo, measured_s);
    let mut lag: Vec<f64> = records.iter().map(|r| r.send_lag_ms).collect();
    lag.sort_by(f64::total_cmp);
    let judged = sluice_pools
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "on-demand"))
        .map(|p| p["affinity"].clone())
        .filter(|a| !a.is_null());
    Ok(RunOut {
        scenario,
        selection: sel,
        load: w.load,
        seed: w.seed,
        ceiling: w.ceiling(planned),
        judged,
        requests: records.len(),
        duration_s: measured_s,
        goodput_rps: tiers.iter().map(|t| t.goodput_rps).sum(),
        tiers,
        hit_rate,
        sims,
        affinity,
        sluice_pools,
        slowed,
        send_lag_p99_ms: percentile(&lag, 99.0).unwrap_or(0.0),
        records,
        replica_of,
        slo,
    })
}

fn tier_rows(records: &[RequestRecord], slo: &[Slo; 3], duration_s: f64) -> Vec<TierRow> {
    Tier::ALL
        .iter()
        .map(|&t| {
            let s = report::tier_summary(records, t, &slo[t.index()], duration_s);
            TierRow {
                tier: t.as_str(),
                objective: crate::record::slo_label(&slo[t.index()]),
                requests: s.requests,
                completed: s.completed,
                ttft_p50_ms: s.ttft_p50_ms,
                ttft_p95_ms: s.ttft_p95_ms,
                latency_p95_ms: s.p95_ms,
                sla_viol_pct: s.viol_all_pct,
                goodput_rps: s.goodput_rps,
                refused: s.rejected,
                errors: s.errors,
                pools: s.pools,
                refusals: s.refusals,
            }
        })
        .collect()
}

/// Sends one streamed request; time to first token is the time to its first chunk carrying a
/// token, time per output token the span to its last over the tokens after the first.
async fn send(c: &HttpClient, url: &str, p: &Planned, due: Instant) -> RequestRecord {
    let a = &p.arrival;
    let sent = Instant::now();
    let mut r = RequestRecord {
        send_lag_ms: (sent - due).as_secs_f64() * 1000.0,
        ..RequestRecord::pending(a)
    };
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("x-tenant-id", &a.tenant)
        .header("x-request-id", format!("fleet-{}", a.id))
        .body(Full::new(p.body.clone()));
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
        let mut tokens = crate::live::ContentScan::default();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| ())?;
            if let Ok(data) = frame.into_data() {
                if tokens.feed(&data) {
                    let at = sent.elapsed().as_secs_f64() * 1000.0;
                    r.ttft_ms.get_or_insert(at);
                    last_token_ms = Some(at);
                }
                tail.extend_from_slice(&data);
                if tail.len() > 8192 {
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
                r.completion_tokens = sluice_record::usage::usage_of(&tail, true).1.unwrap_or(0);
                r.tpot_ms = r.ttft_ms.zip(last_token_ms).and_then(|(first, last)| {
                    sluice_policy::slo::Measured::tpot_of(first, last, r.completion_tokens)
                });
            } else {
                r.ttft_ms = None;
            }
        }
        _ => {
            r.status = if r.status == 200 { 0 } else { r.status };
            r.latency_ms = sent.elapsed().as_secs_f64() * 1000.0;
            r.ttft_ms = None;
        }
    }
    r
}

// ---------------------------------------------------------------------------------------------
// Checks

#[derive(Debug, Clone, Serialize)]
struct Check {
    scenario: &'static str,
    what: String,
    detail: String,
    pass: bool,
}

/// Round robin's spread by block bootstrap: the 2.5th and 97.5th percentiles of `f` over
/// resamples (with replacement) of its run cut into blocks of arrivals. Latencies under load
/// come in correlated bursts, so resampling single requests would understate the spread.
fn spread(
    records: &[RequestRecord],
    f: &dyn Fn(&[RequestRecord]) -> Option<f64>,
    seed: u64,
) -> Option<(f64, f64)> {
    let mut blocks: BTreeMap<u64, Vec<RequestRecord>> = BTreeMap::new();
    for r in records {
        blocks
            .entry(r.at_ms / BLOCK_MS)
            .or_default()
            .push(r.clone());
    }
    let blocks: Vec<Vec<RequestRecord>> = blocks.into_values().collect();
    if blocks.is_empty() {
        return None;
    }
    let mut rng = Rng::new(seed);
    let mut vals: Vec<f64> = (0..BOOTSTRAP)
        .filter_map(|_| {
            let sample: Vec<RequestRecord> = (0..blocks.len())
                .flat_map(|_| blocks[(rng.next_u64() % blocks.len() as u64) as usize].clone())
                .collect();
            f(&sample)
        })
        .collect();
    vals.sort_by(f64::total_cmp);
    Some((percentile(&vals, 2.5)?, percentile(&vals, 97.5)?))
}

fn ttft_p95(records: &[RequestRecord], tier: Tier) -> Option<f64> {
    let mut v: Vec<f64> = records
        .iter()
        .filter(|r| r.tier == tier && r.completed())
        .filter_map(|r| r.ttft_ms)
        .collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 95.0)
}

fn goodput(records: &[RequestRecord], slo: [Slo; 3], duration_s: f64) -> f64 {
    records
        .iter()
        .filter(|r| r.met(&slo[r.tier.index()]))
        .count() as f64
        / duration_s
}

/// Each on-demand tier's SLA violations by the replica that served the request.
fn by_replica(r: &RunOut) -> String {
    let mut parts = Vec::new();
    for t in [Tier::Guaranteed, Tier::Standard] {
        let mut m: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for rec in r.records.iter().filter(|x| x.tier == t) {
            let Some(rep) = r.replica_of.get(&rec.id) else {
                continue;
            };
            let e = m.entry(rep.clone()).or_default();
            e.1 += 1;
            if !rec.met(&r.slo[t.index()]) {
                e.0 += 1;
            }
        }
        let by: Vec<String> = m
            .iter()
            .map(|(rep, (v, n))| format!("{rep} {v} of {n}"))
            .collect();
        parts.push(format!(
            "{} violations by replica: {}",
            t.as_str(),
            by.join(", ")
        ));
    }
    parts.join("; ")
}

fn find(runs: &[RunOut], sc: Scenario, sel: Selection) -> Option<&RunOut> {
    runs.iter().find(|r| r.scenario == sc && r.selection == sel)
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.0}"))
}

fn checks(runs: &[RunOut]) -> Vec<Check> {
    let mut out = Vec::new();
    let mut push = |scenario: &'static str, what: String, detail: String, pass: bool| {
        out.push(Check {
            scenario,
            what,
            detail,
            pass,
        })
    };
    let sc = Scenario::Shared;
    if let (Some(rr), Some(pa)) = (
        find(runs, sc, Selection::RoundRobin),
        find(runs, sc, Selection::PrefixAffinity),
    ) {
        for pool in ["on-demand", "all"] {
            let (a, b) = (pa.hit_rate[pool], rr.hit_rate[pool]);
            push(
                sc.as_str(),
                format!(
                    "prefix-cache hit rate, prefix_affinity ≥ 2× round_robin ({})",
                    if pool == "all" {
                        "every simulator"
                    } else {
                        "on-demand pool, where selection acts"
                    }
                ),
                format!(
                    "{:.1} % vs {:.1} % ({:.2}×)",
                    a * 100.0,
                    b * 100.0,
                    a / b.max(1e-9)
                ),
                a >= 2.0 * b,
            );
        }
        for t in Tier::ALL {
            let (a, b) = (ttft_p95(&pa.records, t), ttft_p95(&rr.records, t));
            let pass = matches!((a, b), (Some(a), Some(b)) if a <= 0.7 * b);
            let cut = match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:+.0} %", (a / b - 1.0) * 100.0),
                _ => "-".into(),
            };
            let row = &pa.tiers[t.index()];
            let served: Vec<String> = row.pools.iter().map(|(p, n)| format!("{p} {n}")).collect();
            let single = !row.pools.is_empty()
                && row
                    .pools
                    .keys()
                    .all(|p| pa.sims.iter().filter(|s| s.pool == *p).count() == 1);
            push(
                sc.as_str(),
                format!("{} TTFT p95 ≥ 30 % lower than round_robin's", t.as_str()),
                format!(
                    "{} ms vs {} ms ({cut}); served by {}{}",
                    ms(a),
                    ms(b),
                    served.join(", "),
                    if single {
                        ": single-replica pools only, where no selection has a choice"
                    } else {
                        ""
                    }
                ),
                pass,
            );
        }
        push(
            sc.as_str(),
            "goodput (requests within SLA per s) ≥ round_robin's".into(),
            format!("{:.2} vs {:.2} rps", pa.goodput_rps, rr.goodput_rps),
            pa.goodput_rps >= rr.goodput_rps,
        );
    }
    let sc = Scenario::NoSharedPrefix;
    if let Some(rr) = find(runs, sc, Selection::RoundRobin) {
        for sel in [Selection::LeastLoad, Selection::PrefixAffinity] {
            let Some(run) = find(runs, sc, sel) else {
                continue;
            };
            for t in Tier::ALL {
                let f = move |rs: &[RequestRecord]| ttft_p95(rs, t);
                let hi = spread(&rr.records, &f, 7 + t.index() as u64).map(|s| s.1);
                let v = ttft_p95(&run.records, t);
                push(
                    sc.as_str(),
                    format!(
                        "{} {} TTFT p95 within round_robin's spread or better",
                        sel.as_str(),
                        t.as_str()
                    ),
                    format!(
                        "{} ms vs round_robin {} ms (upper end of its 95 % block-bootstrap spread {} ms)",
                        ms(v),
                        ms(ttft_p95(&rr.records, t)),
                        ms(hi)
                    ),
                    matches!((v, hi), (Some(v), Some(hi)) if v <= hi),
                );
            }
            let (slo, d) = (rr.slo, rr.duration_s);
            let f = move |rs: &[RequestRecord]| Some(goodput(rs, slo, d));
            let lo = spread(&rr.records, &f, 11).map(|s| s.0);
            push(
                sc.as_str(),
                format!(
                    "{} goodput within round_robin's spread or better",
                    sel.as_str()
                ),
                format!(
                    "{:.2} vs round_robin {:.2} rps (lower end of its 95 % block-bootstrap spread {})",
                    run.goodput_rps,
                    rr.goodput_rps,
                    lo.map_or("-".into(), |x| format!("{x:.2}"))
                ),
                lo.is_some_and(|lo| run.goodput_rps >= lo),
            );
        }
    }
    let sc = Scenario::SlowReplica;
    let slow_share = |r: &RunOut| {
        r.sims
            .iter()
            .find(|s| Some(&s.name) == r.slowed.as_ref())
            .map_or(0.0, |s| s.share)
    };
    if let (Some(rr), Some(ll)) = (
        find(runs, sc, Selection::RoundRobin),
        find(runs, sc, Selection::LeastLoad),
    ) {
        let (a, b) = (slow_share(ll), slow_share(rr));
        push(
            sc.as_str(),
            "slowed replica's share, least_load ≤ half round_robin's".into(),
            format!("{:.1} % vs {:.1} %", a * 100.0, b * 100.0),
            a <= 0.5 * b,
        );
    }
    for sel in [Selection::LeastLoad, Selection::PrefixAffinity] {
        if let Some(run) = find(runs, sc, sel) {
            let g = &run.tiers[Tier::Guaranteed.index()];
            push(
                sc.as_str(),
                format!("{} Guaranteed SLA violations ≤ 1 %", sel.as_str()),
                format!(
                    "{:.2} % of {} (slowed replica's share {:.1} %)",
                    g.sla_viol_pct.unwrap_or(0.0),
                    g.requests,
                    slow_share(run) * 100.0
                ),
                g.sla_viol_pct.unwrap_or(100.0) <= 1.0,
            );
        }
    }
    for sc in [Scenario::HeadsFit, Scenario::HeadsThrash] {
        for load in loads_of(runs, sc) {
            let of = |sel| heads_runs(runs, sc, load, sel);
            let (rr, ll, pa) = (
                of(Selection::RoundRobin),
                of(Selection::LeastLoad),
                of(Selection::PrefixAffinity),
            );
            if pa.is_empty() {
                continue;
            }
            let at = format!("{load}×");
            if sc == Scenario::HeadsFit {
                if let Some(h) = over(&pa, of_ceiling) {
                    push(
                        sc.as_str(),
                        format!("{at}: prefix_affinity hit rate ≥ 90 % of the ceiling"),
                        format!("{} of the ceiling", h.pct()),
                        h.mean >= 0.9,
                    );
                }
                for t in [Tier::Guaranteed, Tier::Standard] {
                    let (a, b) = (over(&pa, tier_ttft(t)), over(&rr, tier_ttft(t)));
                    if let (Some(a), Some(b)) = (a, b) {
                        push(
                            sc.as_str(),
                            format!(
                                "{at}: {} TTFT p95, prefix_affinity ≥ 15 % below round_robin",
                                t.as_str()
                            ),
                            format!(
                                "{} ms vs {} ms ({:+.0} %)",
                                a.ms(),
                                b.ms(),
                                (a.mean / b.mean.max(1e-9) - 1.0) * 100.0
                            ),
                            a.mean <= 0.85 * b.mean,
                        );
                    }
                }
            }
            for t in Tier::ALL {
                let (a, b) = (over(&pa, tier_ttft(t)), over(&ll, tier_ttft(t)));
                // Least load's spread: over its seeds, and within each run (a block bootstrap,
                // since latencies under load come in bursts).
                let f = move |rs: &[RequestRecord]| ttft_p95(rs, t);
                let hi = ll
                    .iter()
                    .filter_map(|r| spread(&r.records, &f, 7 + t.index() as u64))
                    .map(|s| s.1)
                    .fold(f64::NEG_INFINITY, f64::max);
                if let (Some(a), Some(b)) = (a, b) {
                    let hi = hi.max(b.hi);
                    push(
                        sc.as_str(),
                        format!(
                            "{at}: {} TTFT p95, prefix_affinity no worse than least_load beyond its spread",
                            t.as_str()
                        ),
                        format!(
                            "mean {} ms vs least_load {} ms (upper end of its spread {hi:.0} ms: \
                             the highest seed's 95 % block-bootstrap bound)",
                            a.ms(),
                            b.ms(),
                        ),
                        a.mean <= hi,
                    );
                }
            }
        }
    }
    out
}

/// A figure over a run's seeds: mean, lowest and highest.
#[derive(Debug, Clone, Copy)]
struct Spread {
    mean: f64,
    lo: f64,
    hi: f64,
}

impl Spread {
    fn ms(&self) -> String {
        format!("{:.0} [{:.0}–{:.0}]", self.mean, self.lo, self.hi)
    }

    fn pct(&self) -> String {
        format!(
            "{:.1} % [{:.1}–{:.1}]",
            self.mean * 100.0,
            self.lo * 100.0,
            self.hi * 100.0
        )
    }
}

fn over(runs: &[&RunOut], f: impl Fn(&RunOut) -> Option<f64>) -> Option<Spread> {
    let v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
    if v.is_empty() {
        return None;
    }
    Some(Spread {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        lo: v.iter().copied().fold(f64::INFINITY, f64::min),
        hi: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    })
}

fn tier_ttft(t: Tier) -> impl Fn(&RunOut) -> Option<f64> {
    move |r: &RunOut| r.tiers[t.index()].ttft_p95_ms
}

fn of_ceiling(r: &RunOut) -> Option<f64> {
    (r.ceiling > 0.0).then(|| r.hit_rate["on-demand"] / r.ceiling)
}

/// The loads a heads scenario ran at, in order.
fn loads_of(runs: &[RunOut], sc: Scenario) -> Vec<f64> {
    let mut loads: Vec<f64> = runs
        .iter()
        .filter(|r| r.scenario == sc)
        .filter_map(|r| r.load)
        .collect();
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    loads
}

fn heads_runs(runs: &[RunOut], sc: Scenario, load: f64, sel: Selection) -> Vec<&RunOut> {
    runs.iter()
        .filter(|r| r.scenario == sc && r.selection == sel && r.load == Some(load))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The report

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

fn date() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Memory, load, commit and build, without depending on another harness's wording.
fn environment() -> String {
    let mem_gib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
    });
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(", "))
        .unwrap_or_default();
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    format!(
        "{:.0} GiB, {}, shared with other work; load average {load} before the runs. Commit {commit}{}. {} build.",
        mem_gib.unwrap_or(0.0) / 1024.0 / 1024.0,
        std::env::consts::ARCH,
        if dirty { " with uncommitted changes" } else { "" },
        if cfg!(debug_assertions) { "Debug (not a result)" } else { "Release" }
    )
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("target/release/sluice-bench {}", args.join(" "))
}

fn pct(v: f64) -> String {
    format!("{:.1} %", v * 100.0)
}

fn render(args: &FleetArgs, runs: &[RunOut], checks: &[Check], env: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## Fleet routing: replica selection inside a pool\n");
    let _ = writeln!(md, "Command: `{}`  ", command_line());
    let _ = writeln!(md, "Date: {}  ", date());
    let _ = writeln!(
        md,
        "Machine: nproc {}, {}, {}\n",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model(),
        env
    );
    let w = Workload::of(args);
    let old = runs.iter().any(|r| !r.scenario.heads());
    let _ = writeln!(
        md,
        "Fleet: `{MAIN_MODEL}` on pool `on-demand` (od-0, od-1, od-2) and `spot` (spot-0), \
         `{SMALL_MODEL}` on pool `small` (small-0, class on-demand); Sluice runs the shipped \
         `conf/sluice.yaml` (tenants from `conf/tenants.yaml`) with only addresses, pools, \
         backends and `selection` changed; every pool uses the run's selection. The replicas \
         listen on 127.0.0.1 ports {} (od-0, od-1, od-2, spot-0, small-0) in every run, so \
         prefix affinity's ring (it hashes the addresses) is the same in every run.\n",
        args.sim_ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    if old {
        render_shared(&mut md, args, &w);
    }
    for sc in [
        Scenario::Shared,
        Scenario::NoSharedPrefix,
        Scenario::SlowReplica,
    ] {
        render_scenario(&mut md, args, runs, checks, sc);
    }
    for sc in [Scenario::HeadsFit, Scenario::HeadsThrash] {
        render_heads(&mut md, args, runs, checks, sc);
    }
    md
}

fn render_shared(md: &mut String, args: &FleetArgs, w: &Workload) {
    let _ = writeln!(
        md,
        "Shared, no-shared-prefix and slow-replica: replicas `sluice sim {}` (the 8b one prefills 4× and decodes 2× faster). A 70b replica's KV holds about {:.1} \
         of the {} shared system prompts: the ones affinity sends it fit, not all of them.\n",
        w.sim_flags(MAIN_MODEL)
            .iter()
            .skip(2)
            .cloned()
            .collect::<Vec<_>>()
            .join(" "),
        args.kv_tokens as f64 / args.system_tokens.max(1) as f64,
        args.shared_prompts,
    );
    let _ = writeln!(
        md,
        "Traffic: open loop, Poisson, {} req/s for {} s (seed {}), all streamed; {:.0} % to \
         `{SMALL_MODEL}` (unique {}-{} token prompts); the rest to `{MAIN_MODEL}`: one of {} \
         system prompts of {} tokens, then a unique {}-{} token user turn (`no-shared-prefix`: \
         the system prompt is unique too). max_tokens {}-{}. Tenants support-bot / \
         coding-assistant / batch-analytics (Guaranteed / Standard / Best-Effort) weighted {}. \
         TTFT: time to the first streamed token; SLA violations: a request missing any \
         dimension of its tier's objective in the shipped config (`slo`: TTFT and TPOT), a \
         refusal or error counting as a violation; goodput: requests completed within every \
         dimension per second of arrivals. Hit rate: \
         prefix-cache hit tokens over queried prompt tokens, from the simulators' `/admin/stats` \
         (fresh processes every run). Share: a replica's received requests over its pool's. \
         Busy: mean running sequences over `max_running`, sampled every 0.5 s.\n",
        args.rate,
        args.duration_s,
        args.seed,
        args.small_share * 100.0,
        args.small_prompt_tokens[0],
        args.small_prompt_tokens[1],
        args.shared_prompts,
        args.system_tokens,
        args.user_tokens[0],
        args.user_tokens[1],
        args.max_tokens[0],
        args.max_tokens[1],
        args.tier_weights
            .iter()
            .map(|w| format!("{w}"))
            .collect::<Vec<_>>()
            .join("/"),
    );
}

fn render_scenario(
    md: &mut String,
    args: &FleetArgs,
    runs: &[RunOut],
    checks: &[Check],
    sc: Scenario,
) {
    let rs: Vec<&RunOut> = runs.iter().filter(|r| r.scenario == sc).collect();
    let Some(first) = rs.first() else { return };
    let _ = writeln!(md, "### {}\n", sc.as_str());
    if let Some(s) = &first.slowed {
        let _ = writeln!(
            md,
            "Replica {s} answers {} ms slower (`PUT /admin/latency`) from the start.\n",
            args.slow_extra_ms
        );
    }
    let _ = writeln!(
            md,
            "| selection | tier (SLA) | requests | TTFT p50 ms | TTFT p95 ms | latency p95 ms | SLA viol % | goodput rps | refused | errors | served by pool |\n|---|---|---|---|---|---|---|---|---|---|---|"
        );
    for r in &rs {
        for t in &r.tiers {
            let _ = writeln!(
                md,
                "| {} | {} ({}) | {} | {} | {} | {} | {} | {:.2} | {} | {} | {} |",
                r.selection.as_str(),
                t.tier,
                t.objective,
                t.requests,
                ms(t.ttft_p50_ms),
                ms(t.ttft_p95_ms),
                ms(t.latency_p95_ms),
                t.sla_viol_pct.map_or("-".into(), |v| format!("{v:.1}")),
                t.goodput_rps,
                if t.refusals.is_empty() {
                    t.refused.to_string()
                } else {
                    let why: Vec<String> =
                        t.refusals.iter().map(|(k, n)| format!("{k} {n}")).collect();
                    format!("{} ({})", t.refused, why.join(", "))
                },
                t.errors,
                t.pools
                    .iter()
                    .map(|(p, n)| format!("{p} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    let names: Vec<&str> = first.sims.iter().map(|s| s.name.as_str()).collect();
    let _ = writeln!(
            md,
            "\n| selection | goodput rps | hit rate on-demand | spot | small | all | {} | client lag p99 ms |\n|---|---|---|---|---|---|{}---|",
            names
                .iter()
                .map(|n| format!("{n} share / hit / busy / waiting / queue p95 ms"))
                .collect::<Vec<_>>()
                .join(" | "),
            "---|".repeat(names.len())
        );
    for r in &rs {
        let sims: Vec<String> = r
            .sims
            .iter()
            .map(|s| {
                format!(
                    "{} / {} / {:.0} % / {:.1} / {}",
                    pct(s.share),
                    pct(s.prefix_cache_hit_tokens as f64
                        / s.prefix_cache_queries_tokens.max(1) as f64),
                    s.busy * 100.0,
                    s.mean_waiting,
                    ms(s.queue_p95_ms)
                )
            })
            .collect();
        let _ = writeln!(
            md,
            "| {} | {:.2} | {} | {} | {} | {} | {} | {:.0} |",
            r.selection.as_str(),
            r.goodput_rps,
            pct(r.hit_rate["on-demand"]),
            pct(r.hit_rate["spot"]),
            pct(r.hit_rate["small"]),
            pct(r.hit_rate["all"]),
            sims.join(" | "),
            r.send_lag_p99_ms
        );
    }
    let _ = writeln!(md);
    for r in &rs {
        let Some(a) = &r.affinity else { continue };
        let homes: Vec<String> = a
            .prompts
            .iter()
            .enumerate()
            .map(|(k, m)| {
                let by: Vec<String> = m.iter().map(|(s, n)| format!("{s} {n}")).collect();
                format!("p{k}: {}", by.join(", "))
            })
            .collect();
        let _ = writeln!(
                md,
                "- {}: {:.0} % of the on-demand requests of a shared prompt went to that prompt's busiest replica, where {} of their prompt tokens were cached ({} elsewhere) ({}; {:.0} % of the requests seen in the simulators' admission lists)",
                r.selection.as_str(),
                a.concentration * 100.0,
                pct(a.home_hit_rate),
                pct(a.away_hit_rate),
                homes.join("; "),
                a.coverage * 100.0
            );
    }
    if rs.iter().any(|r| r.affinity.is_some()) {
        let _ = writeln!(md);
    }
    if sc == Scenario::SlowReplica {
        for r in &rs {
            let _ = writeln!(md, "- {}: {}", r.selection.as_str(), by_replica(r));
        }
        let _ = writeln!(md);
    }
    let cs: Vec<&Check> = checks
        .iter()
        .filter(|c| c.scenario == sc.as_str())
        .collect();
    if !cs.is_empty() {
        let _ = writeln!(md, "Targets:\n");
        for c in cs {
            let _ = writeln!(
                md,
                "- **{}** {}: {}",
                if c.pass { "PASS" } else { "FAIL" },
                c.what,
                c.detail
            );
        }
        let _ = writeln!(md);
    }
}

// ---------------------------------------------------------------------------------------------

fn render_heads(
    md: &mut String,
    args: &FleetArgs,
    runs: &[RunOut],
    checks: &[Check],
    sc: Scenario,
) {
    let loads = loads_of(runs, sc);
    let Some(&first_load) = loads.first() else {
        return;
    };
    let w = Workload::heads(args, sc, first_load, args.seed);
    let _ = writeln!(md, "### {}\n", sc.as_str());
    let rates: Vec<String> = loads
        .iter()
        .map(|l| {
            format!(
                "{l}× = {:.1} req/s",
                Workload::heads(args, sc, *l, args.seed).rate
            )
        })
        .collect();
    let _ = writeln!(
        md,
        "Replicas: `sluice sim {}` (the 8b one prefills 4× and decodes 2× faster): a 70b \
         replica's free prefix cache holds {:.1} of the {} system prompts of {} tokens, {:.1} \
         per on-demand replica if each stays on one. Traffic: open loop, Poisson, {} s of \
         arrivals of which the first {} s are not measured (caches fill, prefix affinity \
         learns whether its homes pay); {:.0} % to `{SMALL_MODEL}`, the rest a system prompt then \
         a unique {}-{} token user turn, max_tokens {}-{}, tenants weighted {}. Load: the \
         arrival rate over the on-demand pool's capacity with nothing cached (three replicas, \
         each {:.2} req/s: the lower of its batch over one request's prefill and decode, and \
         its prefill compute over whole prompts, taken in turn as on a GPU with \
         `--serial-prefill`): {}. Seeds {}..{} \
         for every load and selection; a figure is the mean over seeds [lowest–highest]. \
         Ceiling: the system prompts' share of the on-demand pool's prompt tokens.\n",
        w.sim_flags(MAIN_MODEL)
            .iter()
            .skip(2)
            .cloned()
            .collect::<Vec<_>>()
            .join(" "),
        args.heads_prefix_cache_tokens as f64 / args.system_tokens.max(1) as f64,
        w.shared_prompts,
        w.system_tokens,
        w.shared_prompts as f64 / ON_DEMAND_REPLICAS,
        w.duration_s,
        w.warmup_s,
        w.small_share * 100.0,
        w.user_tokens[0],
        w.user_tokens[1],
        w.max_tokens[0],
        w.max_tokens[1],
        w.tier_weights
            .iter()
            .map(|x| format!("{x}"))
            .collect::<Vec<_>>()
            .join("/"),
        w.replica_capacity(),
        rates.join(", "),
        args.seed,
        args.seed + args.seeds - 1,
    );
    let _ = writeln!(
        md,
        "| load | selection | on-demand hit rate | of the ceiling | TTFT p95 ms Guaranteed | Standard | Best-Effort | SLA viol % Guaranteed / Standard | prefix affinity at the end |\n|---|---|---|---|---|---|---|---|---|"
    );
    let sels = [
        Selection::RoundRobin,
        Selection::LeastLoad,
        Selection::PrefixAffinity,
    ];
    for &load in &loads {
        for sel in sels {
            let rs = heads_runs(runs, sc, load, sel);
            if rs.is_empty() {
                continue;
            }
            let show =
                |s: Option<Spread>, f: fn(&Spread) -> String| s.map_or("-".into(), |s| f(&s));
            let viol = |t: Tier| {
                over(&rs, |r| r.tiers[t.index()].sla_viol_pct).map_or("-".into(), |s| {
                    format!("{:.1} [{:.1}–{:.1}]", s.mean, s.lo, s.hi)
                })
            };
            let judged: Vec<String> = rs
                .iter()
                .filter_map(|r| r.judged.as_ref())
                .map(|a| {
                    format!(
                        "{} {}",
                        a["state"].as_str().unwrap_or("?"),
                        a["hit_rate"]
                            .as_f64()
                            .map_or("-".into(), |h| format!("{:.0} %", h * 100.0))
                    )
                })
                .collect();
            let _ = writeln!(
                md,
                "| {load}× | {} | {} | {} | {} | {} | {} | {} / {} | {} |",
                sel.as_str(),
                show(over(&rs, |r| Some(r.hit_rate["on-demand"])), Spread::pct),
                show(over(&rs, of_ceiling), Spread::pct),
                show(over(&rs, tier_ttft(Tier::Guaranteed)), Spread::ms),
                show(over(&rs, tier_ttft(Tier::Standard)), Spread::ms),
                show(over(&rs, tier_ttft(Tier::BestEffort)), Spread::ms),
                viol(Tier::Guaranteed),
                viol(Tier::Standard),
                if judged.is_empty() {
                    "-".into()
                } else {
                    judged.join(", ")
                },
            );
        }
    }
    let _ = writeln!(md);
    let cs: Vec<&Check> = checks
        .iter()
        .filter(|c| c.scenario == sc.as_str())
        .collect();
    if !cs.is_empty() {
        let _ = writeln!(
            md,
            "Targets (Best-Effort is served by the single-replica spot pool, where selection has no choice):\n"
        );
        for c in cs {
            let _ = writeln!(
                md,
                "- **{}** {}: {}",
                if c.pass { "PASS" } else { "FAIL" },
                c.what,
                c.detail
            );
        }
        let _ = writeln!(md);
    }
}

// ---------------------------------------------------------------------------------------------

/// One run, logged as it ends.
async fn run_logged(
    args: &FleetArgs,
    w: &Workload,
    bin: &Path,
    sc: Scenario,
    sel: Selection,
    planned: &[Planned],
) -> Result<RunOut, String> {
    eprintln!(
        "sluice-bench fleet: {} / {}{}: {} requests over {} s",
        sc.as_str(),
        sel.as_str(),
        w.load
            .map_or(String::new(), |l| format!(" at {l}× seed {}", w.seed)),
        planned.len(),
        w.duration_s
    );
    let r = run_one(args, w, bin, sc, sel, planned).await?;
    let t: Vec<String> = r
        .tiers
        .iter()
        .map(|t| {
            format!(
                "{} ttft p95 {} viol {}",
                t.tier,
                ms(t.ttft_p95_ms),
                t.sla_viol_pct.map_or("-".into(), |v| format!("{v:.1} %"))
            )
        })
        .collect();
    let judged = r.judged.as_ref().map_or(String::new(), |a| {
        format!(
            "; affinity {} (home hit rate {})",
            a["state"].as_str().unwrap_or("?"),
            a["hit_rate"]
                .as_f64()
                .map_or("-".into(), |h| format!("{:.0} %", h * 100.0))
        )
    });
    eprintln!(
        "  hit rate on-demand {} (ceiling {}) all {}; goodput {:.2} rps; {}{judged}",
        pct(r.hit_rate["on-demand"]),
        pct(r.ceiling),
        pct(r.hit_rate["all"]),
        r.goodput_rps,
        t.join("; ")
    );
    Ok(r)
}

pub async fn run(args: &FleetArgs) -> Result<(), String> {
    args.check()?;
    let bin = procs::sluice_bin(args.sluice_bin.as_deref())?;
    let env = environment();
    let mut runs = Vec::new();
    for sc in args.scenarios() {
        if sc.heads() {
            for &load in &args.loads {
                for seed in args.seed..args.seed + args.seeds {
                    let w = Workload::heads(args, sc, load, seed);
                    let planned = plan(&w, true);
                    for &sel in &args.selections {
                        runs.push(run_logged(args, &w, &bin, sc, sel, &planned).await?);
                    }
                }
            }
            continue;
        }
        let w = Workload::of(args);
        let planned = plan(&w, sc != Scenario::NoSharedPrefix);
        let sels = match sc {
            Scenario::SlowReplica => &args.slow_selections,
            _ => &args.selections,
        };
        for &sel in sels {
            runs.push(run_logged(args, &w, &bin, sc, sel, &planned).await?);
        }
    }
    let checks = checks(&runs);
    let md = render(args, &runs, &checks, &env);
    print!("{md}");
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    std::fs::write(&args.out, &md).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let json_path = args.out.with_extension("json");
    let doc = json!({
        "command": command_line(),
        "date": date(),
        "nproc": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu": cpu_model(),
        "environment": env,
        "runs": runs,
        "checks": checks,
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(&json_path, text).map_err(|e| format!("{}: {e}", json_path.display()))?;
    eprintln!(
        "sluice-bench fleet: wrote {} and {}",
        args.out.display(),
        json_path.display()
    );
    Ok(())
}
