//! One connection attempt to Redis as its two users (admission, quotas) need it: bounded in
//! time, with no built-in retries (their backoff starts at a second and would hold every call
//! behind it; each user's background loop retries on its own period instead), and the scripts
//! loaded up front so request-path calls are plain EVALSHA (after a Redis restart the first call
//! of each script reloads it on NOSCRIPT).

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use std::time::Duration;

pub async fn connect(
    client: &redis::Client,
    op_timeout: Duration,
    retry_every: Duration,
    scripts: &[&Script],
) -> Result<ConnectionManager, String> {
    let connect_timeout = (op_timeout * 4).max(Duration::from_secs(1));
    let config = ConnectionManagerConfig::new()
        .set_number_of_retries(0)
        .set_max_delay(retry_every.as_millis() as u64)
        .set_connection_timeout(connect_timeout);
    let connecting = ConnectionManager::new_with_config(client.clone(), config);
    let mut conn = match tokio::time::timeout(connect_timeout, connecting).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(format!("connecting: {e}")),
        Err(_) => return Err("connecting: timed out".into()),
    };
    for script in scripts {
        match tokio::time::timeout(connect_timeout, script.load_async(&mut conn)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("loading scripts: {e}")),
            Err(_) => return Err("loading scripts: timed out".into()),
        }
    }
    Ok(conn)
}
