//! The connection to Redis as its two users (admission, quotas) need it: every call bounded
//! in time, reachability tracked from each outcome so callers can skip Redis during an outage
//! instead of paying a timeout per request, and the scripts loaded up front so request-path
//! calls are plain EVALSHA (after a Redis restart the first call of each script reloads it on
//! NOSCRIPT).

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, Script, ScriptInvocation};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Why a call to Redis did not give an answer.
#[derive(Debug, Clone, PartialEq)]
pub enum RedisError {
    /// No connection has been made yet (Redis was down at startup).
    NotConnected,
    /// Connecting or loading the scripts failed.
    Connect(String),
    /// No answer within the op timeout.
    Timeout(Duration),
    /// Redis answered with an error, or the connection broke mid-call.
    Command(String),
    /// The answer did not have the shape the script promises.
    Reply(String),
}

impl fmt::Display for RedisError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisError::NotConnected => f.write_str("not connected"),
            RedisError::Connect(e) => write!(f, "connecting: {e}"),
            RedisError::Timeout(t) => write!(f, "no answer within {} ms", t.as_millis()),
            RedisError::Command(e) | RedisError::Reply(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for RedisError {}

/// Which failed calls are tried once more within the same bound. After an outage the
/// connection manager first hands back its last failed reconnect; one retry reaches the new
/// server. A refused connection never carried the call, so retrying it cannot apply anything
/// twice; an I/O error may have lost a reply to a call that ran, which only idempotent
/// scripts can retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Retry {
    Refused,
    RefusedOrIo,
}

/// What the link logs when reachability flips, in its user's words.
pub struct Messages {
    pub up: &'static str,
    pub down: &'static str,
}

pub struct RedisLink {
    client: redis::Client,
    conn: ArcSwapOption<ConnectionManager>,
    op_timeout: Duration,
    /// Connection retries are left to the user's background loop on this period: the manager's
    /// own backoff starts at a second and would hold every call behind it.
    retry_every: Duration,
    scripts: Vec<&'static Script>,
    retry: Retry,
    messages: Messages,
    /// Cleared by any failed call, set again by any successful one.
    reachable: AtomicBool,
    /// The most recent failure, kept after recovery for diagnosis.
    last_error: Mutex<Option<String>>,
}

impl RedisLink {
    /// Parses the URL; nothing connects until [`connect`](Self::connect).
    pub fn open(
        url: &str,
        op_timeout: Duration,
        retry_every: Duration,
        scripts: Vec<&'static Script>,
        retry: Retry,
        messages: Messages,
    ) -> Result<Self, String> {
        let client = redis::Client::open(url).map_err(|e| format!("redis_url {url:?}: {e}"))?;
        Ok(RedisLink {
            client,
            conn: ArcSwapOption::empty(),
            op_timeout,
            retry_every,
            scripts,
            retry,
            messages,
            reachable: AtomicBool::new(false),
            last_error: Mutex::default(),
        })
    }

    pub fn reachable(&self) -> bool {
        self.reachable.load(Ordering::Acquire)
    }

    pub fn connected(&self) -> bool {
        self.conn.load().is_some()
    }

    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn mark_reachable(&self) {
        // Called on every successful call: one atomic, no lock, on the request path.
        if !self.reachable.swap(true, Ordering::AcqRel) {
            log::info!("{}", self.messages.up);
        }
    }

    /// Also for callers whose answer came back malformed.
    pub fn mark_unreachable(&self, error: &RedisError) {
        if self.reachable.swap(false, Ordering::AcqRel) {
            log::warn!("{}: {error}", self.messages.down);
        }
        *self
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(error.to_string());
    }

    /// One connection attempt, bounded in time, with the scripts loaded.
    pub async fn connect(&self) -> Result<(), RedisError> {
        match self.try_connect().await {
            Ok(conn) => {
                self.conn.store(Some(Arc::new(conn)));
                self.mark_reachable();
                Ok(())
            }
            Err(e) => {
                self.mark_unreachable(&e);
                Err(e)
            }
        }
    }

    async fn try_connect(&self) -> Result<ConnectionManager, RedisError> {
        let connect_timeout = (self.op_timeout * 4).max(Duration::from_secs(1));
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_max_delay(self.retry_every.as_millis() as u64)
            .set_connection_timeout(connect_timeout);
        let connecting = ConnectionManager::new_with_config(self.client.clone(), config);
        let mut conn = match tokio::time::timeout(connect_timeout, connecting).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(RedisError::Connect(e.to_string())),
            Err(_) => return Err(RedisError::Connect("timed out".into())),
        };
        for script in &self.scripts {
            match tokio::time::timeout(connect_timeout, script.load_async(&mut conn)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(RedisError::Connect(format!("loading scripts: {e}"))),
                Err(_) => return Err(RedisError::Connect("loading scripts: timed out".into())),
            }
        }
        Ok(conn)
    }

    /// Runs `op` on the shared connection within the op timeout; every outcome updates
    /// reachability.
    pub async fn bounded<T, F, Fut>(&self, op: F) -> Result<T, RedisError>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let out = match self.conn.load_full() {
            None => Err(RedisError::NotConnected),
            Some(conn) => {
                let conn = ConnectionManager::clone(&conn);
                let retry = self.retry;
                let attempt = async {
                    match op(conn.clone()).await {
                        Err(e)
                            if e.is_connection_refusal()
                                || (retry == Retry::RefusedOrIo && e.is_io_error()) =>
                        {
                            op(conn).await
                        }
                        out => out,
                    }
                };
                match tokio::time::timeout(self.op_timeout, attempt).await {
                    Ok(Ok(v)) => Ok(v),
                    Ok(Err(e)) => Err(RedisError::Command(e.to_string())),
                    Err(_) => Err(RedisError::Timeout(self.op_timeout)),
                }
            }
        };
        match &out {
            Ok(_) => self.mark_reachable(),
            Err(e) => self.mark_unreachable(e),
        }
        out
    }

    /// Runs a prepared script, bounded.
    pub async fn call<T: FromRedisValue>(
        &self,
        inv: &ScriptInvocation<'_>,
    ) -> Result<T, RedisError> {
        self.bounded(|mut conn| async move { inv.invoke_async(&mut conn).await })
            .await
    }
}
