//! `sluice demo`: two simulator pools and the proxy on the embedded default config, with no
//! Redis, PostgreSQL or Prometheus. The simulators take free ports so the demo never collides
//! with a real deployment on 8001/8002.

use crate::server::{self, ServerFlags};
use clap::Parser;
use sluice_config::{env, Config};
use sluice_sim::SimArgs;

pub const ON_DEMAND_MODELS: &str = "llama-3-70b";
pub const SPOT_MODELS: &str = "llama-3-70b,llama-3-8b";

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Proxy listen address
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Operations listen address (status, metrics, dashboard, admin)
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub ops_listen: String,
}

fn sim_args(models: &str) -> SimArgs {
    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        sim: SimArgs,
    }
    Wrap::parse_from(["sim", "--model", models]).sim
}

pub fn run(args: DemoArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the simulator runtime: {e}"))?;
    let bind = |models: &'static str| {
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let args = sim_args(models);
            tokio::spawn(async move {
                if let Err(e) = sluice_sim::serve(args, listener).await {
                    log::error!("simulator stopped: {e}");
                }
            });
            Ok::<_, std::io::Error>(addr)
        })
    };
    let on_demand =
        bind(ON_DEMAND_MODELS).map_err(|e| format!("starting the on-demand simulator: {e}"))?;
    let spot = bind(SPOT_MODELS).map_err(|e| format!("starting the spot simulator: {e}"))?;

    let mut cfg = Config::embedded(&env::process_env).map_err(|e| e.to_string())?;
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
    println!(
        r#"
Sluice demo ({mode} policy)
  proxy      {url}
  operations {ops}/status, {ops}/dashboard, {ops}/metrics
  on-demand  http://{on_demand}  (vLLM simulator, models: {ON_DEMAND_MODELS})
  spot       http://{spot}  (vLLM simulator, models: {SPOT_MODELS}; also the fallback backend)
"#,
        mode = if adaptive { "adaptive" } else { "thresholds" }
    );
    if adaptive {
        println!(
            r#"Try (README "Walk-through" explains each step):
  chat() {{ curl -s -o /dev/null -w '%{{http_code}} %header{{x-sluice-decision}} %header{{x-sluice-reason}} %header{{x-sluice-pool}}\n' \
       {url}/v1/chat/completions -H "X-Tenant-ID: $1" -H 'content-type: application/json' \
       -d '{{"model":"llama-3-70b","messages":[{{"role":"user","content":"hello"}}],"max_tokens":400}}'; }}
  chat batch-analytics                                        # 200 pass, spot
  curl -s -X PUT {ops}/admin/pressure -d '{{"value":75}}'       # on-demand KV 75 %: nobody is shed for it
  chat batch-analytics; chat coding-assistant                 # still 200 admitted_slo_headroom
  curl -s -X PUT http://{on_demand}/admin/latency -d '{{"extra_ms":1800}}'   # on-demand turns slow
  for i in 1 2 3 4 5 6; do chat support-bot & done; wait      # Guaranteed runs out of headroom
  sleep 1; chat coding-assistant                              # after the next sample: degrade_slo_headroom (or degrade_brownout, fallback_slo_headroom)
  curl -s {ops}/status | grep -o '"admission_control".*' | head -c 600
  curl -s -X PUT http://{on_demand}/admin/latency -d '{{"extra_ms":0}}'; curl -s -X DELETE {ops}/admin/pressure
  (SLUICE_POLICY_MODE=thresholds runs the prototype's threshold walk-through instead.)
"#
        );
        return;
    }
    println!(
        r#"Try:
  curl -s {url}/v1/chat/completions -H 'X-Tenant-ID: batch-analytics' -H 'content-type: application/json' \
       -d '{{"model":"llama-3-70b","messages":[{{"role":"user","content":"hello"}}],"max_tokens":400}}' -i
  curl -s -X PUT {ops}/admin/pressure -d '{{"value":65}}'     # Best-Effort now gets 429 (after 2 samples)
  curl -s -X PUT {ops}/admin/pressure -d '{{"value":75}}'     # coding-assistant degraded to 256 tokens
  curl -s -X PUT {ops}/admin/pressure -d '{{"value":87}}'     # after 3 s: Standard falls back to llama-3-8b
  curl -s -X DELETE {ops}/admin/pressure                      # back to scraped values
  curl -s {ops}/status | head -c 2000
  curl -s '{ops}/decisions/recent?limit=5'
"#
    );
}
