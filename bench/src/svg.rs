//! Hand-written SVG timelines: one panel per run, each with the KV pressure (what the simulator
//! reports and what the policy used, and in adaptive mode each pool's admission level), the tier
//! states and fallback as colour bands, and every request's latency by tier on a log scale
//! against each tier's SLA target (dashed), rejections marked underneath.

use sluice_policy::{PressureState, Tier};
use std::fmt::Write as _;

use crate::record::Run;
use crate::report;

const W: f64 = 1000.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 20.0;
const PANEL_H: f64 = 340.0;
const HEADER_H: f64 = 56.0;
const LAT_MIN_MS: f64 = 50.0;
const LAT_MAX_MS: f64 = 30_000.0;
/// The shipped ladder's length: the top of the KV lane when it carries the admission level.
const LEVEL_MAX: f64 = 6.0;

fn tier_color(t: Tier) -> &'static str {
    match t {
        Tier::Guaranteed => "#1f6fb4",
        Tier::Standard => "#2a9d3a",
        Tier::BestEffort => "#e07b12",
    }
}

fn state_color(s: PressureState) -> &'static str {
    match s {
        PressureState::Normal => "#d7ecd7",
        PressureState::Elevated => "#ffcf70",
        PressureState::Critical => "#e35d61",
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A polyline through the points that have a value; gaps split it.
fn polyline(out: &mut String, pts: &[(f64, Option<f64>)], style: &str) {
    let mut seg: Vec<String> = Vec::new();
    let flush = |seg: &mut Vec<String>, out: &mut String| {
        if seg.len() > 1 {
            let _ = writeln!(
                out,
                r#"<polyline fill="none" {style} points="{}"/>"#,
                seg.join(" ")
            );
        }
        seg.clear();
    };
    for (x, y) in pts {
        match y {
            Some(y) => seg.push(format!("{x:.1},{y:.1}")),
            None => flush(&mut seg, out),
        }
    }
    flush(&mut seg, out);
}

pub fn scenario_plot(title: &str, runs: &[&Run]) -> String {
    let duration_ms = runs
        .iter()
        .map(|r| r.duration_s * 1000.0)
        .fold(1000.0, f64::max);
    // Show the drain after the arrival window too, but not an endless tail.
    let end_ms = runs
        .iter()
        .flat_map(|r| r.records.iter().map(|x| x.at_ms as f64 + x.latency_ms))
        .fold(duration_ms, f64::max)
        .min(duration_ms * 1.5);
    let pw = W - LEFT - RIGHT;
    let x = |t_ms: f64| LEFT + pw * (t_ms / end_ms).clamp(0.0, 1.0);
    let h = HEADER_H + PANEL_H * runs.len() as f64 + 10.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="18" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    // Legend.
    let mut lx = LEFT;
    let ly = 38.0;
    for (label, swatch) in [
        (
            "on-demand KV (sim)",
            r##"<line x1="0" y1="0" x2="18" y2="0" stroke="#3b4cc0" stroke-width="1.6"/>"##,
        ),
        (
            "pressure the policy used",
            r##"<line x1="0" y1="0" x2="18" y2="0" stroke="#d1495b" stroke-width="1.6" stroke-dasharray="4,2"/>"##,
        ),
        (
            "spot KV (sim)",
            r##"<line x1="0" y1="0" x2="18" y2="0" stroke="#999" stroke-width="1"/>"##,
        ),
        (
            "admission level on-demand / spot (adaptive; 0 at the bottom, 6 steps at the top)",
            r##"<line x1="0" y1="0" x2="18" y2="0" stroke="#2a9d3f" stroke-width="2.2"/>"##,
        ),
    ] {
        let _ = writeln!(
            s,
            r#"<g transform="translate({lx},{ly})">{swatch}<text x="22" y="4">{label}</text></g>"#
        );
        lx += 40.0 + label.len() as f64 * 5.6;
    }
    for t in Tier::ALL {
        let _ = writeln!(
            s,
            r#"<g transform="translate({lx},{ly})"><circle cx="6" cy="0" r="3" fill="{}"/><text x="13" y="4">{}</text></g>"#,
            tier_color(t),
            t.as_str()
        );
        lx += 30.0 + t.as_str().len() as f64 * 6.0;
    }
    for (label, st) in [
        ("Normal", PressureState::Normal),
        ("Elevated", PressureState::Elevated),
        ("Critical", PressureState::Critical),
    ] {
        let _ = writeln!(
            s,
            r#"<g transform="translate({lx},{})"><rect width="12" height="9" fill="{}"/><text x="15" y="8">{label}</text></g>"#,
            ly - 5.0,
            state_color(st)
        );
        lx += 25.0 + label.len() as f64 * 6.0;
    }
    for (i, run) in runs.iter().enumerate() {
        let y0 = HEADER_H + PANEL_H * i as f64;
        panel(&mut s, run, y0, end_ms, &x);
    }
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, run: &Run, y0: f64, end_ms: f64, x: &dyn Fn(f64) -> f64) {
    let sum = report::summarize(run);
    let mut head = format!("{} ({})", run.mode.as_str(), run.engine);
    for t in &sum.tiers {
        let _ = write!(
            head,
            " · {} {}% viol",
            t.tier,
            report::fmt_opt(t.viol_all_pct, 1)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="{}" font-size="12" font-weight="bold">{}</text>"#,
        y0 + 14.0,
        esc(&head)
    );

    // Pressure lane.
    let (p_top, p_h) = (y0 + 24.0, 80.0);
    let py = |v: f64| p_top + p_h * (1.0 - (v / 100.0).clamp(0.0, 1.0));
    frame(s, p_top, p_h, "KV %");
    for v in [0.0, 50.0, 100.0] {
        grid_line(s, LEFT, W - RIGHT, py(v), &format!("{v:.0}"));
    }
    let series = |f: &dyn Fn(&crate::record::Sample) -> Option<f64>| -> Vec<(f64, Option<f64>)> {
        run.samples
            .iter()
            .map(|smp| (x(smp.t_ms as f64), f(smp).map(py)))
            .collect()
    };
    polyline(
        s,
        &series(&|m| m.kv_spot),
        r##"stroke="#999" stroke-width="1""##,
    );
    polyline(
        s,
        &series(&|m| m.kv_on_demand),
        r##"stroke="#3b4cc0" stroke-width="1.6""##,
    );
    polyline(
        s,
        &series(&|m| m.policy_pressure),
        r##"stroke="#d1495b" stroke-width="1.6" stroke-dasharray="4,2""##,
    );
    // The adaptive controller's level shares the lane: 0–LEVEL_MAX steps over 0–100.
    let level =
        |i: usize| move |m: &crate::record::Sample| m.levels.map(|l| 100.0 * l[i] / LEVEL_MAX);
    polyline(
        s,
        &series(&level(1)),
        r##"stroke="#2a9d3f" stroke-width="1.2" stroke-dasharray="2,2""##,
    );
    polyline(
        s,
        &series(&level(0)),
        r##"stroke="#2a9d3f" stroke-width="2.2""##,
    );

    // State lane: Guaranteed, Standard, Best-Effort, fallback.
    let (st_top, row) = (y0 + 114.0, 12.0);
    let labels = ["Guaranteed", "Standard", "Best-Effort", "fallback"];
    for (i, l) in labels.iter().enumerate() {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#444" font-size="10">{l}</text>"##,
            LEFT - 4.0,
            st_top + row * i as f64 + 9.5
        );
    }
    let has_states = run.samples.iter().any(|m| m.states.is_some());
    if !has_states {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{:.1}" fill="#888">no proxy: no tier states</text>"##,
            LEFT + 6.0,
            st_top + 27.0
        );
    }
    for w in run.samples.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let (xa, xb) = (x(a.t_ms as f64), x(b.t_ms as f64));
        if let Some(st) = a.states {
            for t in Tier::ALL {
                let _ = writeln!(
                    s,
                    r#"<rect x="{xa:.1}" y="{:.1}" width="{:.2}" height="{}" fill="{}"/>"#,
                    st_top + row * t.index() as f64,
                    (xb - xa).max(0.5),
                    row - 2.0,
                    state_color(st[t.index()])
                );
            }
        }
        if a.fallback_active == Some(true) {
            let _ = writeln!(
                s,
                r##"<rect x="{xa:.1}" y="{:.1}" width="{:.2}" height="{}" fill="#8e6fd1"/>"##,
                st_top + row * 3.0,
                (xb - xa).max(0.5),
                row - 2.0
            );
        }
    }

    // Latency lane, log scale, with each tier's SLA target.
    let (l_top, l_h) = (y0 + 170.0, 130.0);
    let (lo, hi) = (LAT_MIN_MS.log10(), LAT_MAX_MS.log10());
    let ly = |ms: f64| {
        l_top + l_h * (1.0 - ((ms.max(LAT_MIN_MS).log10() - lo) / (hi - lo)).clamp(0.0, 1.0))
    };
    frame(s, l_top, l_h, "latency");
    for v in [100.0, 1000.0, 10_000.0] {
        let label = if v >= 1000.0 {
            format!("{} s", v / 1000.0)
        } else {
            format!("{v} ms")
        };
        grid_line(s, LEFT, W - RIGHT, ly(v), &label);
    }
    // (An objective in TTFT / TPOT has no end-to-end line to draw.)
    for t in Tier::ALL {
        let Some(e2e) = run.slo[t.index()].e2e_ms else {
            continue;
        };
        let y = ly(e2e as f64);
        let _ = writeln!(
            s,
            r#"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="{}" stroke-dasharray="6,3" stroke-width="0.8"/>"#,
            W - RIGHT,
            tier_color(t)
        );
    }
    let rej_y = l_top + l_h + 10.0;
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#444" font-size="10">rejected</text>"##,
        LEFT - 4.0,
        rej_y + 3.0
    );
    for r in &run.records {
        let cx = x(r.at_ms as f64);
        let color = tier_color(r.tier);
        if r.completed() {
            let _ = writeln!(
                s,
                r#"<circle cx="{cx:.1}" cy="{:.1}" r="1.7" fill="{color}" fill-opacity="0.75"/>"#,
                ly(r.latency_ms)
            );
        } else {
            let dy = r.tier.index() as f64 * 3.0 - 3.0;
            let _ = writeln!(
                s,
                r#"<line x1="{cx:.1}" x2="{cx:.1}" y1="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="1"/>"#,
                rej_y + dy - 2.5,
                rej_y + dy + 2.5
            );
        }
    }
    // Time axis.
    let axis_y = rej_y + 12.0;
    let step = if end_ms > 120_000.0 {
        30_000.0
    } else {
        10_000.0
    };
    let mut t = 0.0;
    while t <= end_ms {
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{}" y2="{}" stroke="#bbb"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="#666">{} s</text>"##,
            axis_y - 4.0,
            axis_y,
            axis_y + 11.0,
            t / 1000.0,
            x = x(t)
        );
        t += step;
    }
    if let Some(m) = run.recovery_marker_ms {
        let xm = x(m as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{xm:.1}" x2="{xm:.1}" y1="{}" y2="{}" stroke="#555" stroke-dasharray="2,3"/><text x="{:.1}" y="{:.1}" fill="#555" font-size="10">recovery marker</text>"##,
            y0 + 20.0,
            axis_y - 4.0,
            xm + 3.0,
            y0 + 30.0
        );
    }
}

fn frame(s: &mut String, top: f64, h: f64, label: &str) {
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{:.1}" height="{h:.1}" fill="none" stroke="#ccc"/>"##,
        W - LEFT - RIGHT
    );
    let _ = writeln!(
        s,
        r##"<text transform="translate(14,{:.1}) rotate(-90)" text-anchor="middle" fill="#444">{label}</text>"##,
        top + h / 2.0
    );
}

/// A horizontal grid line across the plot at height `y`, labelled on the left axis.
pub fn grid_line(s: &mut String, left: f64, right: f64, y: f64, label: &str) {
    let _ = writeln!(
        s,
        r##"<line x1="{left}" x2="{right}" y1="{y:.1}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end" fill="#666">{label}</text>"##,
        left - 4.0,
        y + 4.0
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polyline_splits_on_gaps() {
        let mut s = String::new();
        polyline(
            &mut s,
            &[
                (0.0, Some(1.0)),
                (1.0, Some(2.0)),
                (2.0, None),
                (3.0, Some(3.0)),
                (4.0, Some(4.0)),
            ],
            "",
        );
        assert_eq!(s.matches("<polyline").count(), 2);
    }
}
