//! Assembles the Pingora server: the proxy on the tenant-facing listeners, the operations
//! listener, one health-check service per pool, the signal sampler and the process's own
//! services. `serve` and `demo` both go through [`build`], so the demo runs what production runs.
//! Every service gets the handles it uses, nothing more.

use crate::services::{trace_export, DrainService, Drained, ReloadService};
use arc_swap::ArcSwap;
use pingora::server::configuration::Opt;
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;
use sluice_config::tenancy::TenantDirectory;
use sluice_config::tls::CertStore;
use sluice_config::Config;
use sluice_ops::{OpsServer, OpsState};
use sluice_policy::Clock;
use sluice_proxy::conn_guard::ConnGuard;
use sluice_proxy::{ProxyState, Sluice};
use sluice_runtime::backend_tls::BackendTls;
use sluice_runtime::lifecycle::Lifecycle;
use sluice_runtime::metrics::Metrics;
use sluice_runtime::pools::{ModelDiscovery, PoolSet};
use sluice_runtime::replica::replica_id;
use sluice_runtime::ring::DecisionRing;
use sluice_runtime::signals::scraper::SignalSampler;
use sluice_runtime::signals::SignalHub;
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

/// Builds the server. `config_path` enables SIGHUP reload of that file. The returned receiver
/// hears once the drain has finished with nothing left in flight (the process may then end
/// before Pingora's fixed grace period is over).
pub fn build(
    cfg: Config,
    flags: ServerFlags,
    config_path: Option<PathBuf>,
) -> Result<(Server, Drained), String> {
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

    let backend_tls = BackendTls::load(&cfg)?;
    let (pools, health_services) =
        PoolSet::build(&cfg, &backend_tls).map_err(|e| format!("building pools: {e}"))?;
    let hub = Arc::new(SignalHub::new(
        Clock::new(),
        cfg.signals.stale_after_ms,
        cfg.policy_rules(),
        pools.all().map(|h| h.name.clone()).collect(),
        pools.routes(),
    ));
    let (admission, admission_services) = sluice_runtime::admission::build(&cfg)?;
    let (quotas, quota_services) = sluice_runtime::quota::build(&cfg)?;
    let ledger = sluice_ledger::build(&cfg, Arc::clone(&hub))?;
    let tls_certs = cfg
        .listen_tls
        .iter()
        .map(|l| CertStore::load(&l.cert, &l.key).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("loading a TLS certificate: {e}"))?;
    let replica: &'static str = Box::leak(replica_id().into_boxed_str());
    let config = Arc::new(ArcSwap::from_pointee(cfg.clone()));
    let tenants = Arc::new(ArcSwap::from_pointee(TenantDirectory::from_config(&cfg)));
    let metrics = Arc::new(Metrics::new());
    let decisions = Arc::new(DecisionRing::new(cfg.decisions.ring_size));
    let sinks: Arc<[_]> = ledger.sinks.into();
    let lifecycle = Arc::new(Lifecycle::default());
    let (tracer, exporter) = sluice_trace::Tracer::from_config(&cfg.telemetry.tracing)
        .map_err(|e| format!("{}: {e}", cfg.source))?;
    if tracer.is_enabled() {
        let st = tracer.status();
        log::info!(
            "{}",
            serde_json::json!({"event": "tracing_enabled", "endpoint": st.endpoint,
                               "sampler": st.sampler, "ratio": st.ratio})
        );
    }

    let proxy_state = Arc::new(ProxyState {
        config: Arc::clone(&config),
        tenants: Arc::clone(&tenants),
        hub: Arc::clone(&hub),
        pools: Arc::clone(&pools),
        admission: Arc::clone(&admission),
        quotas: Arc::clone(&quotas),
        metrics: Arc::clone(&metrics),
        decisions: Arc::clone(&decisions),
        sinks: Arc::clone(&sinks),
        lifecycle: Arc::clone(&lifecycle),
        replica,
        id_prefix: sluice_proxy::admit::id_prefix(replica),
        tracer: tracer.clone(),
    });
    let proxy = pingora::proxy::http_proxy(
        &server.configuration,
        Sluice {
            app: Arc::clone(&proxy_state),
        },
    );
    let listeners: Vec<String> = cfg
        .listen
        .iter()
        .cloned()
        .chain(cfg.listen_tls.iter().map(|l| l.listen.clone()))
        .collect();
    let guard = ConnGuard::new(proxy, proxy_state, &listeners);
    let mut proxy = Service::new("sluice proxy".to_string(), guard);
    for addr in &cfg.listen {
        proxy.add_tcp(addr);
    }
    for (l, certs) in cfg.listen_tls.iter().zip(&tls_certs) {
        proxy.add_tls_with_settings(&l.listen, None, certs.settings());
    }
    server.add_service(proxy);

    let ops = OpsServer {
        state: Arc::new(OpsState {
            config: Arc::clone(&config),
            hub: Arc::clone(&hub),
            pools: Arc::clone(&pools),
            admission: Arc::clone(&admission),
            quotas: Arc::clone(&quotas),
            metrics,
            decisions,
            query: ledger.query,
            sinks: Arc::clone(&sinks),
            lifecycle: Arc::clone(&lifecycle),
            tracer,
            replica,
            started: Instant::now(),
        }),
    };
    let mut ops = Service::new("sluice ops".to_string(), ops);
    for addr in &cfg.ops_listen {
        ops.add_tcp(addr);
    }
    server.add_service(ops);

    for svc in health_services {
        server.add_service(svc);
    }
    let discovery_hub = Arc::clone(&hub);
    server.add_service(background_service(
        "model discovery",
        ModelDiscovery::new(
            Arc::clone(&pools),
            Duration::from_millis(cfg.routing.models_refresh_ms),
            Duration::from_millis(cfg.routing.models_timeout_ms),
            Box::new(move |routes| discovery_hub.set_routes(routes)),
        ),
    ));
    if cfg.signals.source.scrapes() {
        server.add_service(background_service(
            "signal sampler",
            SignalSampler::new(&cfg, Arc::clone(&hub), &backend_tls, pools.loads()),
        ));
    }
    server.add_services(sluice_runtime::signals::prometheus::services(
        &cfg,
        Arc::clone(&hub),
    ));
    server.add_services(admission_services);
    server.add_services(quota_services);
    let (trace_service, trace_flush) = exporter.map(trace_export).unzip();
    if let Some(svc) = trace_service {
        server.add_service(background_service("trace exporter", svc));
    }
    let (drain, drained) = DrainService::new(
        Arc::clone(&lifecycle),
        Arc::clone(&sinks),
        grace,
        server.watch_execution_phase(),
        trace_flush,
    );
    server.add_service(background_service("drain", drain));
    if let Some(path) = config_path {
        server.add_service(background_service(
            "reload",
            ReloadService {
                path,
                config,
                tenants,
                hub,
                quotas,
                tls_certs,
            },
        ));
    }
    server.add_services(ledger.services);
    Ok((server, drained))
}

/// One JSON object per line, written by the background log writer, never on the request path.
/// Request records (target `sluice::request`, enabled at info) bypass the formatter: the proxy
/// writes them to the writer itself; everything else is wrapped here.
pub fn init_logging() {
    use std::io::Write;
    let env = env_logger::Env::default().default_filter_or("info");
    let mut builder = env_logger::Builder::from_env(env);
    if let Some(w) = sluice_runtime::log_writer::stderr() {
        builder.target(env_logger::Target::Pipe(Box::new(
            sluice_runtime::log_writer::Pipe(w),
        )));
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
