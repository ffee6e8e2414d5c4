//! Operations on their own listener: the tenant-facing port serves only the API it proxies (an
//! ops path there reaches the backend like any other), and off loopback every operations
//! endpoint but the probes needs the admin token. The off-loopback peer is a network namespace
//! this test makes (a veth pair on a private /30 of its own), so its requests really come from
//! a non-loopback address.

mod common;
use common::*;
use serde_json::{json, Value};
use std::process::Command;

#[tokio::test]
async fn operations_are_not_served_on_the_tenant_listener() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    let c = client();
    // On the operations listener: Sluice's own answers.
    let status: Value = get_json(&s.ops_url("/status")).await;
    assert!(status["tiers"].is_array(), "{status}");
    let metrics = s.metrics().await;
    assert!(metrics.contains("sluice_admission_level"), "{metrics}");
    // On the tenant listener the same paths are the backend's: vLLM's metrics, and vLLM's 404
    // for a path it does not serve. Nothing of Sluice's state leaks there.
    let r = c
        .get(s.url("/metrics"))
        .header("x-tenant-id", "support-bot")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("vllm:num_requests_waiting"), "{text}");
    assert!(!text.contains("sluice_"), "{text}");
    for path in [
        "/status",
        "/decisions/recent",
        "/dashboard",
        "/admin/pressure",
    ] {
        let r = c
            .get(s.url(path))
            .header("x-tenant-id", "support-bot")
            .send()
            .await
            .unwrap();
        assert_ne!(r.status(), 200, "{path} answered on the tenant listener");
        let body = r.text().await.unwrap();
        assert!(
            !body.contains("admission_control") && !body.contains("\"decisions\""),
            "{path}: {body}"
        );
    }
    // Nor is an override possible there.
    let r = c
        .put(s.url("/admin/pressure"))
        .header("x-tenant-id", "support-bot")
        .json(&json!({"value": 99}))
        .send()
        .await
        .unwrap();
    assert_ne!(r.status(), 200);
    assert_eq!(
        s.status().await["signals"]["on-demand"]["pressure"]["source"],
        "scrape"
    );
}

/// A network namespace joined to this host by a veth pair, removed on drop.
struct Peer {
    ns: String,
    host_if: String,
    host_ip: String,
}

impl Peer {
    fn new() -> Peer {
        let id = std::process::id() % 50_000;
        let ns = format!("sluice-ops-{id}");
        let (host_if, peer_if) = (format!("so{id}a"), format!("so{id}b"));
        // A /30 per process, so parallel runs do not collide: 10.231.<hi>.<lo*4>.
        let block = id % 16_000;
        let (hi, lo) = (block / 64, (block % 64) * 4);
        let host_ip = format!("10.231.{hi}.{}", lo + 1);
        let peer_ip = format!("10.231.{hi}.{}", lo + 2);
        let ip = |args: &[&str]| {
            let out = Command::new("ip")
                .args(args)
                .output()
                .expect("ip(8) from iproute2");
            assert!(
                out.status.success(),
                "ip {}: {} (this test makes a network namespace: it needs root and iproute2)",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        ip(&["netns", "add", &ns]);
        let peer = Peer {
            ns: ns.clone(),
            host_if: host_if.clone(),
            host_ip: host_ip.clone(),
        };
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if,
        ]);
        ip(&["link", "set", &peer_if, "netns", &ns]);
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{peer_ip}/30"),
            "dev",
            &peer_if,
        ]);
        ip(&["-n", &ns, "link", "set", &peer_if, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        peer
    }

    /// `curl` from inside the namespace: (status, body).
    fn curl(&self, method: &str, url: &str, token: Option<&str>) -> (u16, String) {
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns", "exec", &self.ns, "curl", "-s", "-m", "5", "-X", method,
        ])
        .args(["-o", "-", "-w", "\n%{http_code}"]);
        if let Some(t) = token {
            cmd.args(["-H", &format!("authorization: Bearer {t}")]);
        }
        if method == "PUT" {
            cmd.args([
                "-H",
                "content-type: application/json",
                "-d",
                r#"{"value": 42}"#,
            ]);
        }
        let out = cmd.arg(url).output().expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

#[tokio::test]
async fn off_loopback_everything_but_the_probes_needs_the_admin_token() {
    let peer = Peer::new();
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    let port = free_port();
    // Loopback (for the harness) and the veth address the namespace reaches.
    merge(
        &mut cfg,
        json!({"ops_listen": [format!("127.0.0.1:{}", free_port()), format!("{}:{port}", peer.host_ip)]}),
    );
    let s = serve_with(&cfg, &[("SLUICE_ADMIN_TOKEN", "s3cret")], true).await;
    let base = format!("http://{}:{port}", peer.host_ip);
    for probe in ["/healthz", "/livez", "/readyz"] {
        assert_eq!(
            peer.curl("GET", &format!("{base}{probe}"), None).0,
            200,
            "{probe}"
        );
    }
    for path in ["/status", "/metrics", "/decisions/recent", "/dashboard"] {
        let url = format!("{base}{path}");
        let (code, body) = peer.curl("GET", &url, None);
        assert_eq!(code, 401, "{path} without a token: {body}");
        assert!(body.contains("SLUICE_ADMIN_TOKEN"), "{body}");
        assert_eq!(
            peer.curl("GET", &url, Some("wrong")).0,
            401,
            "{path} with a wrong token"
        );
        assert_eq!(
            peer.curl("GET", &url, Some("s3cret")).0,
            200,
            "{path} with the token"
        );
    }
    let admin = format!("{base}/admin/pressure");
    assert_eq!(peer.curl("PUT", &admin, None).0, 401);
    assert_eq!(peer.curl("PUT", &admin, Some("s3cret")).0, 200);
    assert_eq!(
        s.status().await["signals"]["on-demand"]["pressure"]["value"],
        42.0
    );
    // From loopback the read endpoints need nothing (the harness above read /status so).
    assert_eq!(
        client()
            .get(s.ops_url("/metrics"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}
