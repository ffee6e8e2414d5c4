//! The README's reference tables must cover what the code has.

use sluice_policy::Reason;

const README: &str = include_str!("../README.md");

#[test]
fn every_reason_code_is_documented() {
    for r in Reason::ALL {
        assert!(
            README.contains(&format!("| `{}` | {} |", r.as_str(), r.describe())),
            "README lacks {}",
            r.as_str()
        );
    }
}

#[test]
fn every_environment_override_is_documented() {
    for (var, key, _) in sluice_config::env::OVERRIDES {
        let row = README
            .lines()
            .find(|l| l.starts_with(&format!("| `{var}` |")));
        let row = row.unwrap_or_else(|| panic!("README lacks {var}"));
        let key_root = key.split('.').next().unwrap_or(key);
        assert!(
            row.contains(key_root),
            "README row for {var} does not name {key}"
        );
    }
}
