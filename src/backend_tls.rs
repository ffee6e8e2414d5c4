//! TLS from Sluice to its backends (`pools.<pool>.tls`, `https://` fallbacks).
//!
//! Each CA bundle is read once, at start, into the certificate list Pingora's rustls connector
//! takes per peer, and every TLS backend address gets its settings; [`crate::pools`] attaches
//! them to the address's Pingora `Backend`, so a request only copies an `Arc` and the server
//! name into its peer. Proxied requests, health checks and the `/metrics` scrape all connect
//! through Pingora with [`UpstreamTls::apply`], so the three cannot disagree about what a
//! backend's certificate must be.

use crate::config::Config;
use pingora::listeners::ALPN;
use pingora::protocols::tls::CaType;
use pingora::tls::{CertificateDer, RootCertStore};
use pingora::upstreams::peer::{HttpPeer, Scheme};
use pingora::utils::tls::WrappedX509;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use x509_parser::pem::Pem;
use x509_parser::prelude::{FromDer, X509Certificate};

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

/// The certificates of a PEM bundle, each checked to parse as X.509 and to be usable as a trust
/// anchor (Pingora adds them to a root store per connection; failing there would fail every
/// request instead of the start).
pub fn read_ca(path: &Path) -> Result<Arc<CaType>, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mut certs = Vec::new();
    for (i, block) in Pem::iter_from_buffer(&bytes).enumerate() {
        let n = i + 1;
        let pem = block.map_err(|e| format!("{shown}: PEM block {n}: {e}"))?;
        if pem.label != "CERTIFICATE" {
            return Err(format!(
                "{shown}: PEM block {n} is a {}, not a CERTIFICATE",
                pem.label
            ));
        }
        RootCertStore::empty()
            .add(CertificateDer::from(pem.contents.as_slice()))
            .map_err(|e| format!("{shown}: certificate {n} is not usable as a CA: {e}"))?;
        let cert = WrappedX509::try_new(pem.contents, |der| {
            X509Certificate::from_der(der).map(|(_, c)| c)
        })
        .map_err(|e| format!("{shown}: certificate {n} is not valid X.509: {e}"))?;
        certs.push(cert);
    }
    if certs.is_empty() {
        return Err(format!(
            "{shown} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ));
    }
    Ok(Arc::from(certs))
}
