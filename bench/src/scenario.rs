//! The canonical workload description. One [`Scenario`] (a YAML file under `bench/scenarios/`)
//! says everything about a run that is not the proxy's own configuration: the arrival process
//! and its seed, the tenant and tier mix, prompt and completion lengths, the streaming share, the
//! SLA targets, the simulator backends' parameters, an optional forced pressure timeline and
//! timed events. [`Scenario::arrivals`] expands it into the exact list of requests, so the
//! in-process model and the live HTTP run replay the very same requests.

use serde::{Deserialize, Serialize};
use sluice_policy::slo::Slo;
use sluice_policy::Tier;

/// The built-in scenarios, embedded so the binary runs from any directory.
pub const BUILT_IN: [(&str, &str); 9] = [
    ("seed", include_str!("../scenarios/seed.yaml")),
    (
        "shared-backend",
        include_str!("../scenarios/shared-backend.yaml"),
    ),
    ("seed-forced", include_str!("../scenarios/seed-forced.yaml")),
    (
        "seed-defaults",
        include_str!("../scenarios/seed-defaults.yaml"),
    ),
    ("overload", include_str!("../scenarios/overload.yaml")),
    (
        "spot-failure",
        include_str!("../scenarios/spot-failure.yaml"),
    ),
    ("bursty", include_str!("../scenarios/bursty.yaml")),
    ("tiny", include_str!("../scenarios/tiny.yaml")),
    (
        "noisy-neighbour",
        include_str!("../scenarios/noisy-neighbour.yaml"),
    ),
];

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub seed: u64,
    /// Arrivals of the base process (bursts come on top).
    pub requests: usize,
    /// Length of the arrival window; every rate and goodput is per second of it.
    pub duration_s: f64,
    /// Relative arrival intensity over time as piecewise-linear `[t_s, weight]` points; empty
    /// means constant. Only the shape matters: `requests` fixes the count.
    #[serde(default)]
    pub rate: Vec<[f64; 2]>,
    pub tenants: Vec<TenantMix>,
    #[serde(default)]
    pub bursts: Vec<Burst>,
    /// KV pressure in percent, `[t_s, value]` piecewise-linear, written to Sluice's
    /// `PUT /admin/pressure` during Sluice runs. Empty: the policy reads the scraped pressure.
    #[serde(default)]
    pub forced_pressure: Vec<[f64; 2]>,
    #[serde(default)]
    pub events: Vec<Event>,
    /// Also run the `baseline` mode (this scenario's Guaranteed arrivals alone, direct).
    #[serde(default)]
    pub baseline: bool,
    /// Restricts the modes this scenario runs in (a variant that only changes Sluice's knobs
    /// has nothing new to say about `direct`). Empty: every requested mode.
    #[serde(default)]
    pub modes: Vec<String>,
    /// Report a table per tenant (tenants sharing a tier).
    #[serde(default)]
    pub per_tenant: bool,
    /// When the overload is over; recovery time is measured from here.
    #[serde(default)]
    pub recovery_marker_s: Option<f64>,
    /// Each tier's end-to-end target (`sla_target_ms`): the objective unless `slo_ms` is set.
    pub sla_ms: SlaTargets,
    /// Each tier's TTFT and TPOT targets (`slo: {ttft_ms, tpot_ms}`); set, they are the
    /// objective and `sla_ms` is not judged. `--slo-x` sets them from the unloaded values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ms: Option<SloTargets>,
    pub backends: Backends,
    /// Deep-merged into the generated Sluice config of phase 2 (phase 1 keeps only what does not
    /// contradict "pressure signal only"). These are the benchmark's tuned knobs, reported.
    #[serde(default)]
    pub sluice: serde_json::Value,
    /// `--sluice-override`, which also reaches the `adaptive` mode's shipped config (the
    /// scenario's own knobs never do): for exploring a setting, never for a result.
    #[serde(skip)]
    pub explore: serde_json::Value,
    /// Each request's natural answer length as a share of its `max_tokens`, drawn uniformly
    /// in this range: the answer ends there on its own unless a cap is lower. Absent: every
    /// answer runs to its `max_tokens` (the `slowdown` engine model's workload).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_share: Option<[f64; 2]>,
    /// How this run was derived from the scenario file (engine model, GPU-like timings, target
    /// scaling), for the reports and the target checks.
    #[serde(skip)]
    pub variant: Variant,
}

/// What the command line did to a scenario.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Variant {
    pub reserve: bool,
    /// GPU-like timings: the decode step every backend was scaled to (ms).
    pub gpu_itl_ms: Option<f64>,
    /// `--sla-x`: end-to-end targets at this multiple of the unloaded latency.
    pub sla_x: Option<f64>,
    /// `--slo-x`: TTFT and TPOT targets at this multiple of their unloaded values.
    pub slo_x: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantMix {
    pub name: String,
    pub tier: String,
    /// Share of the base arrivals, relative to the other tenants' weights.
    pub weight: f64,
    /// Inclusive uniform ranges.
    pub prompt_tokens: [u64; 2],
    pub max_tokens: [u64; 2],
    #[serde(default)]
    pub stream_share: f64,
}

/// Extra arrivals of one tenant, spread uniformly at random over a window.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    pub tenant: String,
    pub at_s: f64,
    pub duration_s: f64,
    pub requests: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub at_s: f64,
    #[serde(flatten)]
    pub kind: EventKind,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// `PUT /admin/health` on the spot simulator.
    SpotHealthy(bool),
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlaTargets {
    #[serde(rename = "Guaranteed")]
    pub guaranteed: u64,
    #[serde(rename = "Standard")]
    pub standard: u64,
    #[serde(rename = "Best-Effort")]
    pub best_effort: u64,
}

impl SlaTargets {
    pub fn get(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Guaranteed => self.guaranteed,
            Tier::Standard => self.standard,
            Tier::BestEffort => self.best_effort,
        }
    }
}

/// One tier's targets in the units users set them.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TierSlo {
    pub ttft_ms: u64,
    pub tpot_ms: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SloTargets {
    #[serde(rename = "Guaranteed")]
    pub guaranteed: TierSlo,
    #[serde(rename = "Standard")]
    pub standard: TierSlo,
    #[serde(rename = "Best-Effort")]
    pub best_effort: TierSlo,
}

impl SloTargets {
    pub fn get(&self, tier: Tier) -> TierSlo {
        match tier {
            Tier::Guaranteed => self.guaranteed,
            Tier::Standard => self.standard,
            Tier::BestEffort => self.best_effort,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backends {
    #[serde(rename = "on-demand")]
    pub on_demand: SimParams,
    pub spot: SimParams,
    /// One simulator serves both pools and the fallback model (with `on-demand`'s parameters):
    /// every mode then runs on the same capacity as `direct`.
    #[serde(default)]
    pub shared: bool,
}

/// What a simulated engine holds in KV for a running request (`sluice sim --kv-reserve`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvReserve {
    /// Prompt plus the tokens the answer will really have.
    #[default]
    Output,
    /// Prompt plus the whole `max_tokens`, taken at admission and held to the end (vLLM
    /// without preemption): a cap frees reservation even when the answer is short anyway.
    MaxTokens,
}

/// `sluice sim` flags; the same numbers drive the in-process backend model.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimParams {
    pub kv_tokens: u64,
    pub max_running: usize,
    pub ttft_ms: u64,
    pub prefill_us_per_token: u64,
    pub itl_ms: f64,
    pub load_slowdown: f64,
    #[serde(default, skip_serializing_if = "is_default")]
    pub kv_reserve: KvReserve,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

impl SimParams {
    /// A lone request's latency on this backend (prefill, then one decode step a token after
    /// the first), with the slowdown its own KV share causes: what it takes with nobody else
    /// there.
    pub fn unloaded_ms(&self, prompt: u64, answer: u64) -> f64 {
        // Kept in this form (not ttft + tokens × tpot) so that `--sla-x` targets stay the
        // figures they have always been, to the last rounding.
        let usage = (prompt + answer) as f64 / self.kv_tokens.max(1) as f64;
        let factor = 1.0 + self.load_slowdown * usage.min(1.0);
        let prefill = self.ttft_ms as f64 + prompt as f64 * self.prefill_us_per_token as f64 / 1e3;
        (prefill + answer.saturating_sub(1) as f64 * self.itl_ms) * factor
    }

    /// A lone request's time to first token: its prefill, slowed by its own KV share.
    pub fn unloaded_ttft_ms(&self, prompt: u64, answer: u64) -> f64 {
        let prefill = self.ttft_ms as f64 + prompt as f64 * self.prefill_us_per_token as f64 / 1e3;
        prefill * self.lone_factor(prompt, answer)
    }

    /// A lone request's time per output token after the first.
    pub fn unloaded_tpot_ms(&self, prompt: u64, answer: u64) -> f64 {
        self.itl_ms * self.lone_factor(prompt, answer)
    }

    fn lone_factor(&self, prompt: u64, answer: u64) -> f64 {
        let usage = (prompt + answer) as f64 / self.kv_tokens.max(1) as f64;
        1.0 + self.load_slowdown * usage.min(1.0)
    }

    pub fn flags(&self) -> Vec<String> {
        let reserve = match self.kv_reserve {
            KvReserve::Output => None,
            KvReserve::MaxTokens => Some(["--kv-reserve".to_string(), "max-tokens".into()]),
        };
        let mut flags = vec![
            "--kv-tokens".into(),
            self.kv_tokens.to_string(),
            "--max-running".into(),
            self.max_running.to_string(),
            "--ttft-ms".into(),
            self.ttft_ms.to_string(),
            "--prefill-us-per-token".into(),
            self.prefill_us_per_token.to_string(),
            "--itl-ms".into(),
            self.itl_ms.to_string(),
            "--load-slowdown".into(),
            self.load_slowdown.to_string(),
        ];
        flags.extend(reserve.into_iter().flatten());
        // The model engine has no prefix cache, and the scenarios' synthetic prompts share
        // their heads: with the simulator's cache on, live runs would be a lighter workload
        // than the model runs they are checked against.
        flags.extend(["--prefix-caching".to_string(), "off".into()]);
        flags
    }
}

/// One request of a run, fully determined by the scenario and its seed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Arrival {
    pub id: usize,
    pub at_ms: u64,
    pub tenant: String,
    #[serde(serialize_with = "ser_tier")]
    pub tier: Tier,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    pub stream: bool,
    /// Where the answer ends on its own (`x-sim-output-tokens`); `None`: at `max_tokens`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
}

impl Arrival {
    /// The completion this request produces under a cap of `max_tokens`.
    pub fn answer_tokens(&self, max_tokens: u64) -> u64 {
        self.output_tokens.map_or(max_tokens, |n| n.min(max_tokens))
    }
}

pub fn ser_tier<S: serde::Serializer>(t: &Tier, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(t.as_str())
}

impl Scenario {
    pub fn built_in(name: &str) -> Result<Scenario, String> {
        let (_, text) = BUILT_IN.iter().find(|(n, _)| *n == name).ok_or_else(|| {
            let names: Vec<&str> = BUILT_IN.iter().map(|(n, _)| *n).collect();
            format!("unknown scenario {name:?} (built in: {})", names.join(", "))
        })?;
        Self::from_yaml(text)
    }

    pub fn load(name_or_path: &str) -> Result<Scenario, String> {
        if name_or_path.ends_with(".yaml") || name_or_path.ends_with(".yml") {
            let text = std::fs::read_to_string(name_or_path)
                .map_err(|e| format!("{name_or_path}: {e}"))?;
            Self::from_yaml(&text).map_err(|e| format!("{name_or_path}: {e}"))
        } else {
            Self::built_in(name_or_path)
        }
    }

    /// Parses a scenario. `extends: <built-in name>` starts from that scenario and deep-merges
    /// this one over it (lists replace), so a variant states only what differs.
    pub fn from_yaml(text: &str) -> Result<Scenario, String> {
        let v = Self::resolve(text, 0)?;
        let s: Scenario = serde_json::from_value(v).map_err(|e| e.to_string())?;
        s.validate()?;
        Ok(s)
    }

    fn resolve(text: &str, depth: usize) -> Result<serde_json::Value, String> {
        let yaml: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        let mut v = serde_json::to_value(yaml).map_err(|e| e.to_string())?;
        let Some(base) = v.as_object_mut().and_then(|o| o.remove("extends")) else {
            return Ok(v);
        };
        let name = base
            .as_str()
            .ok_or("extends: must name a built-in scenario")?;
        let (_, base_text) = BUILT_IN
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| format!("extends: unknown scenario {name:?}"))?;
        if depth > 4 {
            return Err("extends: too deep".into());
        }
        let mut merged = Self::resolve(base_text, depth + 1)?;
        sluice_testkit::merge(&mut merged, &v);
        Ok(merged)
    }

    fn validate(&self) -> Result<(), String> {
        if !self.duration_s.is_finite() || self.duration_s <= 0.0 {
            return Err("duration_s must be positive".into());
        }
        if self.tenants.is_empty() || self.tenants.iter().all(|t| t.weight <= 0.0) {
            return Err("at least one tenant with a positive weight is needed".into());
        }
        for t in &self.tenants {
            Tier::parse(&t.tier).ok_or_else(|| format!("tenant {}: unknown tier", t.name))?;
            if t.prompt_tokens[0] > t.prompt_tokens[1] || t.max_tokens[0] > t.max_tokens[1] {
                return Err(format!("tenant {}: a range is reversed", t.name));
            }
            if t.max_tokens[0] == 0 {
                return Err(format!("tenant {}: max_tokens must be at least 1", t.name));
            }
        }
        for b in &self.bursts {
            if !self.tenants.iter().any(|t| t.name == b.tenant) {
                return Err(format!("burst names unknown tenant {}", b.tenant));
            }
        }
        if self.rate.iter().any(|p| p[1] < 0.0) {
            return Err("rate weights must be non-negative".into());
        }
        Ok(())
    }

    /// Every request of the run, sorted by arrival time. Pure: a scenario and its seed always
    /// give the same list.
    pub fn arrivals(&self) -> Vec<Arrival> {
        let mut rng = Rng::new(self.seed);
        let horizon_ms = self.duration_s * 1000.0;
        // Sorted uniform draws mapped through the inverse cumulative intensity are a Poisson
        // process conditioned on its count: random spacing, exactly `requests` arrivals.
        let mut base: Vec<f64> = (0..self.requests).map(|_| rng.unit()).collect();
        base.sort_by(f64::total_cmp);
        let inverse = InverseIntensity::new(&self.rate, horizon_ms);
        let mut out: Vec<(f64, usize)> = Vec::new();
        let weights: Vec<f64> = self.tenants.iter().map(|t| t.weight.max(0.0)).collect();
        for u in base {
            out.push((inverse.at(u), rng.pick(&weights)));
        }
        for b in &self.bursts {
            let idx = self
                .tenants
                .iter()
                .position(|t| t.name == b.tenant)
                .unwrap_or(0);
            for _ in 0..b.requests {
                let t = (b.at_s + rng.unit() * b.duration_s) * 1000.0;
                out.push((t.clamp(0.0, horizon_ms), idx));
            }
        }
        // Attributes are drawn in generation order, before sorting, so adding a burst never
        // changes the base arrivals' sizes.
        let mut arrivals: Vec<Arrival> = out
            .into_iter()
            .map(|(t, idx)| {
                let mix = &self.tenants[idx];
                Arrival {
                    id: 0,
                    at_ms: t.round() as u64,
                    tenant: mix.name.clone(),
                    tier: Tier::parse(&mix.tier).unwrap_or(Tier::BestEffort),
                    prompt_tokens: rng.range(mix.prompt_tokens),
                    max_tokens: rng.range(mix.max_tokens),
                    stream: rng.unit() < mix.stream_share,
                    output_tokens: None,
                }
            })
            .collect();
        // Natural lengths from a stream of their own, so the requests themselves are the same
        // whatever the engine model.
        if let Some([lo, hi]) = self.output_share {
            let mut lengths = Rng::new(self.seed ^ 0x6f75_7470_7574);
            for a in &mut arrivals {
                let share = lo + (hi - lo) * lengths.unit();
                a.output_tokens = Some(((a.max_tokens as f64 * share).round() as u64).max(1));
            }
        }
        arrivals.sort_by_key(|a| a.at_ms);
        for (i, a) in arrivals.iter_mut().enumerate() {
            a.id = i;
        }
        arrivals
    }

    /// Whether this scenario runs in `mode` (see [`Scenario::modes`] and [`Scenario::baseline`]).
    pub fn runs_in(&self, mode: &str) -> bool {
        if mode == "baseline" && !self.baseline {
            return false;
        }
        self.modes.is_empty() || self.modes.iter().any(|m| m == mode)
    }

    /// The forced pressure at `t_ms`, if the scenario forces one.
    pub fn forced_pressure_at(&self, t_ms: f64) -> Option<f64> {
        (!self.forced_pressure.is_empty())
            .then(|| interpolate(&self.forced_pressure, t_ms / 1000.0))
    }

    /// A copy with only the given tier's arrivals, for the "backend unloaded" baseline.
    pub fn only_tier(&self, tier: Tier) -> Vec<Arrival> {
        self.arrivals()
            .into_iter()
            .filter(|a| a.tier == tier)
            .collect()
    }
}

/// The vLLM engine the simulators model (`--engine-model`). A policy that only holds on the
/// engine it was tuned on is not done, so every scenario runs on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineModel {
    /// The scenario's own backends: KV held for prompt plus answer, every answer runs to its
    /// `max_tokens`, decode slows as the cache fills.
    Slowdown,
    /// vLLM without preemption: KV reserved for prompt plus `max_tokens` at admission and held
    /// to the end, answers ending on their own at 15–45 % of `max_tokens`, fixed-time decode
    /// steps, strict FCFS.
    Reserve,
}

/// Natural answer lengths of the `reserve` engine model, as shares of `max_tokens`.
const RESERVE_OUTPUT_SHARE: [f64; 2] = [0.15, 0.45];
/// The `reserve` model's fixed decode step, in `slowdown` backends' unloaded steps (1 ms →
/// 10 ms, near the 15 ms of a 70B model on one node). With answers at 15–45 % of `max_tokens`
/// a request then holds its reservation about 1.6× as long as on a `slowdown` backend at
/// typical load, so the scenarios' peaks queue on both engines: with tight targets (1.7×),
/// direct on `seed` misses about as often as the independent emulator's did (28 / 35 % of
/// Guaranteed / Standard over 5 seeds, against 27.5 / 35 %).
const RESERVE_STEP_X: f64 = 10.0;

impl Scenario {
    /// This scenario's requests on another engine model. The `reserve` backends keep the KV
    /// budget and batch limit, and pace decode so that the same arrivals queue at the same
    /// peaks on both engines: what differs is how each one queues.
    pub fn on_engine(mut self, model: EngineModel) -> Scenario {
        if model == EngineModel::Slowdown {
            return self;
        }
        for b in [&mut self.backends.on_demand, &mut self.backends.spot] {
            b.itl_ms = (b.itl_ms * RESERVE_STEP_X * 2.0).round() / 2.0;
            b.load_slowdown = 0.0;
            b.kv_reserve = KvReserve::MaxTokens;
        }
        self.output_share = Some(RESERVE_OUTPUT_SHARE);
        self.variant.reserve = true;
        self.name = format!("{}+reserve", self.name);
        self.description = format!("{} [engine: reserve]", self.description);
        self
    }

    /// Each tier's SLA target set to `x` times its unloaded latency: the 90th percentile of
    /// its requests' latencies each alone on its tier's pool (what the controller's quantile
    /// reads on an idle fleet). Tight (1.3–1.8×) and loose (4–10×) targets both occur.
    pub fn with_sla_x(mut self, x: f64) -> Result<Scenario, String> {
        if !x.is_finite() || x <= 0.0 {
            return Err(format!("--sla-x must be positive, got {x}"));
        }
        let arrivals = self.arrivals();
        let mut targets = [0u64; 3];
        for tier in Tier::ALL {
            let backend = if tier == Tier::BestEffort && !self.backends.shared {
                &self.backends.spot
            } else {
                &self.backends.on_demand
            };
            let mut alone: Vec<f64> = arrivals
                .iter()
                .filter(|a| a.tier == tier)
                .map(|a| backend.unloaded_ms(a.prompt_tokens, a.answer_tokens(a.max_tokens)))
                .collect();
            alone.sort_by(f64::total_cmp);
            let p90 = crate::stats::percentile(&alone, 90.0).unwrap_or(0.0);
            targets[tier.index()] = ((p90 * x / 10.0).ceil() as u64 * 10).max(10);
        }
        self.sla_ms = SlaTargets {
            guaranteed: targets[0],
            standard: targets[1],
            best_effort: targets[2],
        };
        self.slo_ms = None;
        self.variant.sla_x = Some(x);
        self.name = format!("{}+sla{x}", self.name);
        self.description = format!(
            "{} [SLA targets {x}× unloaded p90: {} / {} / {} ms]",
            self.description, targets[0], targets[1], targets[2]
        );
        Ok(self)
    }
}

impl Scenario {
    /// The backend a tier's requests run on (spot for Best-Effort unless the backend is shared).
    fn backend_of(&self, tier: Tier) -> &SimParams {
        if tier == Tier::BestEffort && !self.backends.shared {
            &self.backends.spot
        } else {
            &self.backends.on_demand
        }
    }

    /// Each tier's unloaded TTFT and TPOT on its pool (ms): the 90th percentile over its
    /// requests, each alone on the backend (TPOT over the answers of two tokens or more), as
    /// `--sla-x` takes the unloaded end-to-end latency.
    pub fn unloaded_slo_ms(&self) -> [(f64, f64); 3] {
        let arrivals = self.arrivals();
        Tier::ALL.map(|tier| {
            let b = self.backend_of(tier);
            let mine = || arrivals.iter().filter(move |a| a.tier == tier);
            let p90 = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                crate::stats::percentile(&v, 90.0).unwrap_or(0.0)
            };
            let ttft = mine()
                .map(|a| b.unloaded_ttft_ms(a.prompt_tokens, a.answer_tokens(a.max_tokens)))
                .collect();
            let tpot = mine()
                .filter(|a| a.answer_tokens(a.max_tokens) >= 2)
                .map(|a| b.unloaded_tpot_ms(a.prompt_tokens, a.answer_tokens(a.max_tokens)))
                .collect();
            (p90(ttft), p90(tpot))
        })
    }

    /// Each tier's TTFT and TPOT targets set to `x` times its unloaded values
    /// ([`Scenario::unloaded_slo_ms`]), rounded up to the whole millisecond a config can say
    /// (so at a 1 ms decode step a TPOT target is coarse: the description gives each
    /// target's real multiple). The objective is then TTFT and TPOT only, as the shipped config
    /// sets it; the end-to-end targets are not judged.
    pub fn with_slo_x(mut self, x: f64) -> Result<Scenario, String> {
        if !x.is_finite() || x <= 0.0 {
            return Err(format!("--slo-x must be positive, got {x}"));
        }
        let unloaded = self.unloaded_slo_ms();
        let target = |v: f64| ((v * x).ceil() as u64).max(1);
        let t = unloaded.map(|(ttft, tpot)| TierSlo {
            ttft_ms: target(ttft),
            tpot_ms: target(tpot),
        });
        self.slo_ms = Some(SloTargets {
            guaranteed: t[0],
            standard: t[1],
            best_effort: t[2],
        });
        self.variant.slo_x = Some(x);
        self.variant.sla_x = None;
        let shown: Vec<String> = Tier::ALL
            .iter()
            .map(|tier| {
                let (u, v) = (unloaded[tier.index()], t[tier.index()]);
                format!(
                    "{} {}/{} ms ({:.2}×/{:.2}× of {:.1}/{:.2})",
                    tier.as_str(),
                    v.ttft_ms,
                    v.tpot_ms,
                    v.ttft_ms as f64 / u.0.max(1e-9),
                    v.tpot_ms as f64 / u.1.max(1e-9),
                    u.0,
                    u.1
                )
            })
            .collect();
        self.name = format!("{}+slo{x}", self.name);
        self.description = format!(
            "{} [TTFT/TPOT targets {x}× unloaded p90: {}]",
            self.description,
            shown.join("; ")
        );
        Ok(self)
    }

    /// Tier `tier`'s objective in this run: TTFT and TPOT when `slo_ms` is set, else the
    /// end-to-end target alone (the prototype's `sla_target_ms`).
    pub fn objective(&self, tier: Tier) -> Slo {
        match self.slo_ms {
            Some(t) => {
                let t = t.get(tier);
                Slo {
                    ttft_ms: Some(t.ttft_ms),
                    tpot_ms: Some(t.tpot_ms),
                    e2e_ms: None,
                }
            }
            None => Slo::e2e(self.sla_ms.get(tier)),
        }
    }

    pub fn objectives(&self) -> [Slo; 3] {
        Tier::ALL.map(|t| self.objective(t))
    }

    /// This scenario on GPU-like backends: every engine time (decode step, fixed prefill, prefill
    /// per token) multiplied by `k = itl_ms / on-demand's decode step`, so a decode step takes
    /// `itl_ms`, and the load kept where it was relative to capacity, which a step `k` times
    /// longer divides by `k` in requests a second. `GpuLoad::Stretch` stretches the whole
    /// timeline by `k` (window, rate profile, bursts, events, recovery marker) with the same
    /// requests: the workload slowed down as a whole, so every queue lasts `k` times as long,
    /// as the requests and their targets do. `GpuLoad::Rate` divides the arrivals (and
    /// bursts) by `k` over the same window: a queue built by an overload of a given depth and
    /// length then waits as many seconds as at the scenario's own pace (backlog over service
    /// rate: `(ρ − 1) × its length`), a `k`-th of it in request times, so it is a milder
    /// overload against targets `k` times longer.
    pub fn on_gpu(mut self, itl_ms: f64, load: GpuLoad) -> Result<Scenario, String> {
        let own = self.backends.on_demand.itl_ms;
        if !itl_ms.is_finite() || itl_ms <= 0.0 || own <= 0.0 {
            return Err(format!("--gpu-itl-ms must be positive, got {itl_ms}"));
        }
        let k = itl_ms / own;
        for b in [&mut self.backends.on_demand, &mut self.backends.spot] {
            b.itl_ms = (b.itl_ms * k * 100.0).round() / 100.0;
            b.ttft_ms = (b.ttft_ms as f64 * k).round() as u64;
            b.prefill_us_per_token = (b.prefill_us_per_token as f64 * k).round() as u64;
        }
        match load {
            GpuLoad::Stretch => {
                let t = |s: f64| (s * k * 1000.0).round() / 1000.0;
                self.duration_s = t(self.duration_s);
                for p in self.rate.iter_mut().chain(self.forced_pressure.iter_mut()) {
                    p[0] = t(p[0]);
                }
                for e in &mut self.events {
                    e.at_s = t(e.at_s);
                }
                for b in &mut self.bursts {
                    b.at_s = t(b.at_s);
                    b.duration_s = t(b.duration_s);
                }
                self.recovery_marker_s = self.recovery_marker_s.map(t);
            }
            GpuLoad::Rate => {
                let tenants = self.tenants.iter().filter(|m| m.weight > 0.0).count();
                self.requests = scale_count(self.requests, 1.0 / k, tenants);
                for b in &mut self.bursts {
                    b.requests = scale_count(b.requests, 1.0 / k, 1);
                }
            }
        }
        self.variant.gpu_itl_ms = Some(itl_ms);
        let how = match load {
            GpuLoad::Stretch => format!(
                "timeline ×{k:.3} ({} s), the same requests",
                self.duration_s
            ),
            GpuLoad::Rate => format!("arrivals ÷{k:.3} over the same window"),
        };
        self.name = format!("{}+gpu{itl_ms}", self.name);
        self.description = format!(
            "{} [GPU-like: {itl_ms} ms a decode step, engine times ×{k:.3}, {how}]",
            self.description
        );
        Ok(self)
    }
}

/// How GPU-like timings keep a scenario's load relative to capacity (`--gpu-load`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GpuLoad {
    /// The same requests over a timeline stretched by the slowdown factor: the overload
    /// reproduced, queues as long as the requests in request times.
    Stretch,
    /// Arrivals ÷ the slowdown factor over the same window: a milder overload.
    Rate,
}

/// Floors on a time-scaled scenario's counts, so that a run of a few seconds still fills every
/// tier's row and still shows each burst: base arrivals per tenant (on average; the tenant of an
/// arrival is drawn) and arrivals per burst.
const MIN_SCALED_PER_TENANT: usize = 5;
const MIN_SCALED_PER_BURST: usize = 5;

impl Scenario {
    /// This scenario compressed (or stretched) in time by `f`: every time on its timeline and
    /// every request count are multiplied by `f`, so the arrival rates and the run's shape stay.
    /// What a request costs does not scale (SLA targets, the simulators, Sluice's knobs), so a
    /// scaled run exercises the harness but is no result; its description says so, and with it
    /// every report and plot.
    pub fn time_scaled(mut self, f: f64) -> Result<Scenario, String> {
        if !f.is_finite() || f <= 0.0 {
            return Err(format!("time scale must be positive, got {f}"));
        }
        if f == 1.0 {
            return Ok(self);
        }
        let t = |s: f64| scale_time(s, f);
        self.duration_s = t(self.duration_s);
        for p in self.rate.iter_mut().chain(self.forced_pressure.iter_mut()) {
            p[0] = t(p[0]);
        }
        for e in &mut self.events {
            e.at_s = t(e.at_s);
        }
        for b in &mut self.bursts {
            b.at_s = t(b.at_s);
            b.duration_s = t(b.duration_s);
            b.requests = scale_count(b.requests, f, MIN_SCALED_PER_BURST);
        }
        self.recovery_marker_s = self.recovery_marker_s.map(t);
        let tenants = self.tenants.iter().filter(|m| m.weight > 0.0).count();
        self.requests = scale_count(self.requests, f, MIN_SCALED_PER_TENANT * tenants);
        self.description = format!(
            "{} [time-scaled ×{f}: a smoke run, not a result]",
            self.description
        );
        self.validate()?;
        Ok(self)
    }
}

/// Rounded to the millisecond, the resolution of arrival times (and so `60 × 0.05` reads `3`).
fn scale_time(s: f64, f: f64) -> f64 {
    (s * f * 1000.0).round() / 1000.0
}

/// `n × f` rounded, but not below `floor`, unless `n` itself was below it.
fn scale_count(n: usize, f: f64, floor: usize) -> usize {
    ((n as f64 * f).round() as usize).max(floor.min(n))
}

/// Piecewise-linear interpolation over `[x, y]` points sorted by x; flat outside them.
pub fn interpolate(points: &[[f64; 2]], x: f64) -> f64 {
    match points {
        [] => 0.0,
        [p] => p[1],
        _ => {
            if x <= points[0][0] {
                return points[0][1];
            }
            for w in points.windows(2) {
                let ([x0, y0], [x1, y1]) = (w[0], w[1]);
                if x <= x1 {
                    if x1 <= x0 {
                        return y1;
                    }
                    return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
                }
            }
            points[points.len() - 1][1]
        }
    }
}

/// Maps a uniform draw in [0, 1) to a time in ms whose density follows the rate profile.
struct InverseIntensity {
    /// Cumulative intensity at each grid step, normalised to end at 1.
    cumulative: Vec<f64>,
    step_ms: f64,
}

impl InverseIntensity {
    fn new(rate: &[[f64; 2]], horizon_ms: f64) -> Self {
        let steps = 4000usize;
        let step_ms = horizon_ms / steps as f64;
        let weight = |t_ms: f64| {
            if rate.is_empty() {
                1.0
            } else {
                interpolate(rate, t_ms / 1000.0).max(0.0)
            }
        };
        let mut cumulative = Vec::with_capacity(steps + 1);
        let mut acc = 0.0;
        cumulative.push(0.0);
        for i in 0..steps {
            // Midpoint rule: exact for piecewise-linear profiles aligned to the grid.
            acc += weight((i as f64 + 0.5) * step_ms) * step_ms;
            cumulative.push(acc);
        }
        if acc <= 0.0 {
            // An all-zero profile means "no shape": fall back to uniform.
            cumulative = (0..=steps).map(|i| i as f64).collect();
            acc = steps as f64;
        }
        for c in &mut cumulative {
            *c /= acc;
        }
        Self {
            cumulative,
            step_ms,
        }
    }

    fn at(&self, u: f64) -> f64 {
        let i = self.cumulative.partition_point(|&c| c <= u).max(1) - 1;
        let i = i.min(self.cumulative.len() - 2);
        let (c0, c1) = (self.cumulative[i], self.cumulative[i + 1]);
        let frac = if c1 > c0 { (u - c0) / (c1 - c0) } else { 0.0 };
        (i as f64 + frac.clamp(0.0, 1.0)) * self.step_ms
    }
}

/// SplitMix64: tiny, fast, and good enough for workload generation; no dependency, and its
/// output is fixed forever for a seed, which is the point.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in the inclusive range.
    pub fn range(&mut self, [lo, hi]: [u64; 2]) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// An index drawn with the given weights.
    pub fn pick(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.unit() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Scenario {
        Scenario::built_in("tiny").unwrap()
    }

    #[test]
    fn built_ins_parse() {
        for (name, _) in BUILT_IN {
            let s = Scenario::built_in(name).unwrap();
            assert_eq!(s.name, name);
            assert!(!s.arrivals().is_empty());
        }
    }

    #[test]
    fn extends_merges_over_the_base() {
        let forced = Scenario::built_in("seed-forced").unwrap();
        let seed = Scenario::built_in("seed").unwrap();
        assert!(!forced.forced_pressure.is_empty() && seed.forced_pressure.is_empty());
        assert_eq!(
            forced.arrivals(),
            seed.arrivals(),
            "same workload, only the pressure differs"
        );
        let err = Scenario::from_yaml("extends: nope\nname: x").unwrap_err();
        assert!(err.contains("unknown scenario"), "{err}");
    }

    #[test]
    fn same_seed_same_arrivals_other_seed_differs() {
        let s = tiny();
        let a = s.arrivals();
        assert_eq!(a, s.arrivals());
        let mut other = s.clone();
        other.seed += 1;
        assert_ne!(a, other.arrivals());
    }

    #[test]
    fn arrivals_respect_count_window_ranges_and_order() {
        let s = Scenario::built_in("bursty").unwrap();
        let a = s.arrivals();
        let bursts: usize = s.bursts.iter().map(|b| b.requests).sum();
        assert_eq!(a.len(), s.requests + bursts);
        assert!(a.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert!(a.iter().enumerate().all(|(i, r)| r.id == i));
        let horizon = (s.duration_s * 1000.0) as u64;
        for r in &a {
            assert!(r.at_ms <= horizon);
            let mix = s.tenants.iter().find(|t| t.name == r.tenant).unwrap();
            assert!((mix.max_tokens[0]..=mix.max_tokens[1]).contains(&r.max_tokens));
            assert!((mix.prompt_tokens[0]..=mix.prompt_tokens[1]).contains(&r.prompt_tokens));
            assert_eq!(Some(r.tier), Tier::parse(&mix.tier));
        }
    }

    #[test]
    fn rate_profile_shapes_arrival_density() {
        let mut s = tiny();
        s.requests = 4000;
        s.bursts.clear();
        s.duration_s = 10.0;
        // Weight 1 for the first half, 3 for the second: three quarters arrive late.
        s.rate = vec![[0.0, 1.0], [5.0, 1.0], [5.0, 3.0], [10.0, 3.0]];
        let late = s.arrivals().iter().filter(|a| a.at_ms >= 5000).count();
        let share = late as f64 / 4000.0;
        assert!((share - 0.75).abs() < 0.03, "{share}");
    }

    #[test]
    fn tenant_weights_and_stream_share_are_honoured() {
        let mut s = tiny();
        s.requests = 5000;
        s.bursts.clear();
        let a = s.arrivals();
        let total_w: f64 = s.tenants.iter().map(|t| t.weight).sum();
        for t in &s.tenants {
            let n = a.iter().filter(|r| r.tenant == t.name).count() as f64;
            let expect = t.weight / total_w;
            assert!((n / 5000.0 - expect).abs() < 0.03, "{}", t.name);
            let streamed = a.iter().filter(|r| r.tenant == t.name && r.stream).count() as f64;
            assert!(
                (streamed / n.max(1.0) - t.stream_share).abs() < 0.05,
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn time_scaling_compresses_the_timeline_and_keeps_rates() {
        let seed = Scenario::built_in("seed-forced").unwrap();
        let s = seed.clone().time_scaled(0.05).unwrap();
        assert_eq!(s.duration_s, 3.0);
        assert_eq!(s.requests, 30);
        assert_eq!(s.recovery_marker_s, Some(2.0));
        assert_eq!(s.rate[2], [1.4, 3.4]);
        assert_eq!(s.forced_pressure[3], [1.5, 98.0]);
        assert_eq!(
            s.requests as f64 / s.duration_s,
            seed.requests as f64 / seed.duration_s
        );
        assert!(
            s.description.contains("time-scaled ×0.05"),
            "{}",
            s.description
        );
        assert_eq!(s.sla_ms.guaranteed, seed.sla_ms.guaranteed);
        assert_eq!(s.sluice, seed.sluice, "Sluice's knobs are not scaled");
        let spot = Scenario::built_in("spot-failure")
            .unwrap()
            .time_scaled(0.05)
            .unwrap();
        assert_eq!((spot.events[0].at_s, spot.events[1].at_s), (1.0, 2.0));
        let bursty = Scenario::built_in("bursty")
            .unwrap()
            .time_scaled(0.05)
            .unwrap();
        let b = &bursty.bursts[1];
        assert_eq!((b.at_s, b.duration_s, b.requests), (1.1, 0.4, 7));
        // 15 base arrivals would leave some of the seven tenants without any: the floor holds.
        assert_eq!(bursty.requests, 35);
        assert_eq!(bursty.bursts[2].requests, 5);
        let same = seed.clone().time_scaled(1.0).unwrap();
        assert_eq!(same.arrivals(), seed.arrivals());
        assert_eq!(same.description, seed.description);
        assert!(seed.clone().time_scaled(0.0).is_err());
        assert!(seed.time_scaled(f64::NAN).is_err());
    }

    #[test]
    fn every_built_in_at_smoke_scale_still_has_every_tier() {
        for (name, _) in BUILT_IN {
            let s = Scenario::built_in(name).unwrap().time_scaled(0.05).unwrap();
            let a = s.arrivals();
            for t in Tier::ALL {
                assert!(a.iter().any(|r| r.tier == t), "{name}: no {}", t.as_str());
            }
        }
    }

    #[test]
    fn slo_targets_are_multiples_of_the_unloaded_ttft_and_tpot() {
        let s = Scenario::built_in("seed").unwrap();
        let unloaded = s.unloaded_slo_ms();
        let x = s.clone().with_slo_x(1.6).unwrap();
        assert!(x.name.ends_with("+slo1.6") && x.variant.slo_x == Some(1.6));
        for t in Tier::ALL {
            let (ttft, tpot) = unloaded[t.index()];
            let o = x.objective(t);
            // Rounded up to the whole millisecond a config can say.
            let (a, b) = (o.ttft_ms.unwrap() as f64, o.tpot_ms.unwrap() as f64);
            assert!(a >= 1.6 * ttft && a < 1.6 * ttft + 1.0, "{t:?} {a} {ttft}");
            assert!(b >= 1.6 * tpot && b < 1.6 * tpot + 1.0, "{t:?} {b} {tpot}");
            assert_eq!(o.e2e_ms, None);
            assert_eq!(s.objective(t), Slo::e2e(s.sla_ms.get(t)));
        }
        // A lone request on seed's backends: 20 ms + 50 µs a prompt token, 1 ms a token, both
        // slowed by its own share of the cache.
        let (ttft, tpot) = unloaded[0];
        assert!(
            (30.0..60.0).contains(&ttft) && (1.0..1.3).contains(&tpot),
            "{ttft} {tpot}"
        );
        // End-to-end targets take the objective back.
        let back = x.with_sla_x(2.0).unwrap();
        assert!(back.slo_ms.is_none() && back.objective(Tier::Guaranteed).e2e_ms.is_some());
    }

    #[test]
    fn gpu_timings_slow_the_engines_and_keep_the_load() {
        let s = Scenario::built_in("seed").unwrap();
        let g = s.clone().on_gpu(20.0, GpuLoad::Stretch).unwrap();
        let (a, b) = (&s.backends.on_demand, &g.backends.on_demand);
        assert_eq!(
            (b.itl_ms, b.ttft_ms, b.prefill_us_per_token),
            (20.0, 400, 1000)
        );
        assert_eq!((b.kv_tokens, b.max_running), (a.kv_tokens, a.max_running));
        // The same requests on a timeline twenty times as long.
        assert_eq!(g.duration_s, 1200.0);
        assert_eq!(g.recovery_marker_s, Some(800.0));
        let (sa, ga) = (s.arrivals(), g.arrivals());
        assert_eq!(sa.len(), ga.len());
        for (x, y) in sa.iter().zip(&ga) {
            assert_eq!(
                (x.tenant.as_str(), x.max_tokens),
                (y.tenant.as_str(), y.max_tokens)
            );
            assert!(
                y.at_ms.abs_diff(x.at_ms * 20) <= 300,
                "{} {}",
                x.at_ms,
                y.at_ms
            );
        }
        // Unloaded values scale with the engine, so targets at a multiple of them do too.
        let (u, v) = (s.unloaded_slo_ms()[0], g.unloaded_slo_ms()[0]);
        assert!((v.0 / u.0 - 20.0).abs() < 0.5 && (v.1 / u.1 - 20.0).abs() < 0.01);
        // Fewer arrivals over the same window instead.
        let r = s.clone().on_gpu(20.0, GpuLoad::Rate).unwrap();
        assert_eq!((r.duration_s, r.requests), (60.0, 30));
        // The reserve engine already steps 10 ms: twice as slow.
        let rr = s
            .on_engine(EngineModel::Reserve)
            .on_gpu(20.0, GpuLoad::Stretch)
            .unwrap();
        assert_eq!((rr.backends.on_demand.itl_ms, rr.duration_s), (20.0, 120.0));
        assert!(rr.name.ends_with("+reserve+gpu20"));
    }

    #[test]
    fn interpolation_is_flat_outside_and_linear_inside() {
        let p = [[0.0, 20.0], [10.0, 20.0], [20.0, 80.0]];
        assert_eq!(interpolate(&p, -5.0), 20.0);
        assert_eq!(interpolate(&p, 15.0), 50.0);
        assert_eq!(interpolate(&p, 99.0), 80.0);
        // A vertical step takes the later value at the step.
        assert_eq!(interpolate(&[[0.0, 1.0], [5.0, 1.0], [5.0, 3.0]], 5.0), 1.0);
    }

    #[test]
    fn rng_is_stable() {
        // Pinned so a change to the generator (and so to every published figure) is noticed.
        let mut r = Rng::new(42);
        assert_eq!(r.next_u64(), 0xBDD7_3226_2FEB_6E95);
        let mut r = Rng::new(7);
        for _ in 0..1000 {
            let v = r.range([3, 5]);
            assert!((3..=5).contains(&v));
        }
    }
}
