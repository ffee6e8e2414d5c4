//! Runs scenarios in each mode and engine, and writes what they produced: a JSON summary and an
//! SVG per scenario under the output directory, and this harness's sections of
//! `bench/RESULTS.md` (between `<!-- sluice-bench:NAME begin/end -->` markers, so the rest of the
//! file, such as the older overhead section, is left as it is).

use serde_json::json;
use sluice_policy::slo::Dim;
use sluice_policy::Tier;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::live::{self, LiveInput};
use crate::model::{self, ModelInput};
use crate::procs::{self, WorkDir};
use crate::record::{Mode, Run};
use crate::report::{self, RunSummary};
use crate::scenario::{Arrival, Scenario};
use crate::sluice_conf::{self, Addrs, SlaSignal};
use crate::{svg, Common, ScenarioArgs};

pub async fn run_scenarios(
    common: &Common,
    scen: &ScenarioArgs,
    modes: &[Mode],
) -> Result<(), String> {
    let engines: Vec<&str> = match scen.engine.as_str() {
        "live" => vec!["live"],
        "model" => vec!["model"],
        "both" => vec!["model", "live"],
        other => return Err(format!("unknown engine {other:?} (live, model, both)")),
    };
    let bin = if engines.contains(&"live") {
        Some(procs::sluice_bin(common.sluice_bin.as_deref())?)
    } else {
        None
    };
    std::fs::create_dir_all(&common.out).map_err(|e| format!("{}: {e}", common.out.display()))?;
    let overrides = parse_overrides(scen)?;
    if let Some(path) = &common.results_md {
        let head = format!("## Tier protection, live\n\n{READING}");
        update_section(path, "tier-protection", &head)?;
    }
    for s in expand(scen, overrides.as_ref())? {
        let env = Environment::capture();
        let arrivals = s.arrivals();
        let mut runs: Vec<Run> = Vec::new();
        for engine in &engines {
            for &mode in modes {
                if !s.runs_in(mode.as_str()) {
                    continue;
                }
                let arr: Vec<Arrival> = if mode == Mode::Baseline {
                    s.only_tier(Tier::Guaranteed)
                } else {
                    arrivals.clone()
                };
                let run = match (*engine, &bin) {
                    ("live", Some(bin)) => {
                        let mut wd = WorkDir::new(&format!("{}-{}", s.name, mode.as_str()))?;
                        eprintln!(
                            "sluice-bench: {} / {} / live: {} requests over {} s …",
                            s.name,
                            mode.as_str(),
                            arr.len(),
                            s.duration_s
                        );
                        let r = live::run(LiveInput {
                            scenario: &s,
                            mode,
                            arrivals: &arr,
                            bin,
                            dir: &wd.path,
                            sla: scen.sla_signal,
                        })
                        .await;
                        if r.is_err() {
                            wd.keep = true;
                        }
                        r?
                    }
                    _ => run_model(&s, mode, &arr, scen.sla_signal)?,
                };
                let sum = report::summarize(&run);
                eprintln!("sluice-bench: {}", one_line(&sum));
                if let Some(dir) = &scen.dump_runs {
                    dump_run(dir, &run, engine)?;
                }
                runs.push(run);
            }
        }
        let summaries: Vec<RunSummary> = runs.iter().map(report::summarize).collect();
        let knobs = phase2_knobs(&s)?;
        let json_path = common.out.join(format!("{}.json", s.name));
        let doc = json!({"scenario": s, "environment": env.line(), "sluice_phase2_knobs": knobs, "runs": summaries});
        write(
            &json_path,
            &serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?,
        )?;
        let plotted: Vec<&Run> = {
            let live: Vec<&Run> = runs.iter().filter(|r| r.engine == "live").collect();
            if live.is_empty() {
                runs.iter().collect()
            } else {
                live
            }
        };
        let svg_path = common.out.join(format!("{}.svg", s.name));
        write(
            &svg_path,
            &svg::scenario_plot(&format!("{} — {}", s.name, s.description), &plotted),
        )?;
        let mut md = String::new();
        let _ = writeln!(md, "### {} — {}\n", s.name, s.description);
        let _ = writeln!(md, "Command: `{}`  \n{}\n", command_line(), env.line());
        let targets = if s.slo_ms.is_some() {
            let mut t = idle_targets(&s.name, &summaries);
            t.extend(slo_targets(&s, |m, t| figures_of(&summaries, m, t)));
            t
        } else {
            evaluate_targets(&s.name, &summaries)
        };
        if !targets.is_empty() {
            md.push_str("| target | measured | met |\n|---|---|---|\n");
            for t in &targets {
                let met = if t.2 { "yes" } else { "**no**" };
                let _ = writeln!(md, "| {} | {} | {met} |", t.0, t.1);
            }
            md.push('\n');
        }
        md.push_str(&scenario_section(
            &s,
            &summaries,
            &knobs,
            &link(common, &svg_path),
        ));
        if engines.contains(&"model") {
            let what = if s.slo_ms.is_some() {
                "attainment per dimension, % of all requests, mean [min–max]"
            } else {
                "violation % over all requests, mean [min–max]"
            };
            let fence = if s.slo_ms.is_some() { "" } else { "```" };
            let _ = writeln!(
                md,
                "Seed sensitivity (model, seeds {}–{}; {what}):\n\n{fence}\n{}{fence}\n",
                s.seed,
                s.seed + SPREAD_SEEDS - 1,
                seed_spread(&s, modes, SPREAD_SEEDS, scen.sla_signal, None)?
            );
        }
        let _ = writeln!(md, "Load after this scenario's runs: {}", uptime());
        println!("{}", table_of(&summaries));
        if let Some(path) = &common.results_md {
            update_section(path, &format!("scenario-{}", s.name), &md)?;
            eprintln!("sluice-bench: wrote {}", path.display());
        }
    }
    Ok(())
}

fn parse_overrides(scen: &ScenarioArgs) -> Result<Option<serde_json::Value>, String> {
    scen.sluice_override
        .as_deref()
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| format!("--sluice-override: {e}"))
}

fn load_with_overrides(
    name: &str,
    overrides: Option<&serde_json::Value>,
    time_scale: f64,
) -> Result<Scenario, String> {
    let mut s = Scenario::load(name)?.time_scaled(time_scale)?;
    if let Some(o) = overrides {
        if s.sluice.is_null() {
            s.sluice = serde_json::json!({});
        }
        sluice_conf::merge(&mut s.sluice, o);
        s.explore = o.clone();
    }
    Ok(s)
}

/// Every scenario asked for, on every engine model, timing and target scaling asked for.
fn expand(
    scen: &ScenarioArgs,
    overrides: Option<&serde_json::Value>,
) -> Result<Vec<Scenario>, String> {
    let mut out = Vec::new();
    for name in &scen.scenarios {
        for &engine in &scen.engine_model {
            let mut s = load_with_overrides(name, overrides, scen.time_scale)?.on_engine(engine);
            if let Some(itl) = scen.gpu_itl_ms {
                s = s.on_gpu(itl, scen.gpu_load)?;
            }
            for &x in &scen.sla_x {
                out.push(s.clone().with_sla_x(x)?);
            }
            for &x in &scen.slo_x {
                out.push(s.clone().with_slo_x(x)?);
            }
            if scen.sla_x.is_empty() && scen.slo_x.is_empty() {
                out.push(s);
            }
        }
    }
    Ok(out)
}

pub fn calibrate(scen: &ScenarioArgs, modes: &[Mode], seeds: u64) -> Result<(), String> {
    let overrides = parse_overrides(scen)?;
    let mut summary: Vec<String> = Vec::new();
    for base in expand(scen, overrides.as_ref())? {
        if base.slo_ms.is_some() {
            println!(
                "#### {}\n\n{} seeds from {}; {}.\n",
                base.name, seeds, base.seed, base.description
            );
            let dump = scen.dump_runs.as_deref();
            let spread = spread_of(&base, modes, seeds, scen.sla_signal, dump)?;
            print!("{}", slo_spread_table(&spread));
            let targets = slo_targets(&base, |m, t| {
                spread
                    .iter()
                    .find(|x| x.mode == m)
                    .and_then(|x| x.of(t))
                    .map(TierSpread::means)
            });
            for (what, measured, met) in &targets {
                println!(
                    "- {what}: {measured} — {}",
                    if *met { "holds" } else { "**misses**" }
                );
            }
            if let Some(i) = spread.iter().find_map(|m| m.idle) {
                println!(
                    "- idle means open: {} of {} requests decided on an idle pool refused or capped, \
                     level back at 0 within {:.1} s ({} late)",
                    i.refused_or_capped,
                    i.decided,
                    i.release_max_ms / 1000.0,
                    i.release_late
                );
            }
            println!();
            summary.push(summary_row(&base, &spread, &targets));
            continue;
        }
        println!(
            "{}: {seeds} seeds from {}; viol % all per tier: mean [min–max]; SLA {} / {} / {} ms",
            base.name,
            base.seed,
            base.sla_ms.guaranteed,
            base.sla_ms.standard,
            base.sla_ms.best_effort
        );
        print!(
            "{}",
            seed_spread(
                &base,
                modes,
                seeds,
                scen.sla_signal,
                scen.dump_runs.as_deref()
            )?
        );
    }
    if !summary.is_empty() {
        println!("#### Summary: means over {seeds} seeds\n");
        println!(
            "SLO met % of all requests (TTFT and TPOT both); Guaranteed as adaptive (TTFT / TPOT) vs \
             direct vs its arrivals alone; the lower tiers adaptive vs direct; SLO goodput \
             adaptive ÷ direct; vLLM's priority policy with no proxy (mode `priority`, where it \
             ran): Guaranteed / Standard / Best-Effort and its goodput ÷ direct; the targets \
             missed (✓: none).\n"
        );
        println!("| scenario | engine | timing | × | Guaranteed adaptive (TTFT / TPOT) | direct | alone | Standard adaptive / direct | Best-Effort adaptive / direct | SLO goodput ÷ direct | vLLM priority, no proxy | idle: refused or capped | targets |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for row in summary {
            println!("{row}");
        }
        println!();
    }
    Ok(())
}

/// One line of the calibration summary: a scenario variant's means and its targets.
fn summary_row(s: &Scenario, spread: &[ModeSpread], targets: &[(String, String, bool)]) -> String {
    let get = |m: Mode, t: Option<Tier>| {
        spread
            .iter()
            .find(|x| x.mode == m)
            .and_then(|x| x.of(t))
            .map(TierSpread::means)
    };
    let met = |m: Mode, t: Tier| get(m, Some(t)).map_or("–".into(), |f| format!("{:.1}", f.met));
    let g = get(Mode::Adaptive, Some(Tier::Guaranteed)).map_or("–".into(), |f| {
        let d = |i: Dim| f.dim[i.index()].map_or("–".into(), |v| format!("{v:.1}"));
        format!("**{:.1}** ({} / {})", f.met, d(Dim::Ttft), d(Dim::Tpot))
    });
    let ratio_of = |m: Mode| match (get(m, None), get(Mode::Direct, None)) {
        (Some(a), Some(d)) => format!("{:.2}×", a.goodput / d.goodput.max(1e-9)),
        _ => "–".into(),
    };
    let ratio = ratio_of(Mode::Adaptive);
    let priority = match get(Mode::Priority, None) {
        Some(_) => format!(
            "{} / {} / {}; {}",
            met(Mode::Priority, Tier::Guaranteed),
            met(Mode::Priority, Tier::Standard),
            met(Mode::Priority, Tier::BestEffort),
            ratio_of(Mode::Priority)
        ),
        None => "–".into(),
    };
    let missed: Vec<String> = targets
        .iter()
        .filter(|t| !t.2)
        .map(|t| {
            let what = &t.0;
            if what.contains("Guaranteed meets") {
                "G ≥ 99 % / alone − 1".to_string()
            } else if what.contains("misses TPOT") {
                "G TPOT misses ≤ 5 %".to_string()
            } else if what.contains("below direct") {
                let worse: Vec<&str> =
                    t.1.split("; ")
                        .filter(|x| {
                            let v: Vec<f64> = x
                                .split_whitespace()
                                .filter_map(|w| w.parse().ok())
                                .collect();
                            v.len() == 2 && v[0] < v[1] - 2.0
                        })
                        .collect();
                format!("worse than direct: {}", worse.join(", "))
            } else if what.contains("goodput") {
                "goodput < 1.10×".to_string()
            } else {
                what.clone()
            }
        })
        .collect();
    let base = s.name.split('+').next().unwrap_or(&s.name);
    let idle = spread.iter().find_map(|m| m.idle).map_or("–".into(), |i| {
        format!("{} of {}", i.refused_or_capped, i.decided)
    });
    format!(
        "| {base} | {} | {} | {} | {g} | {} | {} | {} / {} | {} / {} | {ratio} | {priority} | {idle} | {} |",
        if s.variant.reserve {
            "reserve"
        } else {
            "slowdown"
        },
        s.variant
            .gpu_itl_ms
            .map_or("own".into(), |v| format!("{v} ms")),
        s.variant.slo_x.unwrap_or(0.0),
        met(Mode::Direct, Tier::Guaranteed),
        met(Mode::Baseline, Tier::Guaranteed),
        met(Mode::Adaptive, Tier::Standard),
        met(Mode::Direct, Tier::Standard),
        met(Mode::Adaptive, Tier::BestEffort),
        met(Mode::Direct, Tier::BestEffort),
        if missed.is_empty() {
            "✓".to_string()
        } else {
            format!("✗ {}", missed.join("; "))
        }
    )
}

/// One tier's (or all tiers') figures over seeds.
#[derive(Default)]
struct TierSpread {
    /// Violations over all requests, %.
    viol: Vec<f64>,
    /// Attainment on each dimension the objective sets, % of all requests.
    dim: [Vec<f64>; 3],
    /// Refused (429), % of all requests.
    refused: Vec<f64>,
    /// Served streams within the TPOT target, % of them.
    pace: Vec<f64>,
    goodput: Vec<f64>,
}

/// Means of a [`TierSpread`] (dimension means `None` where not set).
#[derive(Clone, Copy)]
pub struct Figures {
    pub met: f64,
    pub dim: [Option<f64>; 3],
    /// Served streams within the TPOT target, %.
    pub pace: Option<f64>,
    pub goodput: f64,
}

impl TierSpread {
    fn push(&mut self, t: &report::TierSummary) {
        self.viol.push(t.viol_all_pct.unwrap_or(0.0));
        for (v, a) in self.dim.iter_mut().zip(t.attain_dim_pct) {
            if let Some(a) = a {
                v.push(a);
            }
        }
        let pct = 100.0 * t.rejected as f64 / t.requests.max(1) as f64;
        self.refused.push(pct);
        if let Some(p) = t.stream_tpot_met_pct {
            self.pace.push(p);
        }
        self.goodput.push(t.goodput_rps);
    }

    fn means(&self) -> Figures {
        Figures {
            met: 100.0 - mean(&self.viol),
            dim: self
                .dim
                .each_ref()
                .map(|v| (!v.is_empty()).then(|| mean(v))),
            pace: (!self.pace.is_empty()).then(|| mean(&self.pace)),
            goodput: mean(&self.goodput),
        }
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// `mean [min–max]` of a series.
fn spread_text(v: &[f64], digits: usize) -> String {
    if v.is_empty() {
        return "–".into();
    }
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
    format!("{:.digits$} [{lo:.digits$}–{hi:.digits$}]", mean(v))
}

/// A mode's figures over seeds.
struct ModeSpread {
    mode: Mode,
    tiers: [TierSpread; 3],
    all: TierSpread,
    idle: Option<report::IdleOpen>,
}

impl ModeSpread {
    /// A tier's figures, or all tiers' (`None`); `None` when the tier had no requests.
    fn of(&self, t: Option<Tier>) -> Option<&TierSpread> {
        let s = t.map_or(&self.all, |t| &self.tiers[t.index()]);
        (!s.viol.is_empty()).then_some(s)
    }
}

/// The model over `seeds` consecutive seeds, every mode `base` runs in.
fn spread_of(
    base: &Scenario,
    modes: &[Mode],
    seeds: u64,
    sla: SlaSignal,
    dump: Option<&Path>,
) -> Result<Vec<ModeSpread>, String> {
    let mut out = Vec::new();
    for &mode in modes {
        if !base.runs_in(mode.as_str()) {
            continue;
        }
        let mut m = ModeSpread {
            mode,
            tiers: Default::default(),
            all: TierSpread::default(),
            idle: None,
        };
        for k in 0..seeds {
            let mut s = base.clone();
            s.seed = base.seed + k;
            let arr = if mode == Mode::Baseline {
                s.only_tier(Tier::Guaranteed)
            } else {
                s.arrivals()
            };
            let run = run_model(&s, mode, &arr, sla)?;
            if let Some(dir) = dump {
                dump_run(dir, &run, &format!("seed{}", s.seed))?;
            }
            let sum = report::summarize(&run);
            for t in &sum.tiers {
                if let Some(tier) = Tier::parse(&t.tier) {
                    m.tiers[tier.index()].push(t);
                }
            }
            m.all.push(&sum.all);
            if let Some(i) = sum.idle {
                let acc = m.idle.get_or_insert_with(Default::default);
                acc.decided += i.decided;
                acc.refused_or_capped += i.refused_or_capped;
                acc.release_max_ms = acc.release_max_ms.max(i.release_max_ms);
                acc.release_late += i.release_late;
            }
        }
        out.push(m);
    }
    Ok(out)
}

/// The model over `seeds` consecutive seeds: how far one seed's figures can be trusted.
fn seed_spread(
    base: &Scenario,
    modes: &[Mode],
    seeds: u64,
    sla: SlaSignal,
    dump: Option<&Path>,
) -> Result<String, String> {
    let spread = spread_of(base, modes, seeds, sla, dump)?;
    if base.slo_ms.is_some() {
        return Ok(slo_spread_table(&spread));
    }
    let mut out = String::new();
    for m in &spread {
        let mut line = format!("  {:<8}", m.mode.as_str());
        for t in Tier::ALL {
            let v = &m.tiers[t.index()].viol;
            if v.is_empty() {
                continue;
            }
            let (lo, hi) = v
                .iter()
                .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
            let _ = write!(line, "  {} {:5.1} [{lo:.1}–{hi:.1}]", t.as_str(), mean(v));
        }
        let _ = write!(
            line,
            "  goodput: Guaranteed {:.2}, all {:.2} req/s",
            mean(&m.tiers[Tier::Guaranteed.index()].goodput),
            mean(&m.all.goodput)
        );
        if let Some(i) = m.idle {
            let _ = write!(
                line,
                "  idle: {}/{} refused or capped, release ≤ {:.1} s ({} late)",
                i.refused_or_capped,
                i.decided,
                i.release_max_ms / 1000.0,
                i.release_late
            );
        }
        line.push('\n');
        out.push_str(&line);
    }
    Ok(out)
}

/// Per-dimension attainment over seeds, as a markdown table: a row per (mode, tier), each cell
/// `mean [min–max]` over the seeds.
fn slo_spread_table(spread: &[ModeSpread]) -> String {
    let dims: Vec<Dim> = Dim::ALL
        .into_iter()
        .filter(|d| {
            spread
                .iter()
                .any(|m| m.tiers.iter().any(|t| !t.dim[d.index()].is_empty()))
        })
        .collect();
    let mut out = String::from("| mode | tier |");
    for d in &dims {
        let _ = write!(out, " {} met % |", d.as_str().to_uppercase());
    }
    out.push_str(" **SLO met %** | streams' pace within TPOT % | refused % | **SLO goodput req/s** |\n|---|---|");
    for _ in &dims {
        out.push_str("---|");
    }
    out.push_str("---|---|---|---|\n");
    for m in spread {
        let rows = Tier::ALL
            .iter()
            .map(|t| (t.as_str(), Some(*t)))
            .chain(std::iter::once(("all", None)));
        for (label, t) in rows {
            let Some(x) = m.of(t) else { continue };
            let _ = write!(out, "| {} | {label} |", m.mode.as_str());
            for d in &dims {
                let _ = write!(out, " {} |", spread_text(&x.dim[d.index()], 1));
            }
            let met: Vec<f64> = x.viol.iter().map(|v| 100.0 - v).collect();
            let _ = writeln!(
                out,
                " **{}** | {} | {} | **{}** |",
                spread_text(&met, 1),
                spread_text(&x.pace, 1),
                spread_text(&x.refused, 1),
                spread_text(&x.goodput, 2)
            );
        }
    }
    out
}

/// The issue's targets for objectives in TTFT / TPOT terms, on the shipped (adaptive) config
/// against `direct` and Guaranteed's arrivals alone (`baseline`), from `get(mode, tier)` (all
/// tiers for `None`): one run's figures, or means over seeds.
pub fn slo_targets(
    s: &Scenario,
    get: impl Fn(Mode, Option<Tier>) -> Option<Figures>,
) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    let Some(x) = s.variant.slo_x else {
        return out;
    };
    let base = s.name.split('+').next().unwrap_or(&s.name);
    let (Some(a), Some(d)) = (
        get(Mode::Adaptive, Some(Tier::Guaranteed)),
        get(Mode::Direct, Some(Tier::Guaranteed)),
    ) else {
        return out;
    };
    let ttft = Dim::Ttft.index();
    let tpot = Dim::Tpot.index();
    let f = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.1}"));
    if x >= 1.6 - 1e-9 {
        let alone = get(Mode::Baseline, Some(Tier::Guaranteed));
        let floor = alone.map_or(99.0, |b| 99.0f64.min(b.met - 1.0));
        out.push((
            format!("{x}×: Guaranteed meets TTFT and TPOT on ≥ 99 % (or within 1 point of its arrivals alone)"),
            format!(
                "adaptive {:.1} % (TTFT {}, TPOT {}); alone {}; direct {:.1}",
                a.met,
                f(a.dim[ttft]),
                f(a.dim[tpot]),
                alone.map_or("–".into(), |b| format!("{:.1}", b.met)),
                d.met
            ),
            a.met >= floor - 1e-9,
        ));
    }
    if !s.variant.reserve && (x - 1.6).abs() < 1e-9 {
        let miss = 100.0 - a.dim[tpot].unwrap_or(0.0);
        out.push((
            "slowdown engine, 1.6× TPOT: Guaranteed misses TPOT on ≤ 5 %".to_string(),
            format!(
                "adaptive {miss:.1} % (direct {:.1} %); streams' pace over target: adaptive {} %, direct {} %",
                100.0 - d.dim[tpot].unwrap_or(0.0),
                f(a.pace.map(|p| 100.0 - p)),
                f(d.pace.map(|p| 100.0 - p)),
            ),
            miss <= 5.0,
        ));
    }
    if matches!(base, "seed" | "shared-backend" | "overload") {
        let mut worse = Vec::new();
        let mut ok = true;
        for t in Tier::ALL {
            if let (Some(a), Some(d)) = (get(Mode::Adaptive, Some(t)), get(Mode::Direct, Some(t))) {
                ok &= a.met >= d.met - 2.0;
                worse.push(format!("{} {:.1} vs {:.1}", t.as_str(), a.met, d.met));
            }
        }
        out.push((
            format!("{x}×: no tier's SLO attainment below direct's by more than 2 points"),
            worse.join("; "),
            ok,
        ));
    }
    if let (Some(a), Some(d)) = (get(Mode::Adaptive, None), get(Mode::Direct, None)) {
        out.push((
            format!("{x}×: SLO goodput ≥ 1.10× direct's"),
            format!(
                "{:.2} vs {:.2} req/s = {:.2}×",
                a.goodput,
                d.goodput,
                a.goodput / d.goodput.max(1e-9)
            ),
            a.goodput >= 1.10 * d.goodput,
        ));
    }
    out
}

const SPREAD_SEEDS: u64 = 10;

const READING: &str = "\
How to read the tables. Every request is scored against its own tier's SLA target on its \
end-to-end latency as the client saw it. `viol % all` counts a rejection (429), an error or a \
timeout as a violation, over all requests; `viol % served` is over completed requests only. A \
proxy could make `viol % served` perfect by rejecting everything, so targets are judged on \
`viol % all`. `degraded`, `queued` and `fallback` overlap (a queued request can also be \
capped). Goodput counts requests (and their completion tokens) completed within SLA, per \
second of the arrival window. Overhead is Sluice's own `sluice_proxy_overhead_seconds` \
histogram (arrival → upstream chosen, queue wait excluded). A flap is a tier-state or fallback \
change reversed within the stability cooldown (less 300 ms: states are sampled every 200 ms \
over HTTP, and Sluice may legitimately reverse exactly at the cooldown); `reversals within \
10 s` also counts slower oscillation. Recovery is measured from the scenario's marker (the end of the overload) to the \
arrival of the last request that missed its SLA, and to the tiers' return to Normal. The model \
rows replay the same arrivals through the pure policy core in simulated time with a model of \
the simulator; they are a cross-check, the live rows are the result.\n";

/// One run's raw records and samples as JSON (`--dump-runs`), named by scenario, mode and `tag`.
fn dump_run(dir: &Path, run: &Run, tag: &str) -> Result<(), String> {
    let path = dir.join(format!("{}-{}-{tag}.json", run.scenario, run.mode.as_str()));
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    write(
        &path,
        &serde_json::to_string(run).map_err(|e| e.to_string())?,
    )
}

fn run_model(s: &Scenario, mode: Mode, arr: &[Arrival], sla: SlaSignal) -> Result<Run, String> {
    let dir = std::env::temp_dir();
    let cfg = sluice_conf::for_mode(s, mode, &Addrs::placeholder_for(s), &dir, sla);
    let parsed = cfg
        .as_ref()
        .map(|c| sluice_conf::parse(c, &dir))
        .transpose()?;
    let window = cfg
        .as_ref()
        .filter(|_| mode == Mode::Phase2 && sla != SlaSignal::Off)
        .map(sluice_conf::sla_window_ms);
    Ok(model::run(ModelInput {
        scenario: s,
        mode,
        arrivals: arr,
        config: parsed.as_ref(),
        sla_window_ms: window,
    }))
}

/// The scenario table the runs' objectives call for: per dimension (TTFT / TPOT) or end to end.
fn table_of(rows: &[RunSummary]) -> String {
    if rows.iter().any(|r| r.per_dimension) {
        report::slo_table(rows)
    } else {
        report::scenario_table(rows)
    }
}

/// One run's figures of a mode and tier (all tiers for `None`), for [`slo_targets`].
fn figures_of(sums: &[RunSummary], mode: Mode, t: Option<Tier>) -> Option<Figures> {
    let s = find(sums, mode.as_str())?;
    let x = match t {
        Some(t) => tier(s, t)?,
        None => &s.all,
    };
    Some(Figures {
        met: 100.0 - x.viol_all_pct?,
        dim: x.attain_dim_pct,
        pace: x.stream_tpot_met_pct,
        goodput: x.goodput_rps,
    })
}

fn phase2_knobs(s: &Scenario) -> Result<Vec<String>, String> {
    let dir = std::env::temp_dir();
    let cfg = sluice_conf::for_mode(s, Mode::Phase2, &Addrs::placeholder(), &dir, SlaSignal::Off)
        .ok_or("no phase 2 config")?;
    Ok(sluice_conf::knobs(&sluice_conf::parse(&cfg, &dir)?))
}

fn one_line(s: &RunSummary) -> String {
    let mut out = format!("{} / {} / {}:", s.scenario, s.mode, s.engine);
    for t in &s.tiers {
        let _ = write!(
            out,
            " {} {}% (served {}%, {:?})",
            t.tier,
            report::fmt_opt(t.viol_all_pct, 1),
            report::fmt_opt(t.viol_served_pct, 1),
            t.refusals
        );
    }
    out
}

fn scenario_section(s: &Scenario, sums: &[RunSummary], knobs: &[String], svg: &str) -> String {
    let mut md = String::new();
    let bursts: usize = s.bursts.iter().map(|b| b.requests).sum();
    let tenants: Vec<String> = s
        .tenants
        .iter()
        .map(|t| {
            format!(
                "{} ({}, weight {}, prompt {}–{}, max_tokens {}–{}, {:.0}% streamed)",
                t.name,
                t.tier,
                t.weight,
                t.prompt_tokens[0],
                t.prompt_tokens[1],
                t.max_tokens[0],
                t.max_tokens[1],
                t.stream_share * 100.0
            )
        })
        .collect();
    let targets = match s.slo_ms {
        Some(_) => {
            let t: Vec<String> = Tier::ALL
                .iter()
                .map(|t| {
                    format!(
                        "{} {}",
                        t.as_str(),
                        crate::record::slo_label(&s.objective(*t))
                    )
                })
                .collect();
            format!("Objectives (TTFT / TPOT): {}", t.join(", "))
        }
        None => format!(
            "SLA targets: Guaranteed {} ms, Standard {} ms, Best-Effort {} ms",
            s.sla_ms.guaranteed, s.sla_ms.standard, s.sla_ms.best_effort
        ),
    };
    let _ = writeln!(
        md,
        "Workload: {} requests{} over {} s, seed {}; tenants: {}. {targets}.",
        s.requests,
        if bursts > 0 {
            format!(" + {bursts} in bursts")
        } else {
            String::new()
        },
        s.duration_s,
        s.seed,
        tenants.join("; "),
    );
    let b = |p: &crate::scenario::SimParams| {
        format!(
            "KV {} tokens, {} running, TTFT {} ms + {} µs/prompt token, ITL {} ms, ×(1 + {}·KV usage)",
            p.kv_tokens, p.max_running, p.ttft_ms, p.prefill_us_per_token, p.itl_ms, p.load_slowdown
        )
    };
    let _ = writeln!(
        md,
        "Backends (`sluice sim`): on-demand {}; spot (also serves the fallback model) {}.",
        b(&s.backends.on_demand),
        b(&s.backends.spot)
    );
    if !s.forced_pressure.is_empty() {
        let pts: Vec<String> = s
            .forced_pressure
            .iter()
            .map(|p| format!("{}%@{}s", p[1], p[0]))
            .collect();
        let _ = writeln!(
            md,
            "Forced pressure (Sluice runs, `PUT /admin/pressure`): {}.",
            pts.join(" → ")
        );
    } else {
        md.push_str(
            "Pressure: not forced; Sluice reads the simulators' KV usage from their /metrics.\n",
        );
    }
    for e in &s.events {
        let what = match e.kind {
            crate::scenario::EventKind::SpotHealthy(false) => {
                "the spot simulator turns unhealthy (`PUT /admin/health {\"healthy\": false}`)"
            }
            crate::scenario::EventKind::SpotHealthy(true) => {
                "the spot simulator turns healthy again"
            }
        };
        let _ = writeln!(md, "At {} s {what}.", e.at_s);
    }
    let _ = writeln!(md, "\nSluice phase 2 knobs (phase 1: the shipped pressure thresholds and these timings, nothing else):\n");
    for k in knobs {
        let _ = writeln!(md, "- {k}");
    }
    md.push('\n');
    for engine in ["live", "model"] {
        let rows: Vec<RunSummary> = sums
            .iter()
            .filter(|x| x.engine == engine)
            .cloned()
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(
            md,
            "{}\n",
            if engine == "live" {
                "**Live** (real HTTP, real processes):"
            } else {
                "**Model** (same arrivals, in-process policy core, simulated time):"
            }
        );
        md.push_str(&table_of(&rows));
        md.push('\n');
        if s.per_tenant {
            md.push_str("Per tenant:\n\n");
            md.push_str(&report::tenant_table(&rows));
            md.push('\n');
        }
        md.push_str(&report::run_table(&rows));
        let routed: Vec<String> = rows
            .iter()
            .flat_map(|r| {
                r.tiers.iter().filter(|t| t.pools.len() > 1).map(move |t| {
                    let split: Vec<String> =
                        t.pools.iter().map(|(p, n)| format!("{p} {n}")).collect();
                    format!("{} {}: {}", r.mode, t.tier, split.join(", "))
                })
            })
            .collect();
        if !routed.is_empty() {
            let _ = writeln!(
                md,
                "\nCompleted requests by serving pool, where a tier used more than one: {}.",
                routed.join("; ")
            );
        }
        for r in &rows {
            for n in &r.notes {
                let _ = writeln!(md, "\n_{}: {}_", r.mode, n);
            }
        }
        md.push('\n');
    }
    let _ = writeln!(md, "![{} timeline]({svg})\n", s.name);
    md
}

fn find<'a>(sums: &'a [RunSummary], mode: &str) -> Option<&'a RunSummary> {
    sums.iter()
        .filter(|s| s.mode == mode)
        .max_by_key(|s| s.engine == "live")
}

fn tier(s: &RunSummary, t: Tier) -> Option<&report::TierSummary> {
    s.tiers.iter().find(|x| x.tier == t.as_str())
}

/// "Idle means open" for the shipped (adaptive) config.
fn idle_targets(scenario: &str, sums: &[RunSummary]) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    let Some(a) = find(sums, "adaptive") else {
        return out;
    };
    let src = if a.engine == "live" { "live" } else { "model" };
    if let Some(i) = a.idle {
        out.push((
            format!("{scenario}, adaptive: idle means open (refused or capped while vLLM queued nothing and KV < 50 % for 2 s)"),
            format!("{} of {} requests ({src})", i.refused_or_capped, i.decided),
            i.refused_or_capped == 0,
        ));
        out.push((
            format!("{scenario}, adaptive: level back at 0 within 3 s of vLLM's queue emptying"),
            format!(
                "longest {:.1} s, {} late ({src})",
                i.release_max_ms / 1000.0,
                i.release_late
            ),
            i.release_late == 0,
        ));
    }
    out
}

/// Issue 10's targets for the shipped (adaptive) config against `direct` on the same arrivals.
fn adaptive_targets(scenario: &str, sums: &[RunSummary], out: &mut Vec<(String, String, bool)>) {
    let (Some(a), Some(d)) = (find(sums, "adaptive"), find(sums, "direct")) else {
        return;
    };
    // A variant (`seed+reserve+sla1.7`) is judged by its base scenario's targets; issue 10's
    // own two apply to the scenario as it was set then (slowdown engine, its own targets).
    let base = scenario.split('+').next().unwrap_or(scenario);
    let variant = base != scenario;
    let src = if a.engine == "live" { "live" } else { "model" };
    out.extend(idle_targets(scenario, sums));
    let v = |s: &RunSummary, t: Tier| tier(s, t).and_then(|x| x.viol_all_pct).unwrap_or(0.0);
    let g = v(a, Tier::Guaranteed);
    // Guaranteed's arrivals alone can overload the pool (bursty's Guaranteed burst): no
    // admission of the lower tiers removes that floor, so it is shown beside the figure.
    let alone = find(sums, "baseline").map_or(String::new(), |b| {
        format!(", Guaranteed alone {:.1} %", v(b, Tier::Guaranteed))
    });
    out.push((
        format!("{scenario}, adaptive: Guaranteed ≤ 1 % violations"),
        format!("{g:.1} % ({src}{alone})"),
        g <= 1.0,
    ));
    let worse: Vec<String> = Tier::ALL
        .iter()
        .map(|&t| format!("{} {:.1} vs {:.1}", t.as_str(), v(a, t), v(d, t)))
        .collect();
    out.push((
        format!("{scenario}, adaptive: no tier worse than direct by more than 2 points"),
        worse.join("; "),
        Tier::ALL.iter().all(|&t| v(a, t) <= v(d, t) + 2.0),
    ));
    let need = if matches!(base, "seed" | "shared-backend") {
        1.10
    } else {
        1.0
    };
    let (ga, gd) = (a.all.goodput_rps, d.all.goodput_rps);
    out.push((
        format!("{scenario}, adaptive: total goodput ≥ {need:.2}× direct's"),
        format!("{ga:.2} vs {gd:.2} req/s = {:.2}×", ga / gd.max(1e-9)),
        ga >= need * gd,
    ));
    if matches!(scenario, "seed" | "shared-backend") && !variant {
        let (st, be, be_d) = (
            v(a, Tier::Standard),
            v(a, Tier::BestEffort),
            v(d, Tier::BestEffort),
        );
        out.push((
            format!("{scenario}, adaptive: Standard ≤ 15 %"),
            format!("{st:.1} %"),
            st <= 15.0,
        ));
        out.push((
            format!("{scenario}, adaptive: Best-Effort ≤ direct's"),
            format!("{be:.1} % vs {be_d:.1} %"),
            be <= be_d,
        ));
    }
    if base == "overload" {
        let good = |m: &str| {
            find(sums, m)
                .and_then(|s| tier(s, Tier::Guaranteed))
                .map(|x| x.goodput_rps)
        };
        if let (Some(base), Some(ad)) = (good("baseline"), good("adaptive")) {
            out.push((
                format!("{scenario}, adaptive: Guaranteed goodput ≥ 97 % of Guaranteed alone"),
                format!(
                    "{ad:.2} vs {base:.2} req/s = {:.0} %",
                    100.0 * ad / base.max(1e-9)
                ),
                ad >= 0.97 * base,
            ));
        }
    }
}

/// The issue's targets, judged on what this run measured.
pub fn evaluate_targets(scenario: &str, sums: &[RunSummary]) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    let viol = |m: &str, t: Tier| {
        find(sums, m)
            .and_then(|s| tier(s, t))
            .and_then(|x| x.viol_all_pct)
    };
    let engine =
        |m: &str| find(sums, m).map_or("", |s| if s.engine == "live" { "live" } else { "model" });
    adaptive_targets(scenario, sums, &mut out);
    if scenario == "seed" || scenario == "seed-forced" {
        if let (Some(d), Some(p)) = (
            viol("direct", Tier::Guaranteed),
            viol("phase2", Tier::Guaranteed),
        ) {
            out.push((
                format!("{scenario}: Guaranteed violations, phase 2 ≤ 1 % while direct ≥ 25 %"),
                format!("phase 2 {p:.1} %, direct {d:.1} % ({})", engine("phase2")),
                p <= 1.0 && d >= 25.0,
            ));
        }
        for (t, seed, label) in [
            (Tier::Standard, 32.0, "Standard"),
            (Tier::BestEffort, 42.0, "Best-Effort"),
        ] {
            if let Some(p) = viol("phase2", t) {
                let s = find(sums, "phase2").and_then(|s| tier(s, t));
                let how = s.map_or(String::new(), |x| {
                    format!(
                        "; degraded {}, queued {}, fallback {}, rejected {}",
                        x.degraded, x.queued, x.fallback, x.rejected
                    )
                });
                let shaped = s.is_some_and(|x| x.degraded + x.queued + x.fallback > 0);
                let not_only_reject = t == Tier::BestEffort || shaped;
                out.push((
                    format!("{scenario}: {label} violations in phase 2 ≤ {:.0} % (seed {seed:.0} % − 10), not only by rejecting", seed - 10.0),
                    format!("{p:.1} %{how}"),
                    p <= seed - 10.0 && not_only_reject,
                ));
            }
        }
    }
    if scenario == "overload" {
        let good = |m: &str| {
            find(sums, m)
                .and_then(|s| tier(s, Tier::Guaranteed))
                .map(|x| x.goodput_rps)
        };
        if let (Some(base), Some(p2)) = (good("baseline"), good("phase2")) {
            let ratio = if base > 0.0 { p2 / base } else { 0.0 };
            let direct = good("direct").map_or(String::new(), |d| {
                format!(
                    "; direct {:.2} req/s = {:.0} %",
                    d,
                    100.0 * d / base.max(1e-9)
                )
            });
            out.push((
                "overload: Guaranteed goodput with Sluice ≥ 95 % of Guaranteed goodput with the backend unloaded".into(),
                format!("phase 2 {p2:.2} req/s / unloaded {base:.2} req/s = {:.1} %{direct} ({})", ratio * 100.0, engine("phase2")),
                ratio >= 0.95,
            ));
        }
    }
    out
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The SVG's path as seen from the markdown file.
fn link(common: &Common, svg: &Path) -> String {
    let base = common
        .results_md
        .as_ref()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    svg.strip_prefix(&base)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| svg.display().to_string())
}

fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "all") {
        let rest = args[1..].join(" ");
        format!("bench/run.sh {rest}").trim_end().to_string()
    } else {
        format!("target/release/sluice-bench {}", args.join(" "))
    }
}

pub fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().take(3).collect();
            format!("load average {}", f.join(", "))
        })
        .unwrap_or_default()
}

/// Machine and load, for every results section: the figures say what is true now, so they
/// name where they ran, not which commit.
pub struct Environment {
    machine: String,
    load: String,
}

impl Environment {
    pub fn capture() -> Self {
        let mem_gib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| {
                        v.split_whitespace()
                            .next()
                            .and_then(|x| x.parse::<f64>().ok())
                    })
            })
            .map_or(String::new(), |kib| {
                format!(", {:.0} GiB", kib / 1024.0 / 1024.0)
            });
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        Self {
            machine: format!("{cores} cores{mem_gib}, {}", std::env::consts::ARCH),
            load: uptime(),
        }
    }

    pub fn line(&self) -> String {
        // The harness and the `sluice` it runs come from the same cargo profile.
        let build = if cfg!(debug_assertions) {
            "Debug build: not a result."
        } else {
            "Release build."
        };
        format!(
            "Machine: {}, shared with other work; {} before the runs. {build}",
            self.machine, self.load
        )
    }
}

/// Replaces the text between this section's markers, or appends the section.
pub fn update_section(path: &Path, name: &str, body: &str) -> Result<(), String> {
    let begin = format!("<!-- sluice-bench:{name} begin -->");
    let end = format!("<!-- sluice-bench:{name} end -->");
    let old = std::fs::read_to_string(path).unwrap_or_else(|_| "# Benchmark results\n".into());
    let block = format!("{begin}\n{}\n{end}", body.trim_end());
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(a), Some(b)) if b > a => format!("{}{}{}", &old[..a], block, &old[b + end.len()..]),
        _ => format!("{}\n\n{block}\n", old.trim_end()),
    };
    write(path, &new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_replaced_in_place_and_the_rest_is_kept() {
        let dir = WorkDir::new("md").unwrap();
        let p = dir.path.join("R.md");
        std::fs::write(&p, "# R\n\n## Old section\nkeep me\n").unwrap();
        update_section(&p, "x", "first").unwrap();
        update_section(&p, "y", "other").unwrap();
        update_section(&p, "x", "second").unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.starts_with("# R\n\n## Old section\nkeep me\n"));
        assert!(text.contains("second") && !text.contains("first"));
        assert!(text.find("second").unwrap() < text.find("other").unwrap());
    }
}
