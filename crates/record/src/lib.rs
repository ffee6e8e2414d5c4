//! The decision record: what Sluice decided for one request and why, the policy inputs it
//! carries so `sluice replay` can decide it again, their packed binary codec (the ledger's
//! column) and the compact JSON line (the request log). Plain data: no I/O here.

pub mod binary;
pub mod decision;
mod escape;
pub mod inputs;
pub mod line;
pub mod outcome;
pub mod usage;

pub use decision::{DecisionQuery, DecisionRecord, DecisionSink, RecentFilter, SignalsUsed};
pub use inputs::PolicyInputs;
pub use outcome::{Failure, QueueOutcome, Verdict};
