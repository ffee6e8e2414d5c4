//! `/dashboard` rendered by a real headless Chromium against a live `sluice serve` and simulator
//! pools: the DOM shows each pool, each backend's health, each tier's state and the recent
//! decisions, and a screenshot is saved to `target/test-output/dashboard.png`.

mod common;

use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHROMIUM: &str = "/usr/bin/chromium";

/// Runs headless Chromium on `url` with `extra` flags in a fresh profile; returns stdout.
fn chromium(url: &str, extra: &[&str]) -> String {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: the dashboard test needs Debian's chromium package \
         (apt-get install chromium; scripts/test.sh installs it)"
    );
    let profile = std::env::temp_dir().join(format!(
        "sluice-chromium-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&profile).unwrap();
    let out_path = profile.join("stdout");
    let mut child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn chromium");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&profile);
    assert!(status.success(), "chromium failed: {status}");
    out
}

fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n") && &bytes[12..16] == b"IHDR",
        "not a PNG"
    );
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_pools_backends_tiers_and_decisions() {
    let od_a = sim("llama-3-70b", &[]).await;
    let od_b = sim("llama-3-70b", &[]).await;
    let spot = sim("llama-3-70b", &[]).await;
    let sluice = serve(&config(&[&od_a.addr, &od_b.addr], &[&spot.addr])).await;

    // One on-demand backend fails its health check; the pool's pressure puts Standard in
    // Elevated and Best-Effort in Critical; a few requests leave decisions behind.
    let r = client()
        .put(od_b.url("/admin/health"))
        .json(&json!({"healthy": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    wait_for(
        Duration::from_secs(10),
        "backend marked unhealthy",
        || async {
            let s = sluice.status().await;
            let down = s["pools"][0]["backends"]
                .as_array()?
                .iter()
                .any(|b| b["backend"] == od_b.addr.as_str() && b["healthy"] == false);
            down.then_some(())
        },
    )
    .await;
    sluice.set_signal("/admin/pressure", 75.0).await;
    sluice.wait_tier_state("Standard", "Elevated").await;
    sluice.wait_tier_state("Best-Effort", "Critical").await;
    let r = sluice
        .chat("coding-assistant", chat_body("llama-3-70b", Some(400)))
        .await;
    assert_eq!(header(&r, "x-sluice-reason"), "degrade_pressure_elevated");
    let r = sluice
        .chat("batch-analytics", chat_body("llama-3-70b", Some(400)))
        .await;
    assert_eq!(r.status(), 429);

    let url = sluice.ops_url("/dashboard");
    let page = client().get(&url).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(header(&page, "content-type").starts_with("text/html"));
    let html = page.text().await.unwrap();
    // The SVG namespace is a name, not a load.
    let html = html.replace("http://www.w3.org/2000/svg", "");
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "the page must not load anything from elsewhere"
    );

    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || chromium(&url, &["--dump-dom"])
    })
    .await
    .unwrap();
    for needle in [
        r#"data-pool="on-demand""#.to_string(),
        r#"data-pool="spot""#.to_string(),
        // Each pool card says what failed over and what was ejected.
        r#"data-failover="on-demand""#.to_string(),
        format!(r#"data-backend="{}" data-healthy="true""#, od_a.addr),
        format!(r#"data-backend="{}" data-healthy="false""#, od_b.addr),
        format!(r#"data-backend="{}" data-healthy="true""#, spot.addr),
        r#"data-tier="Guaranteed" data-state="Normal""#.to_string(),
        r#"data-tier="Standard" data-state="Elevated""#.to_string(),
        r#"data-tier="Best-Effort" data-state="Critical""#.to_string(),
        "75.0%".to_string(),
        "degrade_pressure_elevated".to_string(),
        "reject_pressure_critical".to_string(),
    ] {
        assert!(
            dom.contains(&needle),
            "rendered dashboard lacks {needle}:\n{dom}"
        );
    }
    assert!(
        !dom.contains(r#"class="banner bad show""#),
        "refresh failed:\n{dom}"
    );

    let shot: PathBuf = [env!("CARGO_MANIFEST_DIR"), "target", "test-output"]
        .iter()
        .collect();
    std::fs::create_dir_all(&shot).unwrap();
    let shot = shot.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let arg = format!("--screenshot={}", shot.display());
    tokio::task::spawn_blocking(move || chromium(&url, &[&arg, "--window-size=1280,900"]))
        .await
        .unwrap();
    let png = std::fs::read(&shot).expect("chromium wrote the screenshot");
    assert_eq!(png_size(&png), (1280, 900));
    assert!(
        png.len() > 30_000,
        "a {}-byte screenshot is too small to show the page",
        png.len()
    );
}

/// Adaptive mode: each pool card shows its admission level with a history line, and the
/// headroom of the tiers it serves; the tiers table shows each tier's TTFT and TPOT against its
/// targets.
#[tokio::test]
async fn dashboard_plots_admission_level_and_headroom() {
    let od = sim("llama-3-70b", &["--itl-ms", "5"]).await;
    let spot = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&spot.addr]);
    merge(&mut cfg, json!({"policy": {"mode": "adaptive"}}));
    let sluice = serve(&cfg).await;
    for _ in 0..6 {
        let mut body = chat_body("llama-3-70b", Some(5));
        body["stream"] = json!(true);
        let r = sluice.chat("support-bot", body).await;
        assert_eq!(r.status(), 200);
        let _ = r.text().await;
    }
    wait_for(
        Duration::from_secs(5),
        "Guaranteed's TTFT and TPOT",
        || async {
            let st = sluice.status().await;
            let g = &st["admission_control"]["pools"]["on-demand"]["tiers"]["Guaranteed"];
            g["slo"]["tpot"]["observed_p_ms"].as_f64()?;
            g["slo"]["ttft"]["observed_p_ms"].as_f64()
        },
    )
    .await;
    let url = sluice.ops_url("/dashboard");
    let dom = tokio::task::spawn_blocking(move || chromium(&url, &["--dump-dom"]))
        .await
        .unwrap();
    for needle in [
        r#"data-signal="admission level""#,
        r#"data-level="0""#,
        r#"data-headroom="Guaranteed""#,
        "policy: adaptive",
        // The shipped objective, per tier: TTFT and TPOT seen against their targets.
        r#"data-dim="ttft""#,
        "/ 500 ms",
        "/ 50 ms",
        "/ 2000 ms",
        // The thresholds decide nothing in adaptive mode.
        "not in force",
    ] {
        assert!(
            dom.contains(needle),
            "rendered dashboard lacks {needle}:\n{dom}"
        );
    }
}

/// With Redis, a tier's idle capacity credits are shown beside its requests in flight, not
/// counted as requests.
#[tokio::test]
async fn dashboard_shows_idle_credits_apart_from_requests_in_flight() {
    let od = sim("llama-3-70b", &[]).await;
    let ns = RedisNs::new(&shared_redis_url());
    let mut cfg = config(&[&od.addr], &[&od.addr]);
    merge(
        &mut cfg,
        json!({
            "redis_url": ns.url,
            "coordination": {"redis_prefix": ns.prefix},
            "tiers": {"Guaranteed": {"inflight_capacity": 256}},
        }),
    );
    let sluice = serve(&cfg).await;
    let idle = wait_for(Duration::from_secs(20), "idle credits", || async {
        let r = sluice
            .chat("support-bot", chat_body("llama-3-70b", Some(4)))
            .await;
        assert_eq!(r.status(), 200);
        let t = sluice.tier("Guaranteed").await;
        let idle = t["idle_credits"].as_u64().filter(|n| *n > 0)?;
        (t["inflight"] == 0).then_some(idle)
    })
    .await;
    let url = sluice.ops_url("/dashboard");
    let dom = tokio::task::spawn_blocking(move || chromium(&url, &["--dump-dom"]))
        .await
        .unwrap();
    for needle in [
        r#"data-inflight="0">0 / 256"#.to_string(),
        format!(r#"data-idle-credits="{idle}""#),
        format!("+{idle} idle credits"),
    ] {
        assert!(
            dom.contains(&needle),
            "rendered dashboard lacks {needle}:\n{dom}"
        );
    }
}
