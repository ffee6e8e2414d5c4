//! Signals from a real Prometheus: our own `prometheus` instance (Debian's package) on a free
//! port, scraping two simulator pools with a `pool` label, queried by `sluice serve` with
//! `signals.source: prometheus`. Load raises the pressure Sluice reports and moves tier states;
//! killing Prometheus makes the signals unavailable (the policy fails open); restarting it on
//! the same port and data directory restores them.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const PROMETHEUS: &str = "/usr/bin/prometheus";

/// Our own Prometheus process; killed on drop. Never any other instance.
struct Prometheus {
    child: Option<Child>,
    dir: PathBuf,
}

impl Prometheus {
    async fn start(port: u16, dir: &Path) -> Self {
        assert!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing: install Debian's prometheus package (scripts/test.sh does)"
        );
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new(PROMETHEUS)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn prometheus");
        let p = Prometheus {
            child: Some(child),
            dir: dir.to_path_buf(),
        };
        let c = client();
        let url = format!("http://127.0.0.1:{port}/-/ready");
        wait_for(Duration::from_secs(20), "prometheus /-/ready", || {
            let (c, url) = (c.clone(), url.clone());
            async move {
                let r = c.get(&url).send().await.ok()?;
                (r.status() == 200).then_some(())
            }
        })
        .await;
        p
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Removes Prometheus' data directory even when the test fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn reading<'a>(status: &'a Value, pool: &str, signal: &str) -> &'a Value {
    &status["signals"][pool][signal]
}

fn tier_state(status: &Value, tier: &str) -> String {
    tier_status(status, tier)["state"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Waits until `/status` shows `signal` of `pool` from Prometheus at `value` (± 0.01).
async fn wait_signal(sluice: &Sluice, pool: &str, signal: &str, value: f64) -> Value {
    wait_for(
        Duration::from_secs(10),
        &format!("{pool} {signal} = {value} from prometheus"),
        || async {
            let s = sluice.status().await;
            let r = reading(&s, pool, signal);
            let ok = r["source"] == "prometheus"
                && r["value"]
                    .as_f64()
                    .is_some_and(|v| (v - value).abs() < 0.01);
            ok.then_some(s)
        },
    )
    .await
}

async fn metrics(sluice: &Sluice) -> String {
    sluice.metrics().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_signals_drive_the_policy_and_an_outage_fails_open() {
    // The spot pool speaks the pre-0.10 KV metric name over two engines, so the default queries
    // are checked against both vLLM generations and the aggregation over `engine`.
    let on_demand = sim("llama-3-70b", &[]).await;
    let spot = sim("llama-3-70b", &["--legacy-metrics", "--engines", "2"]).await;

    let dir = std::env::temp_dir().join(format!(
        "sluice-prom-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = TempDir(dir.clone());
    let prom_config = format!(
        "global:\n  scrape_interval: 200ms\n  scrape_timeout: 150ms\n  evaluation_interval: 1s\n\
         scrape_configs:\n  - job_name: vllm\n    static_configs:\n\
         \x20     - targets: ['{}']\n        labels: {{pool: on-demand}}\n\
         \x20     - targets: ['{}']\n        labels: {{pool: spot}}\n",
        on_demand.addr, spot.addr
    );
    std::fs::write(dir.join("prometheus.yml"), prom_config).unwrap();
    let port = free_port();
    let mut prom = Prometheus::start(port, &dir).await;

    let mut cfg = config(&[&on_demand.addr], &[&spot.addr]);
    merge(
        &mut cfg,
        json!({
            "prometheus_url": format!("http://127.0.0.1:{port}"),
            "signals": {"source": "prometheus", "prometheus_poll_ms": 200, "prometheus_timeout_ms": 500, "stale_after_ms": 2000},
        }),
    );
    let sluice = serve(&cfg).await;

    // Idle fleet: both pools read from Prometheus at 0, not from a direct scrape.
    let s = wait_signal(&sluice, "on-demand", "pressure", 0.0).await;
    assert_eq!(s["telemetry"]["source"], "prometheus");
    assert_eq!(s["dependencies"]["prometheus"], true, "{s}");
    assert!(
        s["signals"]["on-demand"].get("scraped_backends").is_none(),
        "the direct scraper must not run with source: prometheus"
    );
    wait_signal(&sluice, "spot", "pressure", 0.0).await;
    wait_signal(&sluice, "spot", "queue_depth", 0.0).await;
    assert_eq!(tier_state(&s, "Standard"), "Normal");

    // Load: on-demand at 75% KV, spot at 95% with 6 waiting (split over its two engines).
    let load_changed = std::time::Instant::now();
    for (sim, body) in [
        (&on_demand, json!({"usage": 0.75})),
        (&spot, json!({"usage": 0.95, "waiting": 6})),
    ] {
        let r = client()
            .put(sim.url("/admin/kv"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    wait_signal(&sluice, "on-demand", "pressure", 75.0).await;
    wait_signal(&sluice, "spot", "pressure", 95.0).await;
    wait_signal(&sluice, "spot", "queue_depth", 6.0).await;
    sluice.wait_tier_state("Standard", "Elevated").await;
    // Scrape 200 ms + poll 200 ms + 2 confirming samples: well under a second here.
    eprintln!(
        "telemetry: simulator KV change → Standard Elevated in {} ms (prometheus scrape 200 ms, poll 200 ms, 2 samples)",
        load_changed.elapsed().as_millis()
    );
    sluice.wait_tier_state("Best-Effort", "Critical").await;
    let s = sluice.status().await;
    assert_eq!(tier_state(&s, "Guaranteed"), "Normal");
    assert_eq!(
        s["spot_state"], "Critical",
        "spot's own pressure drives eviction"
    );
    let r = sluice
        .chat("coding-assistant", chat_body("llama-3-70b", Some(400)))
        .await;
    assert_eq!(header(&r, "x-sluice-reason"), "degrade_pressure_elevated");
    let m = metrics(&sluice).await;
    assert!(
        m.contains(r#"sluice_signal_value{pool="on-demand",signal="pressure"} 75"#),
        "{m}"
    );
    assert!(m.contains(r#"sluice_dependency_up{dependency="prometheus"} 1"#));

    // Outage: Prometheus gone → every pool signal unavailable with the reason, never a zero.
    prom.stop();
    let s = wait_for(
        Duration::from_secs(10),
        "signals unavailable after Prometheus stopped",
        || async {
            let s = sluice.status().await;
            let gone = ["on-demand", "spot"].iter().all(|pool| {
                ["pressure", "queue_depth"]
                    .iter()
                    .all(|sig| reading(&s, pool, sig)["value"].is_null())
            });
            gone.then_some(s)
        },
    )
    .await;
    let why = reading(&s, "on-demand", "pressure")["unavailable"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        why.starts_with("prometheus: unreachable") && why.contains("last good sample"),
        "{why}"
    );
    let prom_status = &s["telemetry"]["prometheus"];
    assert_eq!(prom_status["up"], false, "{prom_status}");
    assert!(prom_status["last_error"]
        .as_str()
        .is_some_and(|e| e.contains("unreachable")));
    let r = sluice
        .chat("coding-assistant", chat_body("llama-3-70b", Some(400)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "x-sluice-reason"),
        "signals_unavailable_fail_open"
    );
    let m = metrics(&sluice).await;
    assert!(m.contains(r#"sluice_dependency_up{dependency="prometheus"} 0"#));
    assert!(m.contains(r#"sluice_signal_available{pool="on-demand",signal="pressure"} 0"#));
    assert!(
        !m.contains(r#"sluice_signal_value{pool="on-demand",signal="pressure"}"#),
        "an unavailable signal is absent, not zero"
    );

    // Recovery: same port, same data directory.
    let _prom = Prometheus::start(port, &dir).await;
    wait_signal(&sluice, "on-demand", "pressure", 75.0).await;
    wait_signal(&sluice, "spot", "pressure", 95.0).await;
    // The outage's fail-open samples let the tiers settle to Normal; fresh samples raise them again.
    sluice.wait_tier_state("Best-Effort", "Critical").await;
    sluice.wait_tier_state("Standard", "Elevated").await;
    let s = wait_for(Duration::from_secs(5), "prometheus up again", || async {
        let s = sluice.status().await;
        (s["dependencies"]["prometheus"] == true).then_some(s)
    })
    .await;
    assert!(s["telemetry"]["prometheus"]["rounds"].as_u64().unwrap() > 0);
    let r = sluice
        .chat("coding-assistant", chat_body("llama-3-70b", Some(400)))
        .await;
    assert_eq!(
        header(&r, "x-sluice-reason"),
        "degrade_pressure_elevated",
        "prometheus log:\n{}",
        prom.log()
    );
}
