//! The durable decision ledger (PostgreSQL). Built only when `database_url` is configured;
//! without it Sluice keeps decisions in the in-memory ring.

use crate::config::Config;
use crate::decisions::{DecisionQuery, DecisionSink};
use crate::signals::SignalHub;
use pingora::services::ServiceWithDependents;
use std::sync::Arc;

/// What the ledger adds to the server: record sinks, a query backend for `/decisions/recent`,
/// and the background services (writer, SLA-rate computation, retention) to register.
#[derive(Default)]
pub struct LedgerParts {
    pub sinks: Vec<Arc<dyn DecisionSink>>,
    pub query: Option<Arc<dyn DecisionQuery>>,
    pub services: Vec<Box<dyn ServiceWithDependents>>,
}

pub fn build(cfg: &Config, _hub: Arc<SignalHub>) -> Result<LedgerParts, String> {
    if cfg.database_url.is_some() {
        log::warn!("database_url is set but this build keeps decisions in memory only");
    }
    Ok(LedgerParts::default())
}
