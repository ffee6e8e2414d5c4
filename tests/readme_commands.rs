//! The README's "Two commands" as a newcomer types them: exactly two, each a script in this
//! repository that installs what it needs, and the run command resolves to the `sluice` binary
//! (`default-run`), so `cargo run --release -- demo` needs no `--bin` either.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The command lines of the fenced blocks under "## Two commands".
fn two_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let section = readme
        .split("\n## Two commands\n")
        .nth(1)
        .expect("README has a '## Two commands' section");
    let section = section.split("\n## ").next().unwrap();
    let mut blocks = Vec::new();
    let mut inside = None::<Vec<String>>;
    for line in section.lines() {
        match (&mut inside, line.trim_start().starts_with("```")) {
            (None, true) => inside = Some(Vec::new()),
            (Some(_), true) => blocks.push(inside.take().unwrap().join("\n")),
            (Some(lines), false) if !line.trim().is_empty() => lines.push(line.trim().into()),
            _ => {}
        }
    }
    blocks
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

#[test]
fn the_readme_gives_exactly_a_run_and_a_test_command_that_exist() {
    let cmds = two_commands();
    assert_eq!(cmds.len(), 2, "two one-line commands: {cmds:?}");
    for cmd in &cmds {
        assert!(!cmd.contains('\n'), "one line each: {cmd:?}");
        let script = cmd.split_whitespace().next().unwrap();
        let path = root().join(script);
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{script}: {e}"))
            .permissions();
        use std::os::unix::fs::PermissionsExt;
        assert!(mode.mode() & 0o111 != 0, "{script} is executable");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("ensure_build_deps"),
            "{script} installs the build's C toolchain before cargo runs"
        );
    }
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    let test_cmd = cmds[1].split_whitespace().next().unwrap();
    assert!(ci.contains(test_cmd), "CI runs the README's test command");
}

#[test]
fn the_run_command_starts_sluice() {
    let cmds = two_commands();
    let run = cmds[0].split_whitespace().next().unwrap();
    let out = Command::new(root().join(run))
        .arg("--help")
        .env("SLUICE_CARGO_PROFILE", "dev")
        .current_dir(root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{run} --help: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("demo") && stdout.contains("serve"),
        "{stdout}"
    );
}

#[test]
fn cargo_run_needs_no_bin_flag() {
    let out = cargo()
        .args(["run", "--locked", "--quiet", "--", "--help"])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("demo"));
}
