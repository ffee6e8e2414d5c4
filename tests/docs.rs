//! The documentation covers what the code has, stays short enough to read, and links only to
//! files that exist: the reason codes (docs/api.md) and environment overrides
//! (docs/configuration.md) come from the code's own lists; README.md and bench/RESULTS.md stay
//! within their length; no user-facing page cites issue numbers or commit hashes.

use sluice_policy::Reason;
use std::path::{Path, PathBuf};

const API: &str = include_str!("../docs/api.md");
const CONFIGURATION: &str = include_str!("../docs/configuration.md");

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// README.md and every docs/*.md, the pages whose links are checked.
fn linked_pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The pages a user reads: README.md, docs/*.md and bench/RESULTS.md.
fn user_pages() -> Vec<PathBuf> {
    let mut pages = linked_pages();
    pages.push(root().join("bench/RESULTS.md"));
    pages
}

/// The text outside fenced code blocks (commands and sample output may hold ids and hashes).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn every_reason_code_is_documented() {
    for r in Reason::ALL {
        assert!(
            API.contains(&format!("| `{}` | {} |", r.as_str(), r.describe())),
            "docs/api.md lacks the row of {}",
            r.as_str()
        );
    }
}

#[test]
fn every_environment_override_is_documented() {
    for (var, key, _) in sluice_config::env::OVERRIDES {
        let row = CONFIGURATION
            .lines()
            .find(|l| l.starts_with(&format!("| `{var}` |")));
        let row = row.unwrap_or_else(|| panic!("docs/configuration.md lacks {var}"));
        let key_root = key.split('.').next().unwrap_or(key);
        assert!(
            row.contains(key_root),
            "docs/configuration.md's row for {var} does not name {key}"
        );
    }
}

#[test]
fn the_readme_and_the_results_stay_short() {
    for (file, max) in [("README.md", 300), ("bench/RESULTS.md", 400)] {
        let lines = read(&root().join(file)).lines().count();
        assert!(lines <= max, "{file} has {lines} lines, at most {max}");
    }
}

/// The targets of the inline links and images of a markdown text: `[text](target)`.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            targets.push(target.to_string());
            rest = &rest[end..];
        }
    }
    targets
}

#[test]
fn relative_links_point_at_files_that_exist() {
    let mut broken = Vec::new();
    for page in linked_pages() {
        let dir = page.parent().unwrap();
        for target in link_targets(&prose(&read(&page))) {
            let external = ["http://", "https://", "mailto:"]
                .iter()
                .any(|s| target.starts_with(s));
            let path = target.split('#').next().unwrap_or("");
            if external || path.is_empty() {
                continue;
            }
            if !dir.join(path).exists() {
                broken.push(format!("{}: {target}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to missing files: {broken:#?}");
}

/// "issue 42", "Issue #7", "issues 6 and 10", "(#41": references to the tracker, which a user
/// cannot follow.
fn issue_references(text: &str) -> Vec<String> {
    let lower = text.to_ascii_lowercase();
    let bytes = lower.as_bytes();
    let mut found = Vec::new();
    for (i, _) in lower.match_indices("issue") {
        let mut j = i + "issue".len();
        if bytes.get(j) == Some(&b's') {
            j += 1;
        }
        while bytes.get(j).is_some_and(|b| *b == b' ' || *b == b'#') {
            j += 1;
        }
        if j > i + 5 && bytes.get(j).is_some_and(u8::is_ascii_digit) {
            found.push(lower[i..(j + 1).min(lower.len())].to_string());
        }
    }
    for (i, _) in lower.match_indices("(#") {
        if bytes.get(i + 2).is_some_and(u8::is_ascii_digit) {
            found.push(lower[i..(i + 3).min(lower.len())].to_string());
        }
    }
    found
}

/// Words of 7 to 40 lowercase hex digits with at least one digit and one letter: what a commit
/// hash looks like in prose.
fn commit_hashes(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| {
            (7..=40).contains(&w.len())
                && w.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f'))
                && w.chars().any(|c| c.is_ascii_digit())
                && w.chars().any(|c| c.is_ascii_lowercase())
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn user_facing_pages_cite_no_issues_or_commits() {
    let mut found = Vec::new();
    for page in user_pages() {
        let text = prose(&read(&page));
        for hit in issue_references(&text) {
            found.push(format!("{}: {hit:?}", page.display()));
        }
        for hit in commit_hashes(&text) {
            found.push(format!("{}: commit-like {hit:?}", page.display()));
        }
    }
    assert!(found.is_empty(), "{found:#?}");
}

#[test]
fn the_reference_checks_catch_what_they_look_for() {
    assert_eq!(
        issue_references("see issue 42, Issue #7 and (#41)").len(),
        3
    );
    assert!(issue_references("an issue with the issuer; issues remain").is_empty());
    assert_eq!(
        commit_hashes("at 91823b7 and e82f81d"),
        ["91823b7", "e82f81d"]
    );
    assert!(commit_hashes("1000000 requests, x86_64, deadbeef, sha256 cafe").is_empty());
    assert_eq!(
        link_targets("[a](docs/api.md#reason-codes) ![b](x.png) [c](https://e)"),
        ["docs/api.md#reason-codes", "x.png", "https://e"]
    );
}
