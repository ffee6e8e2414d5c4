//! `sluice-bench`: Sluice's benchmark harness (issue 6).
//!
//! One scenario description ([`scenario`]) drives two engines: an in-process deterministic
//! model ([`model`]: the pure policy core in simulated time against a model of the simulator)
//! and a live run ([`live`]: real `sluice sim` backends, a real `sluice serve`, real HTTP).
//! Both produce the same records ([`record`]), summarised by [`report`] into markdown tables and
//! plotted by [`svg`]. [`overhead`] measures the proxy's added latency against nginx with wrk,
//! and [`soak`] watches Sluice's memory over a long steady run.
//!
//! `sluice-bench all` runs everything and rewrites its sections of `bench/RESULTS.md`.

mod bare;
mod failover;
mod flame;
mod fleet;
mod live;
mod metrics_writes;
mod model;
mod model_queue;
mod overhead;
mod procs;
mod record;
mod report;
mod results;
mod scenario;
mod sluice_conf;
mod soak;
mod stats;
mod svg;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

use record::Mode;

// The same allocator as `sluice`, so the bare Pingora row compares like with like.
#[global_allocator]
static GLOBAL: sluice_runtime::alloc::Allocator = sluice_runtime::alloc::Allocator;
use sluice_conf::SlaSignal;

#[derive(Parser)]
#[command(
    name = "sluice-bench",
    about = "Sluice benchmarks: tier protection, overhead, soak"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone, Debug)]
pub struct Common {
    /// The `sluice` binary (default: next to this one).
    #[arg(long)]
    pub sluice_bin: Option<PathBuf>,
    /// Where JSON, SVG and generated configs go.
    #[arg(long, default_value = "bench/results")]
    pub out: PathBuf,
    /// Rewrite this harness's sections of this markdown file.
    #[arg(long)]
    pub results_md: Option<PathBuf>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct ScenarioArgs {
    /// Built-in scenario names or YAML paths, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "seed,shared-backend,seed-forced,seed-defaults,overload,spot-failure,bursty"
    )]
    pub scenarios: Vec<String>,
    /// Modes, comma separated: baseline (Guaranteed arrivals alone, direct; only for scenarios
    /// with `baseline: true`), direct, priority (direct on vLLM's priority policy, the tier as
    /// `priority`), phase1, phase2, adaptive, fifo.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "baseline,direct,phase1,phase2,adaptive"
    )]
    pub modes: Vec<String>,
    /// live (real HTTP), model (in-process, simulated time) or both.
    #[arg(long, default_value = "both")]
    pub engine: String,
    /// Source of phase 2's SLA-violation-rate signal.
    #[arg(long, value_enum, default_value = "ledger")]
    pub sla_signal: SlaSignal,
    /// JSON deep-merged into every scenario's `sluice:` knobs (for exploring a setting).
    #[arg(long)]
    pub sluice_override: Option<String>,
    /// Compresses every scenario's timeline and request counts by this factor, keeping its
    /// rates (0.05: seed's 60 s become 3 s). For smoke tests: the figures are not results, so
    /// it cannot be combined with `--results-md` (or `all`).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Also write every run's raw records and samples here, one JSON file per run, for
    /// looking at a run request by request.
    #[arg(long)]
    pub dump_runs: Option<PathBuf>,
    /// The engine models the simulators follow, comma separated: slowdown (the scenario's
    /// own backends) and reserve (vLLM without preemption: KV reserved for prompt plus
    /// max_tokens, answers ending on their own, fixed decode steps).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "slowdown")]
    pub engine_model: Vec<scenario::EngineModel>,
    /// Also run each scenario with every tier's SLA target at these multiples of its unloaded
    /// latency (comma separated, e.g. 1.3,1.7,4); without it, the scenario's own targets.
    #[arg(long, value_delimiter = ',')]
    pub sla_x: Vec<f64>,
    /// Also run each scenario with every tier's objective in TTFT and TPOT, each target at
    /// these multiples of the tier's unloaded TTFT and TPOT on its pool (comma separated, e.g.
    /// 1.3,1.6,2,4,10), as the shipped config sets objectives (no end-to-end target); the
    /// reports then give attainment per dimension and the SLO goodput.
    #[arg(long, value_delimiter = ',')]
    pub slo_x: Vec<f64>,
    /// GPU-like backends: every engine time scaled so a decode step takes this many ms (e.g.
    /// 20; both engine models), the load kept relative to capacity as `--gpu-load` says.
    #[arg(long)]
    pub gpu_itl_ms: Option<f64>,
    /// How GPU-like timings keep the load relative to capacity: stretch (the same requests
    /// over a timeline stretched by the same factor: the scenario's overload, slowed down) or
    /// rate (arrivals divided by it over the same window: a milder overload).
    #[arg(long, value_enum, default_value = "stretch")]
    pub gpu_load: scenario::GpuLoad,
}

#[derive(Subcommand)]
enum Command {
    /// Everything: scenarios (model and live), proxy overhead, soak; rewrites the results.
    All {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        scen: ScenarioArgs,
        /// Seconds per wrk run in the overhead bench.
        #[arg(long, default_value_t = 8)]
        overhead_seconds: u64,
        /// Minutes of the soak run.
        #[arg(long, default_value_t = 3.0)]
        soak_minutes: f64,
    },
    /// Run scenarios in the chosen modes and engines.
    Run {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        scen: ScenarioArgs,
    },
    /// Proxy overhead at fixed concurrency with wrk: direct, Sluice, Sluice with ledger and
    /// Redis admission, nginx.
    Overhead {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 8)]
        seconds: u64,
        /// Connection counts.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        connections: Vec<u32>,
        /// Measure every target this many times, round by round, and report medians: one run
        /// of each on a shared 2-core machine moves by 10-30 %.
        #[arg(long, default_value_t = 1)]
        rounds: u32,
        /// After the table's runs, record each proxy (bare Pingora, Sluice, Sluice with the
        /// ledger, Sluice with the ledger and Redis) with `perf record` during one more wrk run
        /// at 16 connections and write DIR/<config>.svg (inferno), DIR/<config>.folded.gz and
        /// DIR/SHARES.md.
        /// Needs perf and inferno (`cargo install inferno --locked`); see bench/flamegraphs.sh.
        #[arg(long, value_name = "DIR")]
        flamegraphs: Option<PathBuf>,
    },
    /// The smallest Pingora reverse proxy, for the overhead bench's "bare Pingora" row.
    BareProxy {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        upstream: std::net::SocketAddr,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// The request path's metric updates from several threads at once: Sluice's per-worker
    /// shards against one shared vector.
    MetricsWrites {
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Requests per thread.
        #[arg(long, default_value_t = 5_000_000)]
        requests: u64,
    },
    /// A steady run that samples Sluice's RSS.
    Soak {
        #[command(flatten)]
        common: Common,
        #[arg(long, default_value_t = 3.0)]
        minutes: f64,
        /// Requests per second.
        #[arg(long, default_value_t = 40.0)]
        rate: f64,
        /// With the PostgreSQL ledger and Redis admission on (both must be running locally).
        #[arg(long)]
        ledger_and_redis: bool,
    },
    /// Model only, over many seeds: mean and range of each tier's violations per mode. For
    /// calibrating a scenario without trusting one lucky seed.
    Calibrate {
        #[command(flatten)]
        scen: ScenarioArgs,
        #[arg(long, default_value_t = 10)]
        seeds: u64,
    },
    /// Replica selection inside a pool, live: round robin, least load and prefix affinity on a
    /// two-model fleet of simulators with prefix caching, through the shipped config (shared
    /// system prompts, every prompt unique, one slow replica).
    Fleet {
        #[command(flatten)]
        args: fleet::FleetArgs,
    },
    /// Failover, live: a replica SIGKILLed and restarted, another answering 503, then the whole
    /// pool answering 503; what clients see, retries, the retry budget and ejections.
    Failover {
        #[command(flatten)]
        args: failover::FailoverArgs,
    },
    /// Print a scenario (YAML) or its generated arrivals (JSON lines).
    Scenario {
        name: String,
        #[arg(long)]
        arrivals: bool,
        /// As for `run`: the scenario compressed in time by this factor.
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
    },
}

fn modes(names: &[String]) -> Result<Vec<Mode>, String> {
    names
        .iter()
        .map(|m| Mode::parse(m.trim()).ok_or_else(|| format!("unknown mode {m:?}")))
        .collect()
}

/// A time-scaled run is a smoke test; its figures must never land in a results file.
fn refuse_scaled_results(common: &Common, scen: &ScenarioArgs) -> Result<(), String> {
    match &common.results_md {
        Some(path) if scen.time_scale != 1.0 => Err(format!(
            "--time-scale {} gives smoke figures, not results: refusing to write {} (drop --results-md; `all` always writes results)",
            scen.time_scale,
            path.display()
        )),
        _ => Ok(()),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::BareProxy {
        listen,
        upstream,
        threads,
    } = &cli.command
    {
        bare::run(listen, *upstream, *threads);
    }
    if let Command::MetricsWrites { threads, requests } = &cli.command {
        metrics_writes::run(*threads, *requests);
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        let work = run(cli.command);
        // Dropping the work on Ctrl-C or SIGTERM drops every child process handle, which kills
        // the simulators, Sluice and nginx instead of leaving them listening.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| e.to_string())?;
        tokio::select! {
            r = work => r,
            _ = tokio::signal::ctrl_c() => Err("interrupted".to_string()),
            _ = term.recv() => Err("terminated".to_string()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> Result<(), String> {
    match command {
        Command::All {
            common,
            scen,
            overhead_seconds,
            soak_minutes,
        } => {
            let mut common = common;
            if common.results_md.is_none() {
                common.results_md = Some(PathBuf::from("bench/RESULTS.md"));
            }
            refuse_scaled_results(&common, &scen)?;
            results::run_scenarios(&common, &scen, &modes(&scen.modes)?).await?;
            overhead::run(&common, overhead_seconds, 1, &[1, 16, 64], None).await?;
            soak::run(&common, soak_minutes, 40.0, false).await
        }
        Command::Run { common, scen } => {
            refuse_scaled_results(&common, &scen)?;
            results::run_scenarios(&common, &scen, &modes(&scen.modes)?).await
        }
        Command::Overhead {
            common,
            seconds,
            connections,
            rounds,
            flamegraphs,
        } => {
            overhead::run(
                &common,
                seconds,
                rounds,
                &connections,
                flamegraphs.as_deref(),
            )
            .await
        }
        Command::Soak {
            common,
            minutes,
            rate,
            ledger_and_redis,
        } => soak::run(&common, minutes, rate, ledger_and_redis).await,
        Command::Calibrate { scen, seeds } => {
            results::calibrate(&scen, &modes(&scen.modes)?, seeds)
        }
        Command::Fleet { args } => fleet::run(&args).await,
        Command::Failover { args } => failover::run(&args).await,
        Command::Scenario {
            name,
            arrivals,
            time_scale,
        } => {
            let s = scenario::Scenario::load(&name)?.time_scaled(time_scale)?;
            if arrivals {
                for a in s.arrivals() {
                    println!("{}", serde_json::to_string(&a).map_err(|e| e.to_string())?);
                }
            } else {
                print!("{}", serde_yaml::to_string(&s).map_err(|e| e.to_string())?);
            }
            Ok(())
        }
        Command::BareProxy { .. } | Command::MetricsWrites { .. } => {
            unreachable!("run before the runtime starts")
        }
    }
}
