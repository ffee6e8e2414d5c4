//! TLS from Sluice to its backends (`pools.<pool>.tls`, `https://` fallbacks).
//!
//! Each CA bundle is read once, at start, into the certificate list Pingora's rustls connector
//! takes per peer, and every TLS backend address gets its settings; [`crate::pools`] attaches
//! them to the address's Pingora `Backend`, so a request only copies an `Arc` and the server
//! name into its peer. Proxied requests, health checks and the `/metrics` scrape all connect
//! through Pingora with [`UpstreamTls::apply`], so the three cannot disagree about what a
//! backend's certificate must be.

use pingora::listeners::ALPN;
use pingora::protocols::tls::CaType;
use pingora::upstreams::peer::{HttpPeer, Scheme};
use serde_json::json;
use sluice_config::tls::read_ca;
use sluice_config::Config;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

/// How one backend is reached over TLS.
#[derive(Debug)]
pub struct UpstreamTls {
    /// Sent as SNI and, with `verify`, required in the certificate.
    pub sni: String,
    pub verify: bool,
    /// `None`: the system's roots, which Pingora's connector loads once itself.
    ca: Option<Arc<CaType>>,
}

impl UpstreamTls {
    /// Makes `peer` a TLS peer with these settings.
    pub fn apply(&self, peer: &mut HttpPeer) {
        peer.scheme = Scheme::HTTPS;
        peer.sni.clone_from(&self.sni);
        peer.options.verify_cert = self.verify;
        peer.options.verify_hostname = self.verify;
        peer.options.ca = self.ca.clone();
        // Backends speak HTTP/1.1 (vLLM's uvicorn). Pingora's rustls connector also honours
        // `verify_cert: false` only on its per-peer path, which a set ALPN always takes.
        peer.options.alpn = ALPN::H1;
    }
}

/// The TLS settings of every TLS backend, by `host:port` as configured. Validation has made
/// sure one address has one setting wherever it is listed.
#[derive(Debug, Default)]
pub struct BackendTls(HashMap<String, Arc<UpstreamTls>>);

impl BackendTls {
    /// Reads each CA bundle once and warns, once per block, about `verify: false`.
    pub fn load(cfg: &Config) -> Result<Self, String> {
        let mut cas: HashMap<PathBuf, Arc<CaType>> = HashMap::new();
        let mut warned = HashSet::new();
        let mut map = HashMap::new();
        for t in cfg.backend_targets() {
            if !t.tls.enabled || map.contains_key(&t.addr) {
                continue;
            }
            let ca = match &t.tls.ca_file {
                None => None,
                Some(path) => Some(match cas.get(path) {
                    Some(ca) => Arc::clone(ca),
                    None => {
                        let ca =
                            read_ca(path).map_err(|e| format!("{}.ca_file: {e}", t.tls_key))?;
                        cas.insert(path.clone(), Arc::clone(&ca));
                        ca
                    }
                }),
            };
            if !t.tls.verify && warned.insert(t.tls_key.clone()) {
                log::warn!(
                    "{}",
                    json!({"event": "backend_tls_unverified", "key": t.tls_key,
                           "warning": "verify: false: backend certificates are not checked, so anyone on the network path can read and alter prompts and answers"})
                );
            }
            let tls = UpstreamTls {
                sni: t.tls.server_name(&t.addr),
                verify: t.tls.verify,
                ca,
            };
            map.insert(t.addr, Arc::new(tls));
        }
        Ok(BackendTls(map))
    }

    pub fn get(&self, addr: &str) -> Option<&Arc<UpstreamTls>> {
        self.0.get(addr)
    }
}
