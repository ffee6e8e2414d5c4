//! TLS on the client listeners, through Pingora's `rustls` feature (ring as the crypto
//! provider: it needs only a C compiler, which the build already requires, where OpenSSL needs
//! its headers and BoringSSL needs Go, Clang and Perl).
//!
//! Each `listen_tls` entry gets a [`CertStore`]: rustls asks it for the certificate on every
//! handshake, and `SIGHUP` swaps a freshly read certificate and key in, so renewing a
//! certificate needs no restart. After a binary upgrade the new process reads the same files
//! (the handed-over sockets are plain TCP; TLS is set up per connection).
//!
//! And the CA bundles that backends' TLS trusts ([`read_ca`]), read once at start and checked
//! with the config, so a bad bundle fails `sluice check` rather than every request.

use arc_swap::ArcSwap;
use pingora::listeners::tls::TlsSettings;
use pingora::listeners::ALPN;
use pingora::protocols::tls::CaType;
use pingora::tls::sign::CertifiedKey;
use pingora::tls::{CertificateDer, RootCertStore};
use pingora::tls::{ClientHello, CryptoProvider, ResolvesServerCert};
use pingora::utils::tls::WrappedX509;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use x509_parser::pem::Pem;
use x509_parser::prelude::{FromDer, X509Certificate};

/// The certificate a TLS listener presents, reloadable.
#[derive(Debug)]
pub struct CertStore {
    cert: PathBuf,
    key: PathBuf,
    current: ArcSwap<CertifiedKey>,
}

impl CertStore {
    pub fn load(cert: &Path, key: &Path) -> Result<Self, String> {
        let current = load_certified_key(cert, key).map_err(|(_, reason)| reason)?;
        Ok(CertStore {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: ArcSwap::from_pointee(current),
        })
    }

    /// Re-reads the files; on any error the certificate in use stays.
    pub fn reload(&self) -> Result<(), String> {
        let fresh = load_certified_key(&self.cert, &self.key).map_err(|(_, reason)| reason)?;
        self.current.store(Arc::new(fresh));
        Ok(())
    }

    /// Pingora listener settings presenting this store's certificate, HTTP/1.1 only (the
    /// connection guard's checks are HTTP/1's).
    pub fn settings(self: &Arc<Self>) -> TlsSettings {
        // `intermediate` only records the paths, which the resolver makes unused.
        let mut s = TlsSettings::intermediate("", "").expect("infallible constructor");
        s.set_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        s.set_alpn(ALPN::H1);
        s
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// Reads a PEM certificate chain and private key. The error names the file at fault (`cert`
/// or `key`) and why.
pub fn load_certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, (&'static str, String)> {
    pingora::tls::install_default_crypto_provider();
    for (which, path, marker) in [
        ("cert", cert, "-----BEGIN CERTIFICATE-----"),
        ("key", key, "PRIVATE KEY-----"),
    ] {
        let text = std::fs::read_to_string(path)
            .map_err(|e| (which, format!("cannot read {}: {e}", path.display())))?;
        if !text.contains(marker) {
            return Err((
                which,
                format!("{} holds no PEM {which} ({marker})", path.display()),
            ));
        }
    }
    let (certs, private) =
        pingora::tls::load_certs_and_key_files(&cert.to_string_lossy(), &key.to_string_lossy())
            .ok()
            .flatten()
            .ok_or((
                "cert",
                format!(
                    "cannot parse {} and {} as a PEM chain and key",
                    cert.display(),
                    key.display()
                ),
            ))?;
    let provider = CryptoProvider::get_default()
        .ok_or(("key", "no TLS crypto provider installed".to_string()))?;
    let signing = provider
        .key_provider
        .load_private_key(private)
        .map_err(|e| ("key", format!("{} is not a usable key: {e}", key.display())))?;
    let certified = CertifiedKey::new(certs, signing);
    certified.keys_match().map_err(|e| {
        (
            "key",
            format!("{} does not match {}: {e}", key.display(), cert.display()),
        )
    })?;
    Ok(certified)
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
