//! Issue 42: each crate in `vendor/` is its crates.io release, pinned by sha256 in
//! `vendor/VENDORED`, plus `vendor/<crate>/sluice.patch` and nothing else, as
//! `scripts/vendor-check.sh` checks; the check fails, naming the file, on a copy edited without
//! its patch; and `--regen` writes exactly the committed patch files. Every edit is made on a
//! copy of `vendor/` in a temp dir: the real tree is only read. The script takes the `.crate`
//! files from cargo's download cache or `target/vendor-check/`, else downloads them from
//! static.crates.io (and checks their sha256 either way).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the script with `args`: its exit code and its stdout and stderr together.
fn vendor_check(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new("bash")
        .arg(root().join("scripts/vendor-check.sh"))
        .args(args)
        .output()
        .expect("bash runs scripts/vendor-check.sh");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// `(name, version)` of each crate `vendor/VENDORED` lists.
fn vendored() -> Vec<(String, String)> {
    let text = fs::read_to_string(root().join("vendor/VENDORED")).unwrap();
    let crates: Vec<_> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut f = l.split_whitespace();
            (f.next().unwrap().into(), f.next().unwrap().into())
        })
        .collect();
    assert!(!crates.is_empty(), "vendor/VENDORED lists crates");
    crates
}

/// A copy of `vendor/` in a fresh temp dir, removed on drop.
struct VendorCopy(PathBuf);

impl VendorCopy {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "sluice-vendor-{tag}-{}-{nanos}",
            std::process::id()
        ));
        copy_tree(&root().join("vendor"), &dir.join("vendor"));
        VendorCopy(dir)
    }

    fn vendor(&self) -> PathBuf {
        self.0.join("vendor")
    }

    fn arg(&self) -> String {
        self.vendor().to_str().unwrap().to_owned()
    }
}

impl Drop for VendorCopy {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Changes one byte in the middle of `path`.
fn flip_one_byte(path: &Path) {
    let mut bytes = fs::read(path).unwrap();
    let i = bytes.len() / 2;
    bytes[i] = if bytes[i] == b'x' { b'y' } else { b'x' };
    fs::write(path, bytes).unwrap();
}

/// A source file of pingora-proxy that its patch leaves alone.
const UNPATCHED: &str = "pingora-proxy/src/proxy_h1.rs";

#[test]
fn each_vendored_crate_is_its_crates_io_release_plus_its_patch() {
    let (code, out) = vendor_check(&[]);
    assert_eq!(code, Some(0), "scripts/vendor-check.sh failed:\n{out}");
    let crates = vendored();
    for (name, version) in &crates {
        assert!(
            out.contains(&format!("{name} {version}: ok")),
            "{name} {version} checked:\n{out}"
        );
    }
    assert!(
        out.contains(&format!("all {} vendored crates", crates.len())),
        "{out}"
    );
}

#[test]
fn a_vendored_file_edited_without_its_patch_fails_the_check_by_name() {
    let copy = VendorCopy::new("tampered");
    flip_one_byte(&copy.vendor().join(UNPATCHED));

    let (code, out) = vendor_check(&["--vendor-dir", &copy.arg()]);
    assert_eq!(code, Some(1), "a difference, not an error:\n{out}");
    let named: Vec<_> = out
        .lines()
        .filter(|l| l.contains("differs:") || l.contains("only in") || l.contains("missing"))
        .collect();
    assert_eq!(named.len(), 1, "exactly one file named:\n{out}");
    assert!(
        named[0].contains("differs:") && named[0].ends_with(UNPATCHED),
        "the edited file is named:\n{out}"
    );
    assert!(out.contains("FAILED: pingora-proxy"), "{out}");
    for (name, version) in vendored() {
        if name != "pingora-proxy" {
            assert!(out.contains(&format!("{name} {version}: ok")), "{out}");
        }
    }
}

#[test]
fn regen_writes_the_committed_patches_and_carries_an_intended_edit() {
    let copy = VendorCopy::new("regen");
    let (code, out) = vendor_check(&["--vendor-dir", &copy.arg(), "--regen"]);
    assert_eq!(code, Some(0), "{out}");
    for (name, _) in vendored() {
        let rel = format!("{name}/sluice.patch");
        assert!(
            fs::read(copy.vendor().join(&rel)).unwrap()
                == fs::read(root().join("vendor").join(&rel)).unwrap(),
            "vendor/{rel} is what --regen writes from the copy (commit message kept, diff \
             regenerated): run scripts/vendor-check.sh --regen and commit"
        );
    }

    // An intended edit: after --regen the patch carries it, its message is kept, the check passes.
    let patch = copy.vendor().join("pingora-proxy/sluice.patch");
    let before = fs::read_to_string(&patch).unwrap();
    flip_one_byte(&copy.vendor().join(UNPATCHED));
    let (code, out) = vendor_check(&["--vendor-dir", &copy.arg(), "--regen"]);
    assert_eq!(code, Some(0), "{out}");
    let after = fs::read_to_string(&patch).unwrap();
    let file = UNPATCHED.trim_start_matches("pingora-proxy/");
    assert!(after.contains(&format!("+++ b/{file}\n")), "{after}");
    assert_eq!(after.lines().next(), before.lines().next(), "subject kept");
    let (code, out) = vendor_check(&["--vendor-dir", &copy.arg()]);
    assert_eq!(code, Some(0), "{out}");
}
