//! The Prometheus poller's view of its server after each round, kept by the hub for `/status`
//! and `/readyz`'s dependencies.

use serde::Serialize;
use sluice_policy::Millis;

/// One query's outcome in the last round, for `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct QueryHealth {
    pub pool: &'static str,
    pub signal: &'static str,
    pub query: Option<String>,
    pub error: Option<String>,
    /// Hub-clock time of the last usable sample (rendered as an age).
    #[serde(skip)]
    pub last_good_at: Option<Millis>,
}

/// The poller's view of Prometheus after its last round.
#[derive(Debug, Clone)]
pub struct PrometheusHealth {
    pub url: String,
    pub rounds: u64,
    pub last_round_at: Millis,
    /// Every query of the last round got a proper API answer (data problems aside).
    pub answered: bool,
    /// Hub-clock time of the last round in which every query was answered.
    pub last_answered_at: Option<Millis>,
    pub last_error: Option<String>,
    pub last_error_at: Option<Millis>,
    pub queries: Vec<QueryHealth>,
}

impl PrometheusHealth {
    /// Up: the last round was answered and is recent enough to trust (`stale_after_ms`).
    pub fn up(&self, now: Millis, stale_after_ms: Millis) -> bool {
        self.answered && now.saturating_sub(self.last_round_at) <= stale_after_ms
    }

    /// `/status`'s view: times rendered as ages.
    pub fn view(&self, now: Millis, stale_after_ms: Millis) -> PrometheusStatus {
        let age = |t: Option<Millis>| t.map(|t| now.saturating_sub(t));
        PrometheusStatus {
            url: self.url.clone(),
            up: self.up(now, stale_after_ms),
            rounds: self.rounds,
            last_round_ms_ago: now.saturating_sub(self.last_round_at),
            last_answered_ms_ago: age(self.last_answered_at),
            last_error: self.last_error.clone(),
            last_error_ms_ago: age(self.last_error_at),
            queries: self
                .queries
                .iter()
                .map(|q| QueryStatus {
                    query: q.clone(),
                    last_good_ms_ago: age(q.last_good_at),
                })
                .collect(),
        }
    }
}

/// [`PrometheusHealth`] as `/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PrometheusStatus {
    pub url: String,
    pub up: bool,
    pub rounds: u64,
    pub last_round_ms_ago: Millis,
    pub last_answered_ms_ago: Option<Millis>,
    pub last_error: Option<String>,
    pub last_error_ms_ago: Option<Millis>,
    pub queries: Vec<QueryStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QueryStatus {
    #[serde(flatten)]
    pub query: QueryHealth,
    pub last_good_ms_ago: Option<Millis>,
}
