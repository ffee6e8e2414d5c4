//! `tiers.<tier>.slo` and the prototype's `sla_target_ms`: which objective is in force, what
//! `sluice check` says of it, the per-tenant header switch, and errors that name the key.

use sluice_config::{Config, ConfigError};
use sluice_policy::slo::Slo;
use sluice_policy::Tier;
use std::path::Path;

fn load(yaml: &str) -> Result<Config, ConfigError> {
    Config::from_yaml(yaml, "sluice.yaml", Path::new("."), None, &|_| None)
}

fn slo(cfg: &Config, tier: Tier) -> Slo {
    cfg.policy_rules().tier(tier).slo
}

#[test]
fn the_shipped_config_and_an_empty_one_judge_ttft_and_tpot() {
    let shipped = Config::embedded(&|_| None).unwrap();
    let empty = load("{}").unwrap();
    for (tier, ttft, tpot) in [
        (Tier::Guaranteed, 500, 50),
        (Tier::Standard, 1000, 100),
        (Tier::BestEffort, 2000, 200),
    ] {
        let want = Slo {
            ttft_ms: Some(ttft),
            tpot_ms: Some(tpot),
            e2e_ms: None,
        };
        assert_eq!(slo(&shipped, tier), want, "{tier} shipped");
        assert_eq!(slo(&empty, tier), want, "{tier} built in");
    }
}

#[test]
fn a_prototype_config_keeps_its_end_to_end_targets_alone() {
    let cfg = load(
        "tiers:\n  Guaranteed: {sla_target_ms: 2000}\n  Standard: {sla_target_ms: 1000}\n  \
         Best-Effort: {sla_target_ms: 500}\n",
    )
    .unwrap();
    assert_eq!(slo(&cfg, Tier::Guaranteed), Slo::e2e(2000));
    assert_eq!(slo(&cfg, Tier::BestEffort), Slo::e2e(500));
    assert_eq!(
        cfg.objectives()[1],
        "tiers.Standard: e2e 1000 ms",
        "{:?}",
        cfg.objectives()
    );
}

#[test]
fn slo_replaces_the_default_whole_and_check_names_the_e2e_target_in_force() {
    let cfg = load(
        "tiers:\n  Guaranteed: {slo: {ttft_ms: 300}}\n  \
         Standard: {sla_target_ms: 1000, slo: {tpot_ms: 80, e2e_ms: 800}}\n  \
         Best-Effort: {sla_target_ms: 900, slo: {ttft_ms: 3000}}\n",
    )
    .unwrap();
    assert_eq!(
        slo(&cfg, Tier::Guaranteed),
        Slo {
            ttft_ms: Some(300),
            ..Slo::default()
        }
    );
    assert_eq!(slo(&cfg, Tier::Standard).e2e_ms, Some(800));
    // sla_target_ms is the e2e target of an `slo` block that sets none.
    assert_eq!(slo(&cfg, Tier::BestEffort).e2e_ms, Some(900));
    let lines = cfg.objectives();
    assert_eq!(lines[0], "tiers.Guaranteed: ttft 300 ms");
    assert_eq!(
        lines[1],
        "tiers.Standard: tpot 80 ms, e2e 800 ms; slo.e2e_ms (800) is in force, \
         sla_target_ms (1000) is ignored"
    );
    assert_eq!(lines[2], "tiers.Best-Effort: ttft 3000 ms, e2e 900 ms");
}

#[test]
fn bad_targets_name_the_file_the_key_and_the_reason() {
    for (yaml, key) in [
        (
            "tiers:\n  Standard: {slo: {ttft_ms: 0}}\n",
            "tiers.Standard.slo.ttft_ms",
        ),
        (
            "tiers:\n  Guaranteed: {sla_target_ms: 0}\n",
            "tiers.Guaranteed.sla_target_ms",
        ),
    ] {
        let e = load(yaml).expect_err(yaml).to_string();
        assert!(e.contains("sluice.yaml"), "{e}");
        assert!(e.contains(key), "{e}");
        assert!(e.contains("nothing meets"), "{e}");
    }
    let e = load("tiers:\n  Standard: {slo: {ttft: 5}}\n")
        .expect_err("unknown key")
        .to_string();
    assert!(e.contains("ttft"), "{e}");
}

#[test]
fn tenants_may_be_kept_from_tightening_their_targets() {
    let cfg = load("tenants:\n  a: Standard\n  b: {tier: Standard, slo_headers: false}\n").unwrap();
    assert!(cfg.tenants["a"].slo_headers);
    assert!(!cfg.tenants["b"].slo_headers);
}
