//! What `sluice replay` prints: a table per tier and per tenant for people, the same numbers
//! and every changed decision as JSON for machines, and in both the estimator and the limits
//! of the replay stated plainly.

use super::compare::{missed_label, Attainments, Fate, Notes, Outcome, Summaries, Summary, Tally};
use super::estimate;
use super::source::{Item, Skipped};
use super::time::format_ms;
use serde::Serialize;
use sluice_policy::slo::Dim;
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
    /// A streamed answer's time to first token and per output token, recorded and borrowed.
    pub recorded_ttft_ms: Option<f64>,
    pub estimated_ttft_ms: Option<f64>,
    pub recorded_tpot_ms: Option<f64>,
    pub estimated_tpot_ms: Option<f64>,
    /// The dimensions missed (`"ttft,tpot"`), recorded and estimated.
    pub recorded_missed: Option<&'static str>,
    pub estimated_missed: Option<&'static str>,
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
                recorded_latency_ms: it.served.map(|s| s.measured.latency_ms),
                estimated_latency_ms: o.estimated_ms,
                recorded_ttft_ms: it.served.and_then(|s| s.measured.ttft_ms),
                estimated_ttft_ms: o.estimated.and_then(|m| m.ttft_ms),
                recorded_tpot_ms: it.served.and_then(|s| s.measured.tpot_ms),
                estimated_tpot_ms: o.estimated.and_then(|m| m.tpot_ms),
                recorded_missed: missed_label(&o.recorded_marks),
                estimated_missed: missed_label(&o.replayed_marks),
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
        let _ = writeln!(
            o,
            "\nattainment per tier: share of answers on time, recorded -> estimated, on each \
             dimension of the candidate's objective (ttft, tpot, e2e) and overall"
        );
        attainment_table(
            &mut o,
            self.summaries
                .tiers
                .iter()
                .map(|(k, v)| (*k, &v.attainment))
                .chain([("all", &t.attainment)]),
        );
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
                let _ = writeln!(
                    o,
                    "  {}  {}  {}  {}: {} -> {}  ({} -> {})",
                    c.received_at,
                    c.request_id,
                    c.tenant,
                    c.tier,
                    decided(&c.recorded),
                    decided(&c.candidate),
                    outcome(
                        c.recorded_outcome,
                        c.recorded_missed,
                        c.recorded_latency_ms,
                        c.recorded_ttft_ms
                    ),
                    outcome(
                        c.estimated_outcome,
                        c.estimated_missed,
                        c.estimated_latency_ms,
                        c.estimated_ttft_ms
                    ),
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

/// `late [ttft] 581 ms, first token 412 ms`: the fate, the dimensions missed, the latency and a
/// stream's first token.
fn outcome(fate: Fate, missed: Option<&str>, ms: Option<f64>, ttft: Option<f64>) -> String {
    let mut s = fate.as_str().to_string();
    if let Some(m) = missed {
        let _ = write!(s, " [{m}]");
    }
    if let Some(ms) = ms {
        let _ = write!(s, " {ms:.0} ms");
    }
    if let Some(t) = ttft {
        let _ = write!(s, ", first token {t:.0} ms");
    }
    s
}

/// `97.5%`, or `n/a` with nothing judged.
fn share(t: &Tally) -> String {
    t.share()
        .map_or("n/a".to_string(), |s| format!("{:.1}%", s * 100.0))
}

/// Per group: each dimension's share on time, recorded -> estimated (`-` for a dimension the
/// candidate does not set and nothing was recorded on), and overall.
fn attainment_table<'a>(o: &mut String, rows: impl Iterator<Item = (&'a str, &'a Attainments)>) {
    let _ = writeln!(
        o,
        "  {:<20} {:>17} {:>17} {:>17} {:>17}",
        "", "ttft", "tpot", "e2e", "overall"
    );
    for (name, a) in rows {
        let cell = |rec: &Tally, est: &Tally, shown: bool| {
            if shown {
                format!("{}->{}", share(rec), share(est))
            } else {
                "-".to_string()
            }
        };
        let dim = |d: Dim| {
            let (rec, est) = (a.recorded.dim(d), a.estimated.dim(d));
            cell(rec, est, a.in_force(d) || rec.judged > 0)
        };
        let _ = writeln!(
            o,
            "  {:<20} {:>17} {:>17} {:>17} {:>17}",
            name,
            dim(Dim::Ttft),
            dim(Dim::Tpot),
            dim(Dim::E2e),
            cell(&a.recorded.overall, &a.estimated.overall, true),
        );
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
         for another). So does a refusal for a first token the pool could not give in time \
         (reject_slo_unattainable), whatever the candidate's TTFT target."
            .to_string(),
        "A request asking for tighter targets (x-llm-d-slo-ttft-ms / x-llm-d-slo-tpot-ms) is \
         recorded with the targets it was judged on, not with what it asked: while the \
         candidate's objectives are the recorded ones it keeps them; under other objectives it \
         is judged on its tier's."
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
             (escalate_below, step sizes, window, quantile, ...) and to the tiers' objectives \
             (slo, sla_target_ms) move no level; \
             rails are re-checked against the recorded signals with the candidate's rail thresholds, \
             and a level a recorded rail raised stays raised. The work gate reads the recorded work \
             in flight and learned work limit."
                .to_string(),
        );
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::{replay, summarise};
    use crate::source::Served;
    use sluice_policy::slo::{Measured, Slo};
    use sluice_policy::tenant_policy::PolicyRules;
    use sluice_policy::Tier;

    #[test]
    fn attainment_is_shown_per_dimension_in_force_and_overall() {
        // Recorded under an end-to-end objective: four streams, all within it.
        let items: Vec<Item> = [200.0, 250.0, 400.0, 450.0]
            .into_iter()
            .enumerate()
            .map(|(i, ttft)| {
                let mut it = crate::compare::tests::item(Tier::Standard, i as u64);
                it.served = Some(Served {
                    measured: Measured {
                        latency_ms: ttft + 20.0 * 9.0,
                        ttft_ms: Some(ttft),
                        tpot_ms: Some(20.0),
                        completion_tokens: Some(10),
                        stream: true,
                    },
                    violated: false,
                    missed: [false; 3],
                });
                it
            })
            .collect();
        assert_eq!(items[0].recorded_slo(), Slo::e2e(1000));
        // The candidate judges Standard on a 300 ms first token and 50 ms a token instead.
        let mut rules = PolicyRules::default();
        rules.tiers[Tier::Standard.index()].slo = Slo {
            ttft_ms: Some(300),
            tpot_ms: Some(50),
            e2e_ms: None,
        };
        let r = replay(&items, &rules);
        let summaries = summarise(&items, &r.outcomes);
        let report = Report::new(
            Source::Jsonl {
                path: "recorded.jsonl".into(),
            },
            Candidate {
                config: "candidate.yaml".into(),
                mode: rules.mode.as_str(),
            },
            4,
            Skipped::default(),
            &items,
            &r.outcomes,
            r.notes,
            summaries,
        );
        let text = report.text(20);
        let table = text
            .split("attainment per tier")
            .nth(1)
            .and_then(|t| t.split("\nper tenant").next())
            .unwrap();
        let row = |name: &str| {
            table
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap()
                .split_whitespace()
                .skip(1)
                .collect::<Vec<_>>()
        };
        // TTFT and TPOT were not judged when recorded; e2e is no longer in force.
        assert_eq!(
            row("Standard"),
            ["n/a->50.0%", "n/a->100.0%", "100.0%->n/a", "100.0%->50.0%"],
            "{text}"
        );
        assert_eq!(row("Guaranteed"), ["-", "-", "-", "n/a->n/a"], "{text}");
        assert_eq!(row("all")[3], "100.0%->50.0%");

        let json: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        let a = &json["tiers"]["Standard"]["attainment"];
        assert_eq!(a["in_force"], serde_json::json!(["ttft", "tpot"]));
        assert_eq!(
            a["estimated"]["ttft"],
            serde_json::json!({"judged": 4, "on_time": 2, "unknown": 0, "share": 0.5})
        );
        assert_eq!(a["recorded"]["ttft"]["share"], serde_json::Value::Null);
        assert_eq!(a["recorded"]["e2e"]["on_time"], 4);
    }
}
