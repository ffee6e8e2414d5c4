//! TLS from Sluice to its backends, against real processes: the simulator behind a TLS front
//! (this test's own, on rustls) whose certificate a test CA signs. A trusted backend serves
//! chat, passes its health checks and is scraped; a certificate from another CA or for another
//! name is refused unless `verify: false`; an `https://` fallback serves over TLS; `sluice check`
//! names a broken CA file.

mod common;
use common::pki::{make_ca, make_leaf};
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Terminates TLS on a free port and pipes each connection to a plain backend, as an ingress
/// or sidecar in front of vLLM does. Stops when dropped.
struct TlsFront {
    addr: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn tls_front(pki: &Path, leaf: &str, upstream: &str) -> TlsFront {
    use pingora::tls::{ServerConfig, TlsAcceptor};
    pingora::tls::install_default_crypto_provider();
    let (certs, key) = pingora::tls::load_certs_and_key_files(
        &pki.join(format!("{leaf}.pem")).display().to_string(),
        &pki.join(format!("{leaf}.key")).display().to_string(),
    )
    .unwrap()
    .unwrap();
    let config = ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let upstream = upstream.to_string();
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
            tokio::spawn(async move {
                // A client that refuses the certificate ends the handshake: nothing to pipe.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if let Ok(mut plain) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                }
            });
        }
    });
    TlsFront { addr, task }
}

/// A CA with a localhost / 127.0.0.1 server certificate (`server.pem`), and a second CA that
/// signed nothing of this backend's (`other/ca.pem`).
fn pki(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-btls-{tag}-{}", free_port()));
    std::fs::create_dir_all(dir.join("other")).unwrap();
    make_ca(&dir);
    make_leaf(&dir, "server");
    make_ca(&dir.join("other"));
    dir
}

/// On-demand's simulator behind a TLS front, a plain spot simulator, and the PKI.
struct Fleet {
    pki: PathBuf,
    od: Proc,
    sp: Proc,
    front: TlsFront,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.pki);
    }
}

async fn fleet(tag: &str) -> Fleet {
    let pki = pki(tag);
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let front = tls_front(&pki, "server", &od.addr).await;
    Fleet { pki, od, sp, front }
}

impl Fleet {
    /// A PKI file's path, as config text.
    fn file(&self, name: &str) -> String {
        self.pki.join(name).display().to_string()
    }

    /// Sluice with on-demand behind the front over TLS (`tls` merged into the pool's block).
    async fn sluice(&self, tls: Value, wait_ready: bool) -> Sluice {
        let mut cfg = config(&[&self.front.addr], &[&self.sp.addr]);
        let mut block = json!({"enabled": true});
        merge(&mut block, tls);
        merge(&mut cfg, json!({"pools": {"on-demand": {"tls": block}}}));
        serve_with(&cfg, &[], wait_ready).await
    }
}

/// On-demand's backend entry of `/status`.
async fn on_demand_backend(s: &Sluice) -> Value {
    let status = s.status().await;
    let pools = status["pools"].as_array().cloned().unwrap_or_default();
    let od = pools.iter().find(|p| p["name"] == "on-demand").unwrap();
    od["backends"][0].clone()
}

/// Waits until the on-demand backend's health check has failed with `error` in its reason.
async fn wait_refused(s: &Sluice, error: &str) -> Value {
    wait_for(
        Duration::from_secs(10),
        "the failed TLS health check",
        || async {
            let b = on_demand_backend(s).await;
            let failed = b["checked"] == true
                && b["healthy"] == false
                && b["last_error"].as_str().is_some_and(|e| e.contains(error));
            failed.then_some(b)
        },
    )
    .await
}

/// What a client sees when the only on-demand backend is refused and spot is down too (else
/// Guaranteed is served from spot once spot's first check passes): 503 with the JSON contract's
/// error, naming no address.
async fn assert_unavailable(s: &Sluice, front: &TlsFront) {
    let r = s
        .chat("support-bot", chat_body("llama-3-70b", Some(3)))
        .await;
    assert_eq!(r.status(), 503);
    let text = r.text().await.unwrap();
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "backend_unavailable", "{body}");
    let port = front.addr.rsplit(':').next().unwrap();
    assert!(
        !text.contains("127.0.0.1") && !text.contains(port),
        "the error must not name the backend: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_behind_tls_serves_chat_passes_health_checks_and_is_scraped() {
    let f = fleet("ok").await;
    // Ready means on-demand's backend has passed a health check: over TLS, the front only
    // speaks TLS.
    let s = f.sluice(json!({"ca_file": f.file("ca.pem")}), true).await;

    let r = s
        .chat("support-bot", chat_body("llama-3-70b", Some(3)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-pool"), "on-demand");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");
    assert_eq!(
        sim_stats(&f.od).await["received"],
        1,
        "the request reached vLLM"
    );

    let b = on_demand_backend(&s).await;
    assert_eq!(
        (b["healthy"].clone(), b["last_error"].clone()),
        (json!(true), Value::Null),
        "{b}"
    );
    // The scraper reads the simulator's KV usage through the same TLS settings.
    sim_admin(&f.od, "/admin/kv", json!({"usage": 0.42})).await;
    let scraped = wait_for(Duration::from_secs(10), "a scrape over TLS", || async {
        let st = s.status().await;
        let b = st["signals"]["on-demand"]["scraped_backends"][0].clone();
        (b["kv_usage"].as_f64().is_some_and(|kv| kv > 0.0)).then_some(b)
    })
    .await;
    assert_eq!(scraped["error"], Value::Null, "{scraped}");
    assert_eq!(scraped["backend"], f.front.addr.as_str());
    assert!(!s.log().contains("backend_tls_unverified"), "{}", s.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused() {
    let f = fleet("ca").await;
    sim_admin(&f.sp, "/admin/health", json!({"healthy": false})).await;
    let s = f
        .sluice(json!({"ca_file": f.file("other/ca.pem")}), false)
        .await;

    wait_refused(&s, "invalid peer certificate").await;
    assert_unavailable(&s, &f.front).await;
    assert_eq!(
        sim_stats(&f.od).await["received"],
        0,
        "nothing reached vLLM"
    );
    let log = s.log();
    let health = log
        .lines()
        .find(|l| l.contains("backend_health") && l.contains("invalid peer certificate"));
    assert!(
        health.is_some(),
        "the log names the certificate failure: {log}"
    );
    let scraped = wait_for(Duration::from_secs(10), "a refused scrape", || async {
        let st = s.status().await;
        let b = st["signals"]["on-demand"]["scraped_backends"][0].clone();
        b["error"].is_string().then_some(b)
    })
    .await;
    assert!(
        scraped["error"]
            .as_str()
            .unwrap()
            .contains("invalid peer certificate"),
        "the scraper refuses it too: {scraped}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_name_is_refused_unless_verify_is_off() {
    let f = fleet("sni").await;
    sim_admin(&f.sp, "/admin/health", json!({"healthy": false})).await;
    let wrong = json!({"ca_file": f.file("ca.pem"), "sni": "vllm.other.example"});
    let s = f.sluice(wrong, false).await;
    wait_refused(&s, r#"not valid for name "vllm.other.example""#).await;
    assert_unavailable(&s, &f.front).await;
    drop(s);

    // verify: false accepts the wrong name, and an unknown CA, with a warning at start.
    let unverified =
        json!({"ca_file": f.file("other/ca.pem"), "sni": "vllm.other.example", "verify": false});
    let s = f.sluice(unverified, true).await;
    let r = s
        .chat("support-bot", chat_body("llama-3-70b", Some(2)))
        .await;
    assert_eq!(r.status(), 200);
    let log = s.log();
    let warning = log.lines().find(|l| l.contains("backend_tls_unverified"));
    assert!(
        warning.is_some_and(|l| l.contains("WARN") && l.contains("pools.on-demand.tls")),
        "verify: false is warned about at start: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_fallback_serves_the_smaller_model_over_tls() {
    let f = fleet("fallback").await;
    let small = sim("llama-3-8b", &[]).await;
    let small_front = tls_front(&f.pki, "server", &small.addr).await;
    let mut cfg = config(&[&f.od.addr], &[&f.sp.addr]);
    merge(
        &mut cfg,
        json!({"fallbacks": [{"name": "small", "url": format!("https://{}", small_front.addr),
                              "model": "llama-3-8b", "tls": {"ca_file": f.file("ca.pem")}}]}),
    );
    let s = serve(&cfg).await;
    // Healthy means its TLS health check passed.
    s.activate_fallback("fallback:small").await;
    let r = s
        .chat("coding-assistant", chat_body("llama-3-70b", Some(5)))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-sluice-pool"), "fallback:small");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["model"], "llama-3-8b", "{body}");
    assert_eq!(
        sim_stats(&small).await["received"],
        1,
        "it went through the TLS front"
    );
}

#[test]
fn check_names_a_broken_ca_file_and_inconsistent_tls_settings() {
    let pki = pki("check");
    std::fs::write(pki.join("garbage.pem"), "not a certificate\n").unwrap();
    let ca = pki.join("ca.pem").display().to_string();
    let tls = |extra: Value| {
        let mut t = json!({"enabled": true});
        merge(&mut t, extra);
        json!({"pools": {"on-demand": {"backends": ["127.0.0.1:8001"], "tls": t}}})
    };
    let missing = pki.join("missing.pem").display().to_string();
    let garbage = pki.join("garbage.pem").display().to_string();
    let key = pki.join("server.key").display().to_string();
    for (cfg, at, reason) in [
        (
            tls(json!({"ca_file": missing})),
            "pools.on-demand.tls.ca_file",
            format!("cannot read {missing}"),
        ),
        (
            tls(json!({"ca_file": garbage})),
            "pools.on-demand.tls.ca_file",
            format!("{garbage} holds no PEM certificate"),
        ),
        (
            tls(json!({"ca_file": key})),
            "pools.on-demand.tls.ca_file",
            "not a CERTIFICATE".into(),
        ),
        (
            tls(json!({"sni": "not a name"})),
            "pools.on-demand.tls.sni",
            "is not a DNS name or IP address".into(),
        ),
        (
            json!({"pools": {"on-demand": {"backends": ["127.0.0.1:8001"], "tls": {"ca_file": ca}}}}),
            "pools.on-demand.tls.enabled",
            "set enabled: true".into(),
        ),
        (
            json!({"fallbacks": [{"name": "small", "url": "http://127.0.0.1:9001", "model": "m",
                                  "tls": {"ca_file": ca}}]}),
            "fallbacks[0].tls.enabled",
            "write https://".into(),
        ),
        (
            json!({"pools": {"on-demand": {"backends": ["127.0.0.1:8001"], "tls": {"enabled": true}},
                             "spot": {"backends": ["127.0.0.1:8001"]}}}),
            "pools.spot.tls",
            "also in pools.on-demand.tls with other TLS settings".into(),
        ),
    ] {
        let (dir, path) = write_config(&cfg);
        let out = sluice_check(&path);
        let err = String::from_utf8_lossy(&out.stderr);
        let want = format!("{}: {at}: ", path.display());
        assert!(
            !out.status.success() && err.contains(&want) && err.contains(&reason),
            "{cfg}: want {want}…{reason}, got {err}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    // A relative ca_file is read from the config's directory; an https:// fallback is TLS; an
    // IPv6 backend's server name is its address without brackets.
    let good = json!({
        "pools": {"on-demand": {"backends": ["localhost:8001"], "tls": {"enabled": true, "ca_file": "ca.pem"}},
                  "spot": {"backends": ["[::1]:8002"], "tls": {"enabled": true}}},
        "fallbacks": [{"name": "small", "url": "https://localhost:8001", "model": "m",
                       "tls": {"ca_file": "ca.pem"}}],
    });
    let (dir, path) = write_config(&good);
    std::fs::copy(pki.join("ca.pem"), dir.join("ca.pem")).unwrap();
    assert_check_ok(&path);
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(&pki);
}
