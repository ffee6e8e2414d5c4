//! A test PKI made with the openssl CLI: a CA and server certificates it signs.

use std::path::Path;
use std::process::Command;

pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl on PATH");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `openssl req` with a new unencrypted P-256 key, then `args`.
fn req_with_new_key(dir: &Path, args: &[&str]) {
    let new_key = [
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(dir, &[&new_key[..], args].concat());
}

/// A test CA in `dir` (ca.pem, ca.key).
pub fn make_ca(dir: &Path) {
    req_with_new_key(
        dir,
        &[
            "-x509",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=sluice-test-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ],
    );
}

/// A server certificate for localhost / 127.0.0.1 signed by the CA, as `{name}.pem` and
/// `{name}.key`.
pub fn make_leaf(dir: &Path, name: &str) {
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    let (key, csr, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
    );
    req_with_new_key(
        dir,
        &["-keyout", &key, "-out", &csr, "-subj", "/CN=localhost"],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
}
