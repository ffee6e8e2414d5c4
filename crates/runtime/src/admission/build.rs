//! Which coordinator a config asks for.

use super::control::{AdmissionControl, FairShareSettings};
use super::local::LocalAdmission;
use super::redis::{RedisAdmission, RedisSettings};
use pingora::services::ServiceWithDependents;
use sluice_config::Config;
use std::sync::Arc;

/// A coordinator and the background services to register with the server.
pub type Coordinator = (
    Arc<dyn AdmissionControl>,
    Vec<Box<dyn ServiceWithDependents>>,
);

/// The coordinator the config asks for, with any background services it needs: with
/// `redis_url`, the shared Redis coordinator plus its lease renewal and status refresher;
/// otherwise the in-process one.
pub fn build(cfg: &Config) -> Result<Coordinator, String> {
    let Some(url) = cfg.redis_url.as_deref() else {
        let local = LocalAdmission::with_fair_share(FairShareSettings::from_config(cfg));
        return Ok((Arc::new(local), Vec::new()));
    };
    let settings = RedisSettings::from_config(cfg, url, &crate::replica::replica_id());
    let coordinator = RedisAdmission::new(settings)?;
    let services = vec![coordinator.background_service()];
    Ok((Arc::new(coordinator), services))
}
