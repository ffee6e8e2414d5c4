//! Where recorded decisions come from — the ledger over a time range, or a JSONL file (`sluice
//! replay export`, the `sluice::request` log lines, a ledger spool segment, or a saved
//! `/decisions/recent` answer) — and what of each record replay keeps.

use serde::Serialize;
use sluice_policy::slo::{judge, Dim, Measured, Slo};
use sluice_policy::Tier;
use sluice_record::decision::DecisionRecord;
use sluice_record::inputs::{readable, PolicyInputs};
use std::io::BufRead;

/// One recorded decision, reduced to what replay reads.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub request_id: String,
    pub received_at_ms: u64,
    pub replica: String,
    pub tenant: String,
    /// The tier the policy judged.
    pub tier: Tier,
    pub inputs: PolicyInputs,
    /// Answered by a backend to the end: what was measured of it and how it was judged.
    pub served: Option<Served>,
    /// The targets it was judged against: its tier's end-to-end one, and its TTFT and TPOT ones
    /// (its tier's, or tighter ones it asked for).
    pub sla_target_ms: Option<u64>,
    pub ttft_target_ms: Option<u64>,
    pub tpot_target_ms: Option<u64>,
}

impl Item {
    /// The objective it was judged on as recorded.
    pub fn recorded_slo(&self) -> Slo {
        Slo {
            ttft_ms: self.ttft_target_ms,
            tpot_ms: self.tpot_target_ms,
            e2e_ms: self.sla_target_ms,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Served {
    /// Latency, a stream's TTFT and TPOT, completion tokens, streamed or whole.
    pub measured: Measured,
    /// It missed a dimension of its objective, as recorded.
    pub violated: bool,
    /// The dimensions it missed, as recorded ([`Dim::index`] order).
    pub missed: [bool; 3],
}

impl Served {
    /// A whole answer judged on end-to-end latency alone, as before TTFT and TPOT existed.
    pub fn e2e(latency_ms: f64, violated: bool) -> Self {
        Served {
            measured: Measured {
                latency_ms,
                ..Measured::default()
            },
            violated,
            missed: [false, false, violated],
        }
    }
}

/// The dimensions named in a record's `slo_missed` (`"ttft,tpot"`).
pub fn parse_missed(label: &str) -> [bool; 3] {
    let mut missed = [false; 3];
    for part in label.split(',') {
        if let Some(d) = Dim::ALL.into_iter().find(|d| d.as_str() == part.trim()) {
            missed[d.index()] = true;
        }
    }
    missed
}

/// Records read but not replayed, by why.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// Decided by the policy but written without inputs (by a Sluice older than replay).
    pub without_inputs: u64,
    /// Refused before the policy ran (authentication, bad input): nothing to decide again.
    pub not_decided: u64,
    /// Inputs of a format this build does not know.
    pub other_version: u64,
    /// JSONL lines that are not decision records (other log lines).
    pub other_lines: u64,
}

impl Skipped {
    pub fn records(&self) -> u64 {
        self.without_inputs + self.not_decided + self.other_version
    }
}

/// Keeps what replay needs of `r`, or counts why it cannot be replayed.
pub fn item_of(r: DecisionRecord, skipped: &mut Skipped) -> Option<Item> {
    let tier = Tier::parse(&r.tier);
    let Some(inputs) = r.inputs else {
        // A record with a tier state went through the policy; without one it was refused first.
        if tier.is_some() && !r.state.is_empty() {
            skipped.without_inputs += 1;
        } else {
            skipped.not_decided += 1;
        }
        return None;
    };
    if !readable(inputs.v) {
        skipped.other_version += 1;
        return None;
    }
    let recorded = Slo {
        ttft_ms: r.ttft_target_ms,
        tpot_ms: r.tpot_target_ms,
        e2e_ms: r.sla_target_ms,
    };
    // Judged, or proxied to the end without an error (an objective that judges nothing of it).
    let served = r.sla_violated.is_some() || (r.backend.is_some() && r.error.is_none());
    let served = served.then(|| {
        let measured = Measured {
            latency_ms: r.latency_ms,
            ttft_ms: r.ttft_ms,
            tpot_ms: r.tpot_ms,
            completion_tokens: r.completion_tokens,
            stream: r.stream,
        };
        let violated = r.sla_violated == Some(true);
        let missed = match r.slo_missed.as_deref() {
            Some(label) => parse_missed(label),
            // Written before `slo_missed` existed: judged on its end-to-end target alone.
            None if violated => {
                let j = judge(&recorded, &measured);
                if j.met() {
                    let mut m = [false; 3];
                    let d = recorded
                        .e2e_ms
                        .map_or(recorded.dims().next(), |_| Some(Dim::E2e));
                    if let Some(d) = d {
                        m[d.index()] = true;
                    }
                    m
                } else {
                    j.missed
                }
            }
            None => [false; 3],
        };
        Served {
            measured,
            violated,
            missed,
        }
    });
    Some(Item {
        served,
        sla_target_ms: r.sla_target_ms,
        ttft_target_ms: r.ttft_target_ms,
        tpot_target_ms: r.tpot_target_ms,
        request_id: r.request_id,
        received_at_ms: r.received_at_ms,
        replica: r.replica.into_owned(),
        tenant: r.tenant,
        tier: inputs.facts.tier,
        inputs,
    })
}

/// Reads decision records from JSONL. A line holding a `/decisions/recent` answer gives its
/// `decisions`; a line that is no decision record (another log line) is counted and skipped.
pub fn read_jsonl(
    reader: impl BufRead,
    skipped: &mut Skipped,
    mut each: impl FnMut(DecisionRecord),
) -> Result<(), String> {
    #[derive(serde::Deserialize)]
    struct Recent {
        decisions: Vec<DecisionRecord>,
    }
    for line in reader.lines() {
        let line = line.map_err(|e| e.to_string())?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str::<DecisionRecord>(line) {
            Ok(r) if !r.request_id.is_empty() => each(r),
            _ => match serde_json::from_str::<Recent>(line) {
                Ok(recent) => recent.decisions.into_iter().for_each(&mut each),
                Err(_) => skipped.other_lines += 1,
            },
        }
    }
    Ok(())
}

/// Arrival order; the id breaks ties so every run lists changes the same way.
pub fn sort(items: &mut [Item]) {
    items.sort_by(|a, b| (a.received_at_ms, &a.request_id).cmp(&(b.received_at_ms, &b.request_id)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_takes_records_recent_answers_and_skips_other_lines() {
        let text = r#"
{"request_id":"a","tier":"Standard","state":"Normal","received_at_ms":5}
[2024-05-01T00:00:00Z WARN sluice] something
{"event":"ledger_flush","rows":3}
{"source":"memory","decisions":[{"request_id":"b","tier":"Guaranteed"},{"request_id":"c","tier":"unknown"}]}
"#;
        let mut skipped = Skipped::default();
        let mut ids = Vec::new();
        read_jsonl(text.as_bytes(), &mut skipped, |r| ids.push(r.request_id)).unwrap();
        assert_eq!(ids, ["a", "b", "c"]);
        assert_eq!(skipped.other_lines, 2);
    }

    #[test]
    fn a_records_measurements_and_the_dimensions_it_missed_are_kept() {
        let inputs = super::super::compare::tests::item(Tier::Standard, 1).inputs;
        let base = DecisionRecord {
            request_id: "s".into(),
            tier: "Standard".into(),
            state: "Normal".into(),
            backend: Some("10.0.0.1:8000".into()),
            latency_ms: 900.0,
            completion_tokens: Some(40),
            stream: true,
            ttft_ms: Some(600.0),
            tpot_ms: Some(7.5),
            ttft_target_ms: Some(500),
            tpot_target_ms: Some(20),
            sla_violated: Some(true),
            slo_missed: Some("ttft".into()),
            inputs: Some(inputs),
            ..Default::default()
        };
        let mut skipped = Skipped::default();
        let it = item_of(base.clone(), &mut skipped).unwrap();
        let s = it.served.unwrap();
        assert_eq!(s.missed, [true, false, false]);
        assert!(s.violated && s.measured.stream);
        assert_eq!(
            (
                s.measured.ttft_ms,
                s.measured.tpot_ms,
                s.measured.completion_tokens
            ),
            (Some(600.0), Some(7.5), Some(40))
        );
        assert_eq!(
            it.recorded_slo(),
            Slo {
                ttft_ms: Some(500),
                tpot_ms: Some(20),
                e2e_ms: None
            }
        );
        // An older record: no slo_missed, judged on its end-to-end target.
        let old = DecisionRecord {
            ttft_ms: None,
            tpot_ms: None,
            ttft_target_ms: None,
            tpot_target_ms: None,
            slo_missed: None,
            sla_target_ms: Some(500),
            ..base.clone()
        };
        let s = item_of(old, &mut skipped).unwrap().served.unwrap();
        assert_eq!(s.missed, [false, false, true]);
        // Proxied to the end but judged on nothing (no dimension applied): served, on time.
        let unjudged = DecisionRecord {
            sla_violated: None,
            slo_missed: None,
            ..base.clone()
        };
        let s = item_of(unjudged, &mut skipped).unwrap().served.unwrap();
        assert_eq!((s.violated, s.missed), (false, [false; 3]));
        // Failed: not served.
        let failed = DecisionRecord {
            sla_violated: None,
            error: Some(sluice_record::Failure::UpstreamError),
            ..base
        };
        assert_eq!(item_of(failed, &mut skipped).unwrap().served, None);
        assert_eq!(parse_missed("ttft,tpot,e2e"), [true; 3]);
        assert_eq!(parse_missed("tpot"), [false, true, false]);
    }

    #[test]
    fn records_without_inputs_are_told_apart() {
        let mut skipped = Skipped::default();
        let decided = DecisionRecord {
            request_id: "a".into(),
            tier: "Standard".into(),
            state: "Normal".into(),
            ..Default::default()
        };
        assert!(item_of(decided, &mut skipped).is_none());
        let refused = DecisionRecord {
            request_id: "b".into(),
            tier: "unknown".into(),
            ..Default::default()
        };
        assert!(item_of(refused, &mut skipped).is_none());
        assert_eq!(
            skipped,
            Skipped {
                without_inputs: 1,
                not_decided: 1,
                ..Default::default()
            }
        );
    }
}
