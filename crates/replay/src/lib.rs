//! `sluice replay`: recorded traffic decided again by the pure policy under another config, so
//! an operator sees what new thresholds would have done before reloading them.
//!
//! What each decision record carries for this (`sluice_record::PolicyInputs`, captured on the
//! request path) and its packed form live in the record crate; here:
//! * [`command`]: the `sluice replay` command line and its run.
//! * [`source`]: reading records (the ledger, JSONL) into replay [`source::Item`]s.
//! * [`rederive`]: thresholds-mode tier states rebuilt under the candidate's rules.
//! * [`compare`]: the replay itself and the per-tier / per-tenant summaries (pure).
//! * [`estimate`]: the latency of a request under a decision it did not get.
//! * [`report`]: text and JSON output.

pub mod command;
pub mod compare;
pub mod estimate;
pub mod rederive;
pub mod report;
pub mod source;
pub mod time;

pub use command::{run, ReplayArgs};
