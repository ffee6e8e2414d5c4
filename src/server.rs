//! Assembles the Pingora server: the proxy service on the configured listeners, one
//! health-check service per pool, and the signal sampler. `serve` and `demo` both go through
//! [`build`], so the demo runs exactly what production runs.

use crate::backend_tls::BackendTls;
use crate::config::Config;
use crate::decisions::DecisionRing;
use crate::lifecycle::{DrainService, ReloadService};
use crate::metrics::Metrics;
use crate::pools::PoolSet;
use crate::proxy::conn_guard::ConnGuard;
use crate::proxy::tls::CertStore;
use crate::proxy::{App, Sluice};
use crate::signals::scraper::SignalSampler;
use crate::signals::{Clock, SignalHub};
use crate::tenancy::TenantDirectory;
use arc_swap::ArcSwap;
use pingora::server::configuration::Opt;
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pingora's process-level flags, passed through from `sluice serve`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerFlags {
    pub upgrade: bool,
    pub daemon: bool,
    pub test: bool,
}

/// A name for this replica in records: the pod name under Kubernetes, else host and pid.
pub fn replica_id() -> String {
    std::env::var("SLUICE_REPLICA_ID")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "sluice".into())
        + &format!("-{}", std::process::id())
}

/// Builds the server. `config_path` enables SIGHUP reload of that file.
pub fn build(
    cfg: Config,
    flags: ServerFlags,
    config_path: Option<PathBuf>,
) -> Result<(Server, Arc<App>), String> {
    let conf = cfg.server_conf().map_err(|e| e.to_string())?;
    let grace = Duration::from_secs(conf.grace_period_seconds.unwrap_or(300));
    let opt = Opt {
        upgrade: flags.upgrade,
        daemon: flags.daemon,
        test: flags.test,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(Some(opt), conf);
    // Receives the listening fds from the old process with -u, and exits for -t.
    server.bootstrap();

    let hub = Arc::new(SignalHub::new(
        Clock::new(),
        cfg.signals.stale_after_ms,
        cfg.policy_rules(),
    ));
    let backend_tls = BackendTls::load(&cfg)?;
    let (pools, health_services) =
        PoolSet::build(&cfg, &backend_tls).map_err(|e| format!("building pools: {e}"))?;
    let (admission, admission_services) = crate::admission::build(&cfg)?;
    let (quotas, quota_services) = crate::quota::build(&cfg)?;
    let ledger = crate::ledger::build(&cfg, Arc::clone(&hub))?;
    let tls_certs = cfg
        .listen_tls
        .iter()
        .map(|l| CertStore::load(&l.cert, &l.key).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("loading a TLS certificate: {e}"))?;
    let replica = replica_id();
    let app = Arc::new(App {
        tls_certs: tls_certs.clone(),
        tenants: ArcSwap::from_pointee(TenantDirectory::from_config(&cfg)),
        hub: Arc::clone(&hub),
        pools,
        admission,
        quotas,
        metrics: Metrics::new(),
        decisions: DecisionRing::new(cfg.decisions.ring_size),
        sinks: ledger.sinks,
        query: ledger.query,
        id_prefix: crate::proxy::admit::id_prefix(&replica),
        replica: Box::leak(replica.into_boxed_str()),
        started: Instant::now(),
        active: Arc::default(),
        draining: tokio::sync::watch::channel(false).0,
        closing: Default::default(),
        config: ArcSwap::from_pointee(cfg.clone()),
    });

    let proxy = pingora::proxy::http_proxy(
        &server.configuration,
        Sluice {
            app: Arc::clone(&app),
        },
    );
    let listeners: Vec<String> = cfg
        .listen
        .iter()
        .cloned()
        .chain(cfg.listen_tls.iter().map(|l| l.listen.clone()))
        .collect();
    let guard = ConnGuard::new(proxy, Arc::clone(&app), &listeners);
    let mut proxy = Service::new("sluice proxy".to_string(), guard);
    for addr in &cfg.listen {
        proxy.add_tcp(addr);
    }
    for (l, certs) in cfg.listen_tls.iter().zip(&tls_certs) {
        proxy.add_tls_with_settings(&l.listen, None, certs.settings());
    }
    server.add_service(proxy);
    for svc in health_services {
        server.add_service(svc);
    }
    if cfg.signals.source.scrapes() {
        server.add_service(background_service(
            "signal sampler",
            SignalSampler::new(&cfg, Arc::clone(&hub), &backend_tls),
        ));
    }
    server.add_services(crate::signals::prometheus::services(&cfg, hub));
    server.add_services(admission_services);
    server.add_services(quota_services);
    let phases = std::sync::Mutex::new(Some(server.watch_execution_phase()));
    let drain = DrainService {
        app: Arc::clone(&app),
        grace,
        phases,
    };
    server.add_service(background_service("drain", drain));
    if let Some(path) = config_path {
        server.add_service(background_service(
            "reload",
            ReloadService {
                app: Arc::clone(&app),
                path,
            },
        ));
    }
    server.add_services(ledger.services);
    Ok((server, app))
}

/// One JSON object per line, written by the background log writer, never on the request path.
/// Request records (target `sluice::request`, enabled at info) bypass the formatter: the proxy
/// writes them to the writer itself; everything else is wrapped here.
pub fn init_logging() {
    use std::io::Write;
    let env = env_logger::Env::default().default_filter_or("info");
    let mut builder = env_logger::Builder::from_env(env);
    if let Some(w) = crate::log_writer::stderr() {
        builder.target(env_logger::Target::Pipe(Box::new(crate::log_writer::Pipe(
            w,
        ))));
    }
    let _ = builder
        .write_style(env_logger::WriteStyle::Never)
        .format(|buf, record| {
            let line = serde_json::json!({
                "level": record.level().as_str(),
                "target": record.target(),
                "message": record.args().to_string(),
            });
            writeln!(buf, "{line}")
        })
        .try_init();
}
