//! Reason codes: every decision carries one, with a stable string form used in headers, JSON
//! bodies, logs, metrics and the ledger. The reason table of docs/api.md is checked against the same
//! list ([`Reason::ALL`]), so the two cannot drift.

use crate::types::SignalKind;

macro_rules! reasons {
    ($($variant:ident => $code:literal : $doc:literal,)*) => {
        /// Why a decision was made. `as_str` is a stable API: never rename a code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason { $(#[doc = $doc] $variant,)* }

        impl Reason {
            pub const ALL: &'static [Reason] = &[$(Reason::$variant,)*];
            pub fn as_str(self) -> &'static str {
                match self { $(Reason::$variant => $code,)* }
            }
            pub fn describe(self) -> &'static str {
                match self { $(Reason::$variant => $doc,)* }
            }
        }
    };
}

// Add new reasons at the end only: the ledger's binary replay inputs store a reason by its
// position in this list (src/replay/binary.rs pins it).
reasons! {
    BelowTierThreshold => "below_tier_pressure_threshold": "Every available signal is below the tier's thresholds.",
    EndpointNotShapeable => "endpoint_not_shapeable": "Not a POST/PUT/PATCH to a completions endpoint: forwarded untouched.",
    SignalsUnavailableFailOpen => "signals_unavailable_fail_open": "No signal is available: the policy fails open.",
    CachePressureUnavailableFailOpen => "cache_pressure_unavailable_fail_open": "KV-cache pressure is unavailable; the other signals are below thresholds.",
    ElevatedNoShaping => "elevated_no_shaping_step": "The tier is Elevated but has no degrade step configured.",
    BodyNotJsonForwarded => "body_not_json_forwarded": "The body is not JSON and no shaping was needed: forwarded untouched.",
    DegradePressure => "degrade_pressure_elevated": "KV-cache pressure put the tier in Elevated: max_tokens capped.",
    DegradeQueueDepth => "degrade_queue_depth_elevated": "vLLM's waiting queue put the tier in Elevated: max_tokens capped.",
    DegradeSlaRate => "degrade_sla_violation_rate_elevated": "The SLA-violation rate put the tier in Elevated: max_tokens capped.",
    FallbackSustainedPressure => "fallback_sustained_pressure": "Pressure has been sustained above the fallback threshold: model rewritten.",
    RejectPressure => "reject_pressure_critical": "KV-cache pressure put the tier in Critical.",
    RejectQueueDepth => "reject_queue_depth_critical": "vLLM's waiting queue put the tier in Critical.",
    RejectSlaRate => "reject_sla_violation_rate_critical": "The SLA-violation rate put the tier in Critical.",
    AdmittedWithinHeadroom => "admitted_slo_headroom": "Adaptive mode: the pool's admission level does not reach this request; admitted unchanged.",
    DegradeHeadroom => "degrade_slo_headroom": "Adaptive mode: this tier or a higher one is short of latency headroom on its pool: max_tokens capped.",
    DegradeBrownout => "degrade_brownout": "Adaptive mode: the level has reached this tier's deeper cap (brownout): max_tokens capped at brownout_max_tokens, a short answer in time rather than a move or a 429.",
    DegradeCacheFull => "degrade_cache_nearly_full": "Adaptive mode: the pool's KV-cache usage is at shape_pressure_at: every cap and brownout applies (max_tokens capped), nobody is refused for it.",
    FallbackHeadroom => "fallback_slo_headroom": "Adaptive mode: this tier or a higher one is short of latency headroom on its pool: moved to the fallback model.",
    ShedHeadroom => "reject_slo_headroom": "Adaptive mode: a higher tier is short of latency headroom on this pool: shed, lowest tier first.",
    DegradeWorkLimit => "degrade_work_limit": "Adaptive mode: the pool's work in flight would pass this tier's share of its work limit (predicted ceiling or learned limit): max_tokens capped to fit.",
    FallbackWorkLimit => "fallback_work_limit": "Adaptive mode: the pool's work in flight is at this tier's share of its work limit (predicted ceiling or learned limit): moved to the fallback model.",
    RejectWorkLimit => "reject_work_limit": "Adaptive mode: the pool's work in flight is at this tier's share of its work limit (predicted ceiling or learned limit), kept for the tiers above.",
    RailPressure => "reject_pressure_rail": "Adaptive mode: the pool's KV-cache usage is at its hard rail: every non-Guaranteed tier is shed at once.",
    RailQueueDepth => "reject_queue_depth_rail": "Adaptive mode: vLLM's waiting queue on the pool is at its hard rail: every non-Guaranteed tier is shed at once.",
    DemoteQuotaExceeded => "demote_quota_exceeded": "The tenant is over its budget (requests or tokens per minute): served as the next lower tier.",
    RejectQuotaExceeded => "reject_quota_exceeded": "The tenant is over its budget and its tier (Best-Effort) has no lower tier to serve it as.",
    TierAtCapacity => "tier_at_capacity": "The tier's in-flight capacity is full and the tier does not queue.",
    QueueReleased => "queue_released": "Waited in the tier's queue, then admitted when a slot freed.",
    QueueDropped => "queue_dropped": "The tier's in-flight capacity and its queue are both full.",
    QueueTimedOut => "queue_timed_out": "Waited in the queue until its deadline without a slot freeing.",
    CoordinatorFailOpen => "coordinator_unavailable_fail_open": "The admission coordinator (Redis) is unreachable: admitted without the shared bound.",
    Draining => "draining": "Sluice is shutting down: a request waiting for a slot is refused (one that finds a slot free is still served, and its connection closed).",
    RouteTierPool => "route_tier_pool": "Routed to the tier's preferred pool.",
    RouteSpotUnhealthy => "route_spot_unhealthy_evicted": "Spot has no healthy backend: routed to on-demand.",
    RouteSpotPressure => "route_spot_pressure_evicted": "Spot's own pressure is Critical: routed to on-demand.",
    RouteFallback => "route_fallback_backend": "Routed to the fallback model's backend.",
    UnknownTenant => "unknown_tenant": "No tenant could be resolved and unknown tenants are refused.",
    MissingApiKey => "missing_api_key": "An API key is required and none was given.",
    InvalidApiKey => "invalid_api_key": "The API key matches no configured key.",
    InvalidTenantHeader => "invalid_tenant_header": "X-Tenant-ID is not a printable ASCII name of at most 128 bytes.",
    BodyTooLarge => "body_too_large": "The request body exceeds the configured limit.",
    InvalidJson => "invalid_json": "The body is not JSON but the decision needs to rewrite it.",
    BackendUnavailable => "backend_unavailable": "No healthy backend in the chosen pool.",
    UpstreamError => "upstream_error": "The backend failed while the request was proxied.",
    ModelNotFound => "model_not_found": "No pool serves the requested model: answered 404 before any backend was contacted.",
    RouteNoSpotPool => "route_no_spot_pool": "No spot pool serves the requested model: routed to its on-demand pool.",
    ModelsListed => "models_listed": "GET /v1/models answered by Sluice: the models every pool serves.",
    ClientGone => "client_gone": "The client went away while its request waited in the queue: it leaves the queue and is never sent.",
    RejectSloUnattainable => "reject_slo_unattainable": "Adaptive mode: the pool's queue delay and prefill already put this request's first token past its TTFT target (its tier's, or a tighter one it asked for), or, for a whole answer, too late to be complete by its deadline decoding at the pool's pace: refused before it costs GPU time. Never Guaranteed.",
    FallbackCacheFilling => "fallback_cache_filling": "Adaptive mode: the pool's KV-cache usage is at fallback_pressure_at and the fallback runs on other capacity below it: moved to the fallback model, so the pool keeps room for the tiers above.",
    FallbackPoolReserved => "fallback_pool_reserved": "Adaptive mode, reserve_guaranteed_pool: Guaranteed's pool is busy, its TTFT target tight, and the fallback runs on other capacity that is calm (level 0, below fallback_pressure_at, its batch within half of its tiers' TPOT budgets): moved to the fallback model.",
    RejectPoolReserved => "reject_pool_reserved": "Adaptive mode, reserve_guaranteed_pool: Guaranteed's pool is busy, its TTFT target tight, and the fallback cannot take the request: refused, so the pool stays Guaranteed's. Never Guaranteed.",
    RouteGuaranteedOverflow => "route_guaranteed_overflow": "Adaptive mode, guaranteed_overflow_to_spot: Guaranteed's pool is busy and the spot pool serving its model is calm with room to lend: routed to spot.",
}

impl Reason {
    /// The reason for an intervention driven by `kind`.
    pub fn degrade(kind: SignalKind) -> Reason {
        match kind {
            SignalKind::Pressure => Reason::DegradePressure,
            SignalKind::QueueDepth => Reason::DegradeQueueDepth,
            SignalKind::SlaViolationRate => Reason::DegradeSlaRate,
        }
    }

    pub fn reject(kind: SignalKind) -> Reason {
        match kind {
            SignalKind::Pressure => Reason::RejectPressure,
            SignalKind::QueueDepth => Reason::RejectQueueDepth,
            SignalKind::SlaViolationRate => Reason::RejectSlaRate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn codes_are_unique_snake_case() {
        let mut seen = HashSet::new();
        for r in Reason::ALL {
            let code = r.as_str();
            assert!(seen.insert(code), "duplicate code {code}");
            assert!(
                code.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{code}"
            );
        }
    }
}
