//! `/decisions/recent` from PostgreSQL: every replica's decisions, not just this one's ring.
//! Fails fast (the proxy then answers from its ring) while the ledger is unreachable.

use super::writer::Ledger;
use async_trait::async_trait;
use sluice_record::decision::{DecisionQuery, RecentFilter};
use std::sync::Arc;

pub struct LedgerQuery(pub Arc<Ledger>);

#[async_trait]
impl DecisionQuery for LedgerQuery {
    async fn recent(&self, filter: &RecentFilter) -> Result<Vec<serde_json::Value>, String> {
        if !self.0.reachable() {
            return Err(format!("ledger unreachable: {}", self.0.last_error()));
        }
        let ledger = Arc::clone(&self.0);
        let filter = filter.clone();
        tokio::task::spawn_blocking(move || ledger.db().recent(&filter))
            .await
            .map_err(|e| e.to_string())?
    }
}
