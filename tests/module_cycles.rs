//! The workspace's modules import each other one way only, and the CI check that says so
//! really fails on a circle.

use std::path::Path;
use std::process::Command;

fn check(root: &Path) -> std::process::Output {
    Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check-module-cycles.py"))
        .arg(root)
        .output()
        .expect("python3")
}

#[test]
fn no_crate_of_the_workspace_has_a_module_circle() {
    let out = check(Path::new(env!("CARGO_MANIFEST_DIR")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_circle_between_two_modules_fails_the_check_and_is_named() {
    let dir = std::env::temp_dir().join(format!("sluice-cycles-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(dir.join("Cargo.toml"), "[package]\nname = \"c\"\n").unwrap();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::B;\npub struct A;\n").unwrap();
    std::fs::write(src.join("b.rs"), "use super::c::C;\npub struct B;\n").unwrap();
    std::fs::write(src.join("c.rs"), "pub struct C(crate::a::A);\n").unwrap();
    let out = check(&dir);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("modules in a circle: a, b, c"), "{text}");
    // Broken the circle, the same crate passes.
    std::fs::write(src.join("c.rs"), "pub struct C;\n").unwrap();
    assert!(check(&dir).status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
