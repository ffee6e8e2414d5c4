//! What became of a request, as closed sets: the decision header and record's `decision`, why a
//! proxied request failed, and how a wait in the tier's queue ended. Their string forms are
//! stable (headers, the ledger's columns, JSON lines): never rename one.

use serde::{Deserialize, Serialize};

macro_rules! closed_set {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $code:literal,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name { $($(#[$vdoc])* #[serde(rename = $code)] $variant,)* }
        closed_set!(@impl $name { $($variant => $code,)* });
    };
    (@impl $name:ident { $($variant:ident => $code:literal,)* }) => {

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            pub const fn as_str(self) -> &'static str {
                match self { $($name::$variant => $code,)* }
            }

            pub fn parse(s: &str) -> Option<Self> {
                match s { $($code => Some($name::$variant),)* _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// What Sluice did with a request (`x-sluice-decision`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Verdict {
    #[default]
    #[serde(rename = "pass")]
    Pass,
    /// `max_tokens` capped.
    #[serde(rename = "degrade")]
    Degrade,
    /// Moved to the fallback model.
    #[serde(rename = "fallback")]
    Fallback,
    /// Refused by the policy, a capacity, a quota or bad input.
    #[serde(rename = "reject")]
    Reject,
    /// Waited in the tier's queue (then served or refused).
    #[serde(rename = "queue")]
    Queue,
    /// Admitted, then failed on the way to or from the backend.
    #[serde(rename = "error")]
    Error,
}

closed_set! {
    @impl Verdict {
        Pass => "pass",
        Degrade => "degrade",
        Fallback => "fallback",
        Reject => "reject",
        Queue => "queue",
        Error => "error",
    }
}

closed_set! {
    /// Why a request that was not refused did not complete.
    Failure {
        /// Refused after the upstream was chosen (a body too large to pre-read, a late check).
        Refused => "refused",
        /// The client went away before the response was complete.
        ClientGone => "client_gone",
        ConnectError => "connect_error",
        UpstreamTimeout => "upstream_timeout",
        UpstreamError => "upstream_error",
        InternalError => "internal_error",
    }
}

closed_set! {
    /// How a wait in the tier's queue ended (the seed's lifecycle events).
    QueueOutcome {
        Released => "queue_released",
        TimedOut => "queue_timed_out",
        Dropped => "queue_dropped",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_text_and_json() {
        for v in Verdict::ALL {
            assert_eq!(Verdict::parse(v.as_str()), Some(*v));
            let json = serde_json::to_string(v).unwrap();
            assert_eq!(json, format!("\"{}\"", v.as_str()));
            assert_eq!(serde_json::from_str::<Verdict>(&json).unwrap(), *v);
        }
        for f in Failure::ALL {
            assert_eq!(Failure::parse(f.as_str()), Some(*f));
        }
        for q in QueueOutcome::ALL {
            assert_eq!(QueueOutcome::parse(q.as_str()), Some(*q));
        }
        assert_eq!(Verdict::parse("maybe"), None);
    }
}
