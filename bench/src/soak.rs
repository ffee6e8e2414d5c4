//! The long run: steady traffic through Sluice's full pipeline for several minutes while its
//! resident memory (VmRSS from /proc) is sampled, to show that it levels off instead of growing
//! with the number of requests served. The traffic rotates through a thousand tenant names so
//! anything keyed by tenant would show up as growth.

use serde_json::json;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use crate::procs::{self, WorkDir};
use crate::results::{self, Environment};
use crate::scenario::{Rng, SimParams};
use crate::sluice_conf::{FALLBACK_MODEL, MODEL};
use crate::Common;

const SAMPLE_EVERY: Duration = Duration::from_secs(5);
const TENANTS: u64 = 1000;

/// Least-squares slope of (x, y) points.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// `with_extras`: the PostgreSQL ledger and Redis admission on as well (issue 13's soak).
pub async fn run(
    common: &Common,
    minutes: f64,
    rate: f64,
    with_extras: bool,
) -> Result<(), String> {
    if !(minutes.is_finite() && rate.is_finite()) || minutes <= 0.0 || rate <= 0.0 {
        return Err("--minutes and --rate must be positive".into());
    }
    let env = Environment::capture();
    let bin = procs::sluice_bin(common.sluice_bin.as_deref())?;
    let wd = WorkDir::new("soak")?;
    let c = procs::client();
    let sim = SimParams {
        kv_tokens: 1_000_000,
        max_running: 1024,
        ttft_ms: 5,
        prefill_us_per_token: 10,
        itl_ms: 0.2,
        load_slowdown: 0.5,
        kv_reserve: Default::default(),
    };
    let od = procs::start_sim(&bin, "on-demand", MODEL, &sim, &wd.path).await?;
    let spot = procs::start_sim(
        &bin,
        "spot",
        &format!("{MODEL},{FALLBACK_MODEL}"),
        &sim,
        &wd.path,
    )
    .await?;
    let cfg = json!({
        "listen": [procs::free_addr()?],
        "ops_listen": [procs::free_addr()?],
        "server": {"threads": 2, "grace_period_seconds": 0, "graceful_shutdown_timeout_seconds": 1,
                   "upgrade_sock": wd.path.join("upgrade.sock").display().to_string(),
                   "pid_file": wd.path.join("sluice.pid").display().to_string()},
        "tenants": {"support-bot": "Guaranteed", "coding-assistant": "Standard", "batch-analytics": "Best-Effort"},
        "auth": {"unknown_tenant": "Best-Effort"},
        "pools": {"on-demand": {"backends": [od.addr]}, "spot": {"backends": [spot.addr]}},
        "fallbacks": [{"name": "small", "url": format!("http://{}", spot.addr), "model": FALLBACK_MODEL}],
        "tiers": {"Guaranteed": {"inflight_capacity": 64}, "Standard": {"inflight_capacity": 32},
                  "Best-Effort": {"inflight_capacity": 16}},
    });
    let mut cfg = cfg;
    if with_extras {
        crate::sluice_conf::merge(
            &mut cfg,
            &json!({
                "database_url": crate::sluice_conf::LEDGER_URL,
                "ledger": {"schema": "sluice_soak", "spool_dir": wd.path.join("spool").display().to_string()},
                "redis_url": "redis://127.0.0.1:6379",
                "coordination": {"redis_prefix": "sluice-soak"},
            }),
        );
    }
    let sluice = procs::start_sluice(&bin, &cfg, &wd.path).await?;
    // Both must really be in use, not failed open: the run would measure something else.
    for tries in 0.. {
        if !with_extras {
            break;
        }
        let st = procs::get_json(&c, &sluice.ops_url("/status")).await?;
        let deps = &st["dependencies"];
        if st["coordinator"] != json!("local")
            && deps["ledger"] == json!(true)
            && deps["coordinator"] == json!(true)
        {
            break;
        }
        if tries == 50 {
            return Err(format!("started, but not on the ledger and Redis: {deps}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = sluice.pid();
    let url = sluice.url("/v1/chat/completions");
    eprintln!("sluice-bench: soak for {minutes} min at {rate} req/s (Sluice pid {pid})");

    let ok = Arc::new(AtomicU64::new(0));
    let other = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(minutes * 60.0);
    let sender = {
        let (c, url, ok, other) = (c.clone(), url.clone(), Arc::clone(&ok), Arc::clone(&other));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut rng = Rng::new(7);
            let mut i: u64 = 0;
            let limit = Arc::new(tokio::sync::Semaphore::new(512));
            while Instant::now() < end {
                tick.tick().await;
                i += 1;
                let tenant = match i % 4 {
                    0 => "support-bot".to_string(),
                    1 => "coding-assistant".to_string(),
                    2 => "batch-analytics".to_string(),
                    _ => format!("tenant-{}", rng.range([0, TENANTS - 1])),
                };
                let stream = rng.unit() < 0.2;
                let mut body = json!({"model": MODEL, "max_tokens": rng.range([16, 128]),
                                      "messages": [{"role": "user", "content": "x".repeat(rng.range([50, 200]) as usize * 4)}]});
                if stream {
                    body["stream"] = json!(true);
                }
                let Ok(permit) = Arc::clone(&limit).acquire_owned().await else {
                    break;
                };
                let (c, url, ok, other) =
                    (c.clone(), url.clone(), Arc::clone(&ok), Arc::clone(&other));
                tokio::spawn(async move {
                    let _permit = permit;
                    let req = http::Request::post(&url)
                        .header("content-type", "application/json")
                        .header("x-tenant-id", tenant)
                        .body(http_body_util::Full::new(bytes::Bytes::from(
                            body.to_string(),
                        )));
                    let good = match req {
                        Ok(req) => match c.request(req).await {
                            Ok(resp) => {
                                let status = resp.status();
                                let body = http_body_util::BodyExt::collect(resp.into_body()).await;
                                status.is_success() && body.is_ok()
                            }
                            Err(_) => false,
                        },
                        Err(_) => false,
                    };
                    if good { &ok } else { &other }.fetch_add(1, Ordering::Relaxed);
                });
            }
        })
    };
    let mut points: Vec<(f64, u64, u64)> = Vec::new();
    let mut tick = tokio::time::interval_at(start, SAMPLE_EVERY);
    loop {
        tick.tick().await;
        let t = start.elapsed().as_secs_f64();
        let rss = procs::rss_kib(pid).ok_or("Sluice exited during the soak")?;
        points.push((
            t,
            rss,
            ok.load(Ordering::Relaxed) + other.load(Ordering::Relaxed),
        ));
        if Instant::now() >= end {
            break;
        }
    }
    let _ = sender.await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let final_rss = procs::rss_kib(pid);
    drop(sluice);
    drop(spot);
    drop(od);

    let (okn, othern) = (ok.load(Ordering::Relaxed), other.load(Ordering::Relaxed));
    // The first 30 s are warm-up (pools, allocator arenas, buffers reaching their size).
    let settled: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.0 >= 30.0)
        .map(|p| (p.0 / 60.0, p.1 as f64))
        .collect();
    let second_half: Vec<(f64, f64)> = settled
        .iter()
        .copied()
        .filter(|p| p.0 >= minutes / 2.0)
        .collect();
    let mib = |k: u64| k as f64 / 1024.0;
    let mut md = String::new();
    let (title, flag, extras) = if with_extras {
        (
            "## Long run: Sluice's memory with the ledger and Redis admission",
            " --ledger-and-redis",
            ", with the PostgreSQL ledger (schema `sluice_soak`) and Redis admission on",
        )
    } else {
        ("## Long run: Sluice's memory", "", "")
    };
    let _ = writeln!(md, "{title}\n");
    let _ = writeln!(
        md,
        "Command: `target/release/sluice-bench soak --minutes {minutes} --rate {rate}{flag}` (also part of `bench/run.sh`)  \n{}\n",
        env.line()
    );
    let _ = writeln!(
        md,
        "Steady {rate} requests/s through Sluice's full pipeline (capacities 64/32/16, queue, fallback configured) \
         for {minutes} minutes{extras}: a quarter each from the three configured tenants, a quarter from {TENANTS} rotating \
         unknown tenants (Best-Effort), 20 % streamed, 16–128 completion tokens, against fast simulators. \
         VmRSS of the `sluice serve` process sampled every {} s.\n",
        SAMPLE_EVERY.as_secs()
    );
    md.push_str("| time | VmRSS | requests sent |\n|---|---|---|\n");
    let mut last_minute = -1i64;
    for (i, p) in points.iter().enumerate() {
        let minute = (p.0 / 60.0).floor() as i64;
        // One row per 30 s keeps the table short; the SVG has every sample.
        if i == 0
            || i == points.len() - 1
            || (p.0 as i64 % 30 < SAMPLE_EVERY.as_secs() as i64 && minute >= last_minute)
        {
            last_minute = minute;
            let _ = writeln!(md, "| {:.0} s | {:.1} MiB | {} |", p.0, mib(p.1), p.2);
        }
    }
    let first = settled.first().map(|p| p.1);
    let peak = points.iter().map(|p| p.1).max().unwrap_or(0);
    let _ = writeln!(
        md,
        "\n{okn} requests succeeded, {othern} did not. RSS after warm-up (30 s) {}, at the end {}, peak {:.1} MiB; \
         trend over the run's second half {} (least squares), over everything after warm-up {}. After the traffic stopped: {}.\n",
        first.map_or("–".into(), |v| format!("{:.1} MiB", v / 1024.0)),
        points.last().map_or("–".into(), |p| format!("{:.1} MiB", mib(p.1))),
        mib(peak),
        slope(&second_half).map_or("–".into(), |s| format!("{:+.0} KiB/min", s)),
        slope(&settled).map_or("–".into(), |s| format!("{:+.0} KiB/min", s)),
        final_rss.map_or("–".into(), |v| format!("{:.1} MiB", mib(v))),
    );
    let name = if with_extras { "soak-extras" } else { "soak" };
    let svg_path = common.out.join(format!("{name}-rss.svg"));
    std::fs::create_dir_all(&common.out).map_err(|e| e.to_string())?;
    std::fs::write(&svg_path, rss_plot(&points)).map_err(|e| e.to_string())?;
    let link = common
        .results_md
        .as_ref()
        .and_then(|m| m.parent())
        .and_then(|base| svg_path.strip_prefix(base).ok())
        .map_or(svg_path.display().to_string(), |p| p.display().to_string());
    let _ = writeln!(
        md,
        "![Sluice RSS over the soak]({link})\n\nLoad after the run: {}",
        results::uptime()
    );
    println!("{md}");
    if let Some(path) = &common.results_md {
        results::update_section(path, name, &md)?;
    }
    Ok(())
}

fn rss_plot(points: &[(f64, u64, u64)]) -> String {
    let (w, h, l, r, t, b) = (800.0, 260.0, 70.0, 20.0, 30.0, 40.0);
    let tmax = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let ymax = points
        .iter()
        .map(|p| p.1 as f64 / 1024.0)
        .fold(1.0, f64::max)
        * 1.15;
    let x = |v: f64| l + (w - l - r) * v / tmax;
    let y = |v: f64| t + (h - t - b) * (1.0 - v / ymax);
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11"><rect width="{w}" height="{h}" fill="white"/>"#
    );
    let _ = write!(
        s,
        r#"<text x="{l}" y="18" font-size="13" font-weight="bold">Sluice VmRSS during the soak (MiB)</text>"#
    );
    let _ = write!(
        s,
        r##"<rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="#ccc"/>"##,
        w - l - r,
        h - t - b
    );
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        crate::svg::grid_line(&mut s, l, w - r, y(v), &format!("{v:.0}"));
    }
    let step = if tmax > 600.0 { 120.0 } else { 30.0 };
    let mut tt = 0.0;
    while tt <= tmax {
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#666">{:.0} s</text>"##,
            x(tt),
            h - b + 14.0,
            tt
        );
        tt += step;
    }
    let pts: Vec<String> = points
        .iter()
        .map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1 as f64 / 1024.0)))
        .collect();
    let _ = write!(
        s,
        r##"<polyline fill="none" stroke="#3b4cc0" stroke-width="1.8" points="{}"/>"##,
        pts.join(" ")
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_a_flat_series() {
        let line: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 1.0)).collect();
        assert!((slope(&line).unwrap() - 3.0).abs() < 1e-9);
        assert_eq!(slope(&[(0.0, 5.0), (1.0, 5.0), (2.0, 5.0)]), Some(0.0));
        assert_eq!(slope(&[(1.0, 1.0)]), None);
    }
}
