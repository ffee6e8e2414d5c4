//! What the operations listener reads: handles to the services, the same ones the request path
//! holds, and nothing of the request path itself.

use arc_swap::ArcSwap;
use sluice_config::Config;
use sluice_record::{DecisionQuery, DecisionSink};
use sluice_runtime::admission::AdmissionControl;
use sluice_runtime::lifecycle::Lifecycle;
use sluice_runtime::metrics::Metrics;
use sluice_runtime::pools::PoolSet;
use sluice_runtime::quota::Quotas;
use sluice_runtime::ring::DecisionRing;
use sluice_runtime::signals::SignalHub;
use std::sync::Arc;
use std::time::Instant;

pub struct OpsState {
    /// The admin token and the tiers' rules as reloaded.
    pub config: Arc<ArcSwap<Config>>,
    pub hub: Arc<SignalHub>,
    pub pools: Arc<PoolSet>,
    pub admission: Arc<dyn AdmissionControl>,
    pub quotas: Arc<Quotas>,
    pub metrics: Arc<Metrics>,
    /// This replica's newest decisions, when no ledger answers `/decisions/recent`.
    pub decisions: Arc<DecisionRing>,
    /// Answers `/decisions/recent` from durable storage when configured.
    pub query: Option<Arc<dyn DecisionQuery>>,
    /// The ledger's sinks, for their health in `/status`.
    pub sinks: Arc<[Arc<dyn DecisionSink>]>,
    pub lifecycle: Arc<Lifecycle>,
    /// The request path's tracer: its settings and export counters, for `/status` and
    /// `/metrics`.
    pub tracer: sluice_trace::Tracer,
    pub replica: &'static str,
    pub started: Instant,
}
