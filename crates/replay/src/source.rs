//! Where recorded decisions come from — the ledger over a time range, or a JSONL file (`sluice
//! replay export`, the `sluice::request` log lines, a ledger spool segment, or a saved
//! `/decisions/recent` answer) — and what of each record replay keeps.

use serde::Serialize;
use sluice_policy::Tier;
use sluice_record::decision::DecisionRecord;
use sluice_record::inputs::{PolicyInputs, VERSION};
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
    /// Answered by a backend to the end: its latency and whether it missed its target.
    pub served: Option<Served>,
    /// The target it was judged against.
    pub sla_target_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Served {
    pub latency_ms: f64,
    pub violated: bool,
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
    if inputs.v != VERSION {
        skipped.other_version += 1;
        return None;
    }
    Some(Item {
        served: r.sla_violated.map(|violated| Served {
            latency_ms: r.latency_ms,
            violated,
        }),
        sla_target_ms: r.sla_target_ms,
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
