//! One request's budget check as the proxy carries it: the tier it is served as, the headers
//! it answers with, and the refusal body when it has no lower tier.

use serde_json::{json, Value};
use sluice_config::QuotaConfig;
use sluice_policy::bucket::{openai_duration, Verdict};
use sluice_policy::{Reason, Tier};

/// What a budget check decided for one request, kept in its context until `logging`.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub quota: QuotaConfig,
    pub verdict: Verdict,
    /// The tenant's own tier.
    pub home: Tier,
    /// The tier it is served as: one lower when over budget.
    pub served: Tier,
    /// Over budget with no lower tier: refused.
    pub refused: bool,
    /// Prompt tokens taken from the bucket; `None` when nothing was taken (over budget, or not
    /// a completion), so nothing is charged or refunded at the end.
    pub taken_tokens: Option<u64>,
}

impl Ticket {
    pub fn demoted(&self) -> bool {
        self.served != self.home
    }

    /// OpenAI's rate-limit headers, for the configured dimensions only.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(6);
        for (name, d) in self.verdict.dims() {
            let [limit, remaining, reset] = match name {
                "requests" => [
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ],
                _ => [
                    "x-ratelimit-limit-tokens",
                    "x-ratelimit-remaining-tokens",
                    "x-ratelimit-reset-tokens",
                ],
            };
            out.push((limit, d.limit.to_string()));
            out.push((remaining, d.remaining().to_string()));
            out.push((reset, openai_duration(d.full_in_ms())));
        }
        if self.demoted() {
            out.push(("x-sluice-demoted-from", self.home.as_str().to_string()));
        }
        out
    }

    /// Whole seconds until the tenant has room again (at least 1), for `retry-after`.
    pub fn retry_after_s(&self) -> u64 {
        self.verdict.room_in_ms().div_ceil(1000).max(1)
    }

    /// The 429 body when the tenant is refused, in OpenAI's rate-limit shape plus Sluice's
    /// `reason` and `tier`.
    pub fn refusal_body(&self, tenant: &str) -> Value {
        let short: Vec<String> = self
            .verdict
            .dims()
            .filter(|(_, d)| d.level < 1.0)
            .map(|(name, d)| format!("{name} per minute (limit {}, remaining 0)", d.limit))
            .collect();
        let retry = self.retry_after_s();
        json!({"error": {
            "type": "sluice_quota",
            "code": "rate_limit_exceeded",
            "reason": Reason::RejectQuotaExceeded.as_str(),
            "message": format!(
                "Tenant {tenant:?} is over its budget of {} and {} has no lower tier to be \
                 served as. Please try again in {retry}s.",
                short.join(" and "),
                self.home.as_str(),
            ),
            "tier": self.home.as_str(),
            "retry_after_seconds": retry,
        }})
    }
}

/// The next lower tier, if any.
pub fn lower(tier: Tier) -> Option<Tier> {
    match tier {
        Tier::Guaranteed => Some(Tier::Standard),
        Tier::Standard => Some(Tier::BestEffort),
        Tier::BestEffort => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Dim;

    fn ticket(home: Tier, served: Tier, requests: f64, tokens: Option<f64>) -> Ticket {
        let quota = QuotaConfig {
            requests_per_minute: Some(60),
            tokens_per_minute: tokens.map(|_| 6000),
        };
        let verdict = Verdict {
            room: requests >= 1.0,
            requests: Some(Dim {
                limit: 60,
                level: requests,
            }),
            tokens: tokens.map(|level| Dim { limit: 6000, level }),
        };
        Ticket {
            quota,
            verdict,
            home,
            served,
            refused: false,
            taken_tokens: None,
        }
    }

    #[test]
    fn headers_name_only_configured_dimensions_and_the_demotion() {
        let t = ticket(Tier::Guaranteed, Tier::Guaranteed, 59.0, None);
        assert_eq!(
            t.headers(),
            vec![
                ("x-ratelimit-limit-requests", "60".to_string()),
                ("x-ratelimit-remaining-requests", "59".to_string()),
                ("x-ratelimit-reset-requests", "1s".to_string()),
            ]
        );
        let t = ticket(Tier::Guaranteed, Tier::Standard, 0.5, Some(-300.0));
        let h: std::collections::HashMap<_, _> = t.headers().into_iter().collect();
        assert_eq!(h["x-ratelimit-remaining-requests"], "0");
        assert_eq!(h["x-ratelimit-reset-requests"], "59.5s");
        assert_eq!(h["x-ratelimit-remaining-tokens"], "0");
        assert_eq!(h["x-ratelimit-reset-tokens"], "1m3s");
        assert_eq!(h["x-sluice-demoted-from"], "Guaranteed");
    }

    #[test]
    fn a_refusal_says_which_budget_and_when_to_retry() {
        let mut t = ticket(Tier::BestEffort, Tier::BestEffort, 0.25, None);
        t.refused = true;
        assert_eq!(t.retry_after_s(), 1, "0.75 of a request at one a second");
        let body = t.refusal_body("batch");
        let e = &body["error"];
        assert_eq!(e["code"], "rate_limit_exceeded");
        assert_eq!(e["reason"], "reject_quota_exceeded");
        assert_eq!(e["tier"], "Best-Effort");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains("requests per minute (limit 60"), "{msg}");
        assert!(msg.contains("try again in 1s"), "{msg}");
        assert_eq!(lower(Tier::Guaranteed), Some(Tier::Standard));
        assert_eq!(lower(Tier::Standard), Some(Tier::BestEffort));
        assert_eq!(lower(Tier::BestEffort), None);
    }
}
