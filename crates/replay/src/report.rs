//! What `sluice replay` prints: a table per tier and per tenant for people, the same numbers
//! and every changed decision as JSON for machines, and in both the estimator and the limits
//! of the replay stated plainly.

use super::compare::{Fate, Notes, Outcome, Summaries, Summary};
use super::estimate;
use super::source::{Item, Skipped};
use super::time::format_ms;
use serde::Serialize;
use sluice_policy::PolicyMode;
use sluice_record::inputs::Decided;
use std::fmt::Write;

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    Ledger {
        schema: String,
        since_ms: u64,
        until_ms: u64,
    },
    Jsonl {
        path: String,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub config: String,
    pub mode: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct Records {
    /// Records read from the source.
    pub read: u64,
    pub replayed: u64,
    pub skipped: Skipped,
}

#[derive(Debug, Clone, Serialize)]
pub struct Change<'a> {
    pub request_id: &'a str,
    pub received_at: String,
    pub received_at_ms: u64,
    pub replica: &'a str,
    pub tenant: &'a str,
    pub tier: &'static str,
    pub recorded: Decided,
    pub candidate: Decided,
    pub recorded_outcome: Fate,
    pub estimated_outcome: Fate,
    pub recorded_latency_ms: Option<f64>,
    pub estimated_latency_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report<'a> {
    pub source: Source,
    pub candidate: Candidate,
    pub records: Records,
    pub state: Notes,
    #[serde(flatten)]
    pub summaries: Summaries,
    pub changes: Vec<Change<'a>>,
    pub estimator: &'static str,
    pub limitations: Vec<String>,
}

impl<'a> Report<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        source: Source,
        candidate: Candidate,
        read: u64,
        skipped: Skipped,
        items: &'a [Item],
        outcomes: &[Outcome],
        notes: Notes,
        summaries: Summaries,
    ) -> Self {
        let changes = items
            .iter()
            .zip(outcomes)
            .filter(|(_, o)| o.changed())
            .map(|(it, o)| Change {
                request_id: &it.request_id,
                received_at: format_ms(it.received_at_ms),
                received_at_ms: it.received_at_ms,
                replica: &it.replica,
                tenant: &it.tenant,
                tier: it.tier.as_str(),
                recorded: o.recorded,
                candidate: o.replayed,
                recorded_outcome: o.recorded_fate,
                estimated_outcome: o.replayed_fate,
                recorded_latency_ms: it.served.map(|s| s.latency_ms),
                estimated_latency_ms: o.estimated_ms,
            })
            .collect();
        let limitations = limitations(candidate.mode, &notes);
        Report {
            source,
            candidate,
            records: Records {
                read,
                replayed: items.len() as u64,
                skipped,
            },
            state: notes,
            summaries,
            changes,
            estimator: estimate::DESCRIPTION,
            limitations,
        }
    }

    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The human report; at most `show` changed decisions are listed one by one.
    pub fn text(&self, show: usize) -> String {
        let mut o = String::new();
        let src = match &self.source {
            Source::Ledger {
                schema,
                since_ms,
                until_ms,
            } => format!(
                "the ledger (schema {schema}) from {} to {}",
                format_ms(*since_ms),
                format_ms(*until_ms)
            ),
            Source::Jsonl { path } => path.clone(),
        };
        let r = &self.records;
        let _ = writeln!(
            o,
            "Replay of {} recorded decisions from {src}\nagainst {} ({} mode)\n",
            r.read, self.candidate.config, self.candidate.mode
        );
        let s = &r.skipped;
        let _ = writeln!(
            o,
            "decided again: {}; skipped: {} recorded without replay inputs (older Sluice), {} refused \
             before the policy ran, {} with inputs of another version; {} lines were not decision records",
            r.replayed, s.without_inputs, s.not_decided, s.other_version, s.other_lines
        );
        let n = &self.state;
        let modes: Vec<String> = n
            .recorded_modes
            .iter()
            .map(|(m, c)| format!("{c} {m}"))
            .collect();
        let _ = writeln!(o, "recorded in: {}", join_or(&modes, "nothing"));
        if self.candidate.mode == PolicyMode::Thresholds.as_str() {
            let _ = writeln!(
                o,
                "tier states: as recorded for {} decisions (same thresholds and stability rules); \
                 rebuilt for {} from {} recorded policy samples; fallback tracker rebuilt for {}",
                n.tier_state_recorded, n.tier_state_rebuilt, n.samples_rebuilt, n.fallback_rebuilt
            );
        } else {
            let _ = writeln!(
                o,
                "admission levels: as recorded, on the candidate's ladder (the controller is not re-run); \
                 {} decisions were recorded under other controller settings",
                n.level_under_other_knobs
            );
        }

        let t = &self.summaries.total;
        let (dr, dc, df) = t.deltas();
        let _ = writeln!(
            o,
            "\nchanged: {} of {} decisions ({} more only changed reason); refusals {dr:+}, caps {dc:+}, fallbacks {df:+}",
            t.changed, t.decisions, t.reason_only
        );
        let _ = writeln!(o, "\nper tier");
        table(&mut o, self.summaries.tiers.iter().map(|(k, v)| (*k, v)));
        let _ = writeln!(o, "\nper tenant");
        table(
            &mut o,
            self.summaries.tenants.iter().map(|(k, v)| (k.as_str(), v)),
        );

        if !t.transitions.is_empty() {
            let _ = writeln!(o, "\ndecisions that change (recorded -> candidate)");
            for (k, v) in &t.transitions {
                let _ = writeln!(o, "  {k:<22} {v:>8}");
            }
        }
        let sla = &t.sla;
        let _ = writeln!(
            o,
            "\nestimated SLA effect: {} late answers become refusals, {} on-time answers become refusals; \
             {} refusals would be served ({} estimated on time, {} late, {} without estimate); \
             {} late answers estimated on time and {} on-time answers estimated late under another action",
            sla.late_to_refused,
            sla.on_time_to_refused,
            sla.refused_to_on_time + sla.refused_to_late + sla.refused_to_unknown,
            sla.refused_to_on_time,
            sla.refused_to_late,
            sla.refused_to_unknown,
            sla.late_to_on_time,
            sla.on_time_to_late
        );
        let _ = writeln!(
            o,
            "served on time: {} recorded -> {} estimated; late: {} -> {}; refused by the policy: {} -> {}",
            sla.recorded.on_time,
            sla.estimated.on_time,
            sla.recorded.late,
            sla.estimated.late,
            sla.recorded.refused,
            sla.estimated.refused
        );

        if !self.changes.is_empty() {
            let _ = writeln!(
                o,
                "\nchanged decisions ({}, in arrival order{})",
                self.changes.len(),
                if self.changes.len() > show {
                    format!("; the first {show}, all with --format json")
                } else {
                    String::new()
                }
            );
            for c in self.changes.iter().take(show) {
                let latency =
                    |ms: Option<f64>| ms.map_or(String::new(), |ms| format!(" {ms:.0} ms"));
                let _ = writeln!(
                    o,
                    "  {}  {}  {}  {}: {} -> {}  ({}{} -> {}{})",
                    c.received_at,
                    c.request_id,
                    c.tenant,
                    c.tier,
                    decided(&c.recorded),
                    decided(&c.candidate),
                    c.recorded_outcome.as_str(),
                    latency(c.recorded_latency_ms),
                    c.estimated_outcome.as_str(),
                    latency(c.estimated_latency_ms),
                );
            }
        }
        let _ = writeln!(o, "\nestimator: {}", self.estimator);
        let _ = writeln!(o, "limits:");
        for l in &self.limitations {
            let _ = writeln!(o, "  - {l}");
        }
        o
    }
}

fn join_or(parts: &[String], empty: &str) -> String {
    if parts.is_empty() {
        empty.to_string()
    } else {
        parts.join(", ")
    }
}

fn decided(d: &Decided) -> String {
    let cap = d.cap.map_or(String::new(), |c| format!(" {c}"));
    format!(
        "{}{cap} {} [{}]",
        d.action.as_str(),
        d.pool.as_str(),
        d.reason.as_str()
    )
}

fn table<'a>(o: &mut String, rows: impl Iterator<Item = (&'a str, &'a Summary)>) {
    let _ = writeln!(
        o,
        "  {:<20} {:>9} {:>8} {:>16} {:>16} {:>16} {:>14} {:>14} {:>12} {:>15}",
        "",
        "decisions",
        "changed",
        "refusals",
        "caps",
        "fallbacks",
        "on time",
        "late",
        "late->refused",
        "refused->served"
    );
    for (name, s) in rows {
        let (dr, dc, df) = s.deltas();
        let moved = |a: u64, b: u64, d: i64| format!("{a}->{b} ({d:+})");
        let sla = &s.sla;
        let _ = writeln!(
            o,
            "  {:<20} {:>9} {:>8} {:>16} {:>16} {:>16} {:>14} {:>14} {:>12} {:>15}",
            name,
            s.decisions,
            s.changed,
            moved(s.recorded.reject, s.candidate.reject, dr),
            moved(s.recorded.degrade, s.candidate.degrade, dc),
            moved(s.recorded.fallback, s.candidate.fallback, df),
            format!("{}->{}", sla.recorded.on_time, sla.estimated.on_time),
            format!("{}->{}", sla.recorded.late, sla.estimated.late),
            sla.late_to_refused,
            sla.refused_to_on_time + sla.refused_to_late + sla.refused_to_unknown,
        );
    }
}

fn limitations(mode: &str, n: &Notes) -> Vec<String> {
    let mut l = vec![
        "Only the policy is decided again. Admission is not: tier capacities and the Standard \
         queue keep their recorded outcome (a request the policy admits either way and that was \
         then refused for capacity stays refused; a request the candidate refuses frees no slot \
         for another)."
            .to_string(),
        "No feedback: a changed decision does not change the signals, latencies or admission \
         levels that later requests saw, so the effect of shedding or capping on everyone else's \
         latency is not estimated."
            .to_string(),
        "Each request keeps the tier it was judged at (after any quota demotion); a changed \
         tenant-to-tier mapping or quota is not replayed."
            .to_string(),
        "Backend health and fallback availability are as recorded: a candidate without \
         fallbacks moves nothing to one, and a fallback it adds is not assumed usable."
            .to_string(),
    ];
    if mode == PolicyMode::Thresholds.as_str() {
        if n.tier_state_rebuilt + n.fallback_rebuilt > 0 {
            l.push(format!(
                "Tier states under the candidate's thresholds are rebuilt from the {} policy samples \
                 that requests saw; samples no request saw were not recorded, so with \
                 consecutive_samples above 1 or a cooldown a rebuilt transition can come a sample or \
                 two later than it would have.",
                n.samples_rebuilt
            ));
        }
    } else {
        l.push(
            "The adaptive controller is not re-run: each pool's recorded admission level is applied \
             to the candidate's ladder, as a hot reload would find it. Changes to policy.adaptive \
             (escalate_below, step sizes, window, quantile, ...) and to sla_target_ms move no level; \
             rails are re-checked against the recorded signals with the candidate's rail thresholds, \
             and a level a recorded rail raised stays raised. The work gate reads the recorded work \
             in flight and learned work limit."
                .to_string(),
        );
    }
    l
}
