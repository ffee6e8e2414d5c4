//! `sluice demo`: two simulator pools and the proxy on the embedded default config, with no
//! Redis, PostgreSQL or Prometheus. The simulators take free ports so the demo never collides
//! with a real deployment on 8001/8002.

use crate::server::{self, ServerFlags};
use clap::Parser;
use sluice_config::{env, Config};
use sluice_sim::SimArgs;

pub const ON_DEMAND_MODELS: &str = "llama-3-70b";
pub const SPOT_MODELS: &str = "llama-3-70b,llama-3-8b";
/// The on-demand simulator's flags beyond the model: a small pool (4 sequences at a time, a
/// 100 ms first token, the rest of `sluice sim`'s defaults), so that the README walk-through's
/// few clients make vLLM queue. The spot simulator runs the defaults.
pub const ON_DEMAND_FLAGS: &[&str] = &["--max-running", "4", "--ttft-ms", "100"];

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Proxy listen address
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Operations listen address (status, metrics, dashboard, admin)
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub ops_listen: String,
}

fn sim_args(models: &str, flags: &[&str]) -> SimArgs {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        sim: SimArgs,
    }
    Wrap::parse_from(["sim", "--model", models].iter().chain(flags)).sim
}

pub fn run(args: DemoArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the simulator runtime: {e}"))?;
    let bind = |models: &'static str, flags: &'static [&'static str]| {
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let args = sim_args(models, flags);
            tokio::spawn(async move {
                if let Err(e) = sluice_sim::serve(args, listener).await {
                    log::error!("simulator stopped: {e}");
                }
            });
            Ok::<_, std::io::Error>(addr)
        })
    };
    let on_demand = bind(ON_DEMAND_MODELS, ON_DEMAND_FLAGS)
        .map_err(|e| format!("starting the on-demand simulator: {e}"))?;
    let spot = bind(SPOT_MODELS, &[]).map_err(|e| format!("starting the spot simulator: {e}"))?;

    // OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) set: tracing on, exported there.
    let environment = env::process_env_tracing_to_named_collector;
    let mut cfg = Config::embedded(&environment).map_err(|e| e.to_string())?;
    cfg.listen = vec![args.listen.clone()];
    cfg.ops_listen = vec![args.ops_listen.clone()];
    for (name, addr) in [("on-demand", on_demand), ("spot", spot)] {
        if let Some(p) = cfg.pools.get_mut(name) {
            p.backends = vec![addr.to_string()];
        }
    }
    // The demo exits on Ctrl-C; no upgrade socket or pid file of a real deployment is touched.
    cfg.server.insert("grace_period_seconds".into(), 1.into());
    cfg.server.insert(
        "upgrade_sock".into(),
        format!("/tmp/sluice_demo_{}.sock", std::process::id()).into(),
    );

    let adaptive = cfg.policy_rules().mode == sluice_policy::PolicyMode::Adaptive;
    let (server, _drained) = server::build(cfg, ServerFlags::default(), None)?;
    print_walkthrough(
        &args.listen,
        &args.ops_listen,
        &on_demand.to_string(),
        &spot.to_string(),
        adaptive,
    );
    std::mem::forget(rt); // the simulators live as long as the process
    server.run_forever()
}

fn print_walkthrough(listen: &str, ops_listen: &str, on_demand: &str, spot: &str, adaptive: bool) {
    let url = format!("http://{listen}");
    let ops = format!("http://{ops_listen}");
    let od_flags = ON_DEMAND_FLAGS.join(" ");
    let (mode, block) = if adaptive {
        ("adaptive", "its first block")
    } else {
        (
            "thresholds",
            "the thresholds-mode block, after the first block's definitions",
        )
    };
    println!(
        r#"
Sluice demo ({mode} policy)
  proxy      {url}
  operations {ops}/status, {ops}/dashboard, {ops}/metrics
  on-demand  http://{on_demand}  (sluice sim --model {ON_DEMAND_MODELS} {od_flags})
  spot       http://{spot}  (sluice sim --model {SPOT_MODELS}; also the fallback backend)

README "Walk-through" ({block}) starts with
  U={url}; O={ops}; SP=http://{spot}
"#
    );
}
