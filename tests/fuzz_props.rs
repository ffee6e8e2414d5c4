//! Property-based fuzzing (proptest; stable Rust has no cargo-fuzz) of every parser that reads
//! input Sluice does not control: the JSON rewrite, tenant and API-key headers, the connection
//! guard's head and chunk checks, vLLM's metrics text, Prometheus API responses and the config
//! loader. Each property mixes structured inputs (so the interesting branches are reached) with
//! raw bytes (so nothing panics on garbage).
//!
//! CI runs `SLUICE_FUZZ_CASES` cases per property (default 256). The long run, once:
//! `SLUICE_FUZZ_CASES=1000000 cargo test --release --test fuzz_props -- --test-threads=1`.

use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, FileFailurePersistence};
use serde_json::{json, Map, Value};
use sluice_config::tenancy::{hash_key, TenantDirectory};
use sluice_config::Config;
use sluice_proxy::head_check::{self, BodyVerdict, HeadLimits, HeadVerdict};
use sluice_proxy::shaping::{self, Shaped};
use sluice_runtime::signals::{prometheus, vllm_text};

fn cases() -> PropConfig {
    let cases = std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    PropConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..PropConfig::default()
    }
}

// ---------------------------------------------------------------- JSON rewrite

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinities", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::vec((".{0,6}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// `max_tokens`-like values: the interesting integers around a cap, and anything else.
fn token_field() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        Just(None),
        (-5i64..2000).prop_map(|n| Some(Value::from(n))),
        any::<i64>().prop_map(|n| Some(Value::from(n))),
        json_value().prop_map(Some),
    ]
}

fn completion_body() -> impl Strategy<Value = Map<String, Value>> {
    (
        prop_oneof![
            Just(None),
            Just(Some(json!("llama-3-70b"))),
            Just(Some(json!("llama-3-8b"))),
            json_value().prop_map(Some)
        ],
        token_field(),
        token_field(),
        prop::collection::vec((".{0,8}", json_value()), 0..5),
    )
        .prop_map(|(model, max_tokens, mct, extra)| {
            let mut obj: Map<String, Value> = extra.into_iter().collect();
            for (key, v) in [
                ("model", model),
                ("max_tokens", max_tokens),
                ("max_completion_tokens", mct),
            ] {
                match v {
                    Some(v) => obj.insert(key.into(), v),
                    None => obj.remove(key),
                };
            }
            obj
        })
}

fn within(v: Option<&Value>, cap: u32) -> bool {
    v.and_then(Value::as_i64)
        .is_some_and(|n| (0..=i64::from(cap)).contains(&n))
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn json_rewrite_is_valid_capped_and_untouched_when_nothing_changes(
        obj in completion_body(),
        pretty in any::<bool>(),
        cap in prop::option::of(0u32..4096),
        model in prop::option::of(prop_oneof![Just("llama-3-8b".to_string()), ".{0,10}"]),
    ) {
        let body = if pretty {
            serde_json::to_vec_pretty(&obj).unwrap()
        } else {
            serde_json::to_vec(&obj).unwrap()
        };
        let satisfied = cap.is_none_or(|c| {
            within(obj.get("max_tokens"), c)
                && obj.get("max_completion_tokens").is_none_or(|v| within(Some(v), c))
        }) && model.as_deref().is_none_or(|m| obj.get("model").and_then(Value::as_str) == Some(m));
        let rewrite = shaping::Rewrite {
            cap,
            model: model.as_deref(),
            ..Default::default()
        };
        match shaping::shape(&body, &rewrite) {
            Shaped::NotJson => prop_assert!(false, "a JSON object was called not JSON"),
            // The caller forwards the original bytes: byte-identical by construction.
            Shaped::Unchanged(_) => prop_assert!(satisfied, "a needed change was skipped: {obj:?}"),
            Shaped::Rewritten { body: out, applied_max_tokens, .. } => {
                prop_assert!(!satisfied, "rewrote a body that needed no change");
                let Ok(Value::Object(new)) = serde_json::from_slice::<Value>(&out) else {
                    return Err(TestCaseError::fail("the rewrite is not a JSON object"));
                };
                if let Some(c) = cap {
                    prop_assert!(within(new.get("max_tokens"), c));
                    prop_assert_eq!(applied_max_tokens, new.get("max_tokens").and_then(Value::as_i64));
                    if obj.contains_key("max_completion_tokens") {
                        prop_assert!(within(new.get("max_completion_tokens"), c));
                    } else {
                        prop_assert!(!new.contains_key("max_completion_tokens"));
                    }
                }
                if let Some(m) = &model {
                    prop_assert_eq!(new.get("model").and_then(Value::as_str), Some(m.as_str()));
                }
                for (k, v) in &obj {
                    let touched = ["max_tokens", "max_completion_tokens", "model"].contains(&k.as_str());
                    if !touched {
                        prop_assert_eq!(new.get(k), Some(v), "field {} changed", k);
                    }
                }
            }
        }
    }

    #[test]
    fn json_rewrite_survives_any_bytes(
        body in prop::collection::vec(any::<u8>(), 0..256),
        cap in prop::option::of(any::<u32>()),
    ) {
        let parsed = serde_json::from_slice::<Value>(&body);
        let rewrite = shaping::Rewrite {
            cap,
            model: Some("m"),
            ..Default::default()
        };
        let out = shaping::shape(&body, &rewrite);
        if !matches!(parsed, Ok(Value::Object(_))) {
            prop_assert_eq!(out, Shaped::NotJson);
        }
    }
}

// ---------------------------------------------------------------- tenants and API keys

fn directory(require_key: bool) -> TenantDirectory {
    let cfg = json!({
        "tenants": {"support-bot": "Guaranteed", "coding-assistant": "Standard"},
        "api_keys": [
            {"tenant": "support-bot", "sha256": hash_key("sk-support")},
            {"tenant": "coding-assistant", "sha256": hash_key("sk-coding")},
        ],
        "auth": {"require_api_key": require_key},
    });
    let text = serde_yaml::to_string(&cfg).unwrap();
    let cfg = Config::from_yaml(&text, "fuzz.yaml", std::path::Path::new("."), None, &|_| {
        None
    })
    .unwrap();
    TenantDirectory::from_config(&cfg)
}

fn header_bytes() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        Just(Some(b"support-bot".to_vec())),
        Just(Some(b" coding-assistant ".to_vec())),
        prop::collection::vec(any::<u8>(), 0..160).prop_map(Some),
        "[ -~]{0,140}".prop_map(|s| Some(s.into_bytes())),
    ]
}

fn authorization() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        Just(None),
        Just(Some(b"Bearer sk-support".to_vec())),
        Just(Some(b"bearer  sk-coding ".to_vec())),
        "Bearer .{0,40}".prop_map(|s| Some(s.into_bytes())),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn tenant_and_key_headers_resolve_without_panic_and_keys_win(
        tenant in header_bytes(),
        auth in authorization(),
        require in any::<bool>(),
    ) {
        let dir = directory(require);
        let got = dir.resolve(tenant.as_deref(), auth.as_deref());
        let token = auth.as_deref().and_then(|a| {
            let rest = a.strip_prefix(b"Bearer ").or_else(|| a.strip_prefix(b"bearer "))?;
            Some(rest.trim_ascii().to_vec())
        }).filter(|t| !t.is_empty());
        let key_tenant = match token.as_deref() {
            Some(b"sk-support") => Some("support-bot"),
            Some(b"sk-coding") => Some("coding-assistant"),
            _ => None,
        };
        match (&got, key_tenant, &token) {
            // A valid key decides the tenant, whatever X-Tenant-ID says.
            (Ok(id), Some(t), _) => prop_assert!(id.via_api_key && id.tenant == t),
            (Err(_), Some(_), _) => prop_assert!(false, "a valid key was refused"),
            (Ok(_), None, Some(_)) => prop_assert!(false, "an unknown key was accepted"),
            (Ok(id), None, None) => {
                prop_assert!(!require && !id.via_api_key);
                prop_assert!(id.tenant.len() <= 128 && id.tenant.bytes().all(|b| b.is_ascii_graphic()));
            }
            (Err(_), None, _) => {}
        }
    }
}

// ---------------------------------------------------------------- connection guard

const LIMITS: HeadLimits = HeadLimits {
    max_header_bytes: 16 * 1024,
    max_headers: 32,
    max_request_line_bytes: 2048,
};

fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("Host".to_string()),
        Just("Content-Type".to_string()),
        Just("X-Tenant-ID".to_string()),
        "[A-Za-z][A-Za-z0-9-]{0,20}",
    ]
    .prop_filter("framing headers are generated separately", |n| {
        !["content-length", "transfer-encoding", "expect"]
            .contains(&n.to_ascii_lowercase().as_str())
    })
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn well_formed_heads_are_accepted_at_their_exact_length(
        method in prop_oneof![Just("GET"), Just("POST"), Just("PUT")],
        target in "/[a-z0-9/._~-]{0,60}",
        fields in prop::collection::vec((header_name(), "[ -~]{0,40}"), 0..20),
        length in prop::option::of(0u64..100_000),
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut head = format!("{method} {target} HTTP/1.1\r\n");
        for (n, v) in &fields {
            head.push_str(&format!("{n}: {}\r\n", v.trim()));
        }
        if let Some(l) = length {
            head.push_str(&format!("Content-Length: {l}\r\n"));
        }
        head.push_str("\r\n");
        let mut raw = head.clone().into_bytes();
        raw.extend_from_slice(&tail);
        match head_check::check_head(&raw, &LIMITS) {
            HeadVerdict::Complete(h) => {
                prop_assert_eq!(h.len, head.len());
                let expect = match length {
                    None | Some(0) => head_check::Framing::NoBody,
                    Some(l) => head_check::Framing::Length(l),
                };
                prop_assert_eq!(h.framing, expect);
            }
            other => prop_assert!(false, "{other:?} for {head:?}"),
        }
        // Every proper prefix is only incomplete (or already over a limit), never accepted.
        for cut in [1, head.len() / 2, head.len() - 1] {
            prop_assert!(!matches!(head_check::check_head(&raw[..cut], &LIMITS), HeadVerdict::Complete(_)));
        }
    }

    #[test]
    fn guard_checks_survive_any_bytes(raw in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = head_check::check_head(&raw, &LIMITS);
        let _ = head_check::check_chunked(&raw);
        let mut with_head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        with_head.extend_from_slice(&raw);
        let _ = head_check::check_head(&with_head, &LIMITS);
    }

    #[test]
    fn chunked_encodings_are_framed_exactly(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..200), 0..8),
        upper in any::<bool>(),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let mut raw = Vec::new();
        for c in &chunks {
            let size = if upper { format!("{:X}", c.len()) } else { format!("{:x}", c.len()) };
            raw.extend_from_slice(size.as_bytes());
            raw.extend_from_slice(b"\r\n");
            raw.extend_from_slice(c);
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(b"0\r\n\r\n");
        prop_assert_eq!(head_check::check_chunked(&raw), BodyVerdict::Complete(raw.len()));
        // A cut body is incomplete, never complete.
        prop_assert_eq!(head_check::check_chunked(&raw[..raw.len() - 1]), BodyVerdict::Incomplete);
        // Any one-byte change is refused, incomplete, or still exactly framed.
        let i = flip.index(raw.len());
        let mut changed = raw.clone();
        changed[i] = byte;
        if let BodyVerdict::Complete(n) = head_check::check_chunked(&changed) {
            prop_assert!(n <= changed.len());
        }
    }
}

// ---------------------------------------------------------------- vLLM metrics text

fn metric_line() -> impl Strategy<Value = (String, Option<(usize, f64)>)> {
    let name = prop_oneof![Just(0usize), Just(1usize), Just(2usize), Just(3usize)];
    let labels = prop_oneof![
        Just(String::new()),
        "\\{engine=\"[0-9]\"\\}",
        "\\{model_name=\"[a-z0-9-]{0,10}\",engine=\"[0-9]\"\\}",
    ];
    (
        name,
        labels,
        0.0f64..1.0,
        prop::option::of(0i64..1_000_000_000_000),
    )
        .prop_map(|(n, labels, v, ts)| {
            let metric = [
                "vllm:kv_cache_usage_perc",
                "vllm:gpu_cache_usage_perc",
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
            ][n];
            let ts = ts.map(|t| format!(" {t}")).unwrap_or_default();
            (format!("{metric}{labels} {v}{ts}"), Some((n, v)))
        })
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn vllm_metrics_text_is_read_as_vllm_defines_it(
        lines in prop::collection::vec(prop_oneof![
            3 => metric_line(),
            1 => "# (HELP|TYPE) [ -~]{0,40}".prop_map(|s| (s, None)),
            1 => "[ -~]{0,60}".prop_map(|s| (s, None)),
        ], 0..30),
    ) {
        let text: String = lines.iter().map(|(l, _)| format!("{l}\n")).collect();
        let reading = vllm_text::parse(&text);
        let values = |k: usize| -> Vec<f64> {
            lines.iter().filter_map(|(_, v)| *v).filter(|(n, _)| *n == k).map(|(_, v)| v).collect()
        };
        // Noise lines may themselves look like samples; only check when there is none.
        let noisy = lines.iter().any(|(l, v)| v.is_none() && l.starts_with("vllm:"));
        if !noisy {
            let (now, old) = (values(0), values(1));
            let kv = if now.is_empty() { old } else { now };
            match reading.kv_usage {
                Some(got) => {
                    let want = kv.iter().sum::<f64>() / kv.len() as f64;
                    prop_assert!((got - want).abs() < 1e-9, "{got} vs {want}");
                }
                None => prop_assert!(kv.is_empty()),
            }
            let waiting = values(2);
            prop_assert_eq!(reading.waiting.is_some(), !waiting.is_empty());
        }
    }

    #[test]
    fn vllm_metrics_text_survives_any_bytes(raw in prop::collection::vec(any::<u8>(), 0..512)) {
        let reading = vllm_text::parse(&String::from_utf8_lossy(&raw));
        let _ = reading;
    }
}

// ---------------------------------------------------------------- Prometheus API responses

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn prometheus_answers_give_one_finite_sample_or_an_error(
        status in prop_oneof![Just(200u16), 100u16..600],
        kind in prop_oneof![
            Just("vector".to_string()),
            Just("scalar".to_string()),
            Just("matrix".to_string()),
            "[a-z]{0,6}"
        ],
        series in 0usize..3,
        ts in any::<f64>().prop_filter("JSON number", |f| f.is_finite()),
        value in prop_oneof![
            any::<f64>().prop_map(|v| v.to_string()),
            Just("NaN".to_string()), Just("+Inf".to_string()), ".{0,8}"
        ],
        junk in json_value(),
        use_junk in any::<bool>(),
    ) {
        let sample = json!([ts, value]);
        let result = match kind.as_str() {
            "vector" => Value::from((0..series).map(|_| json!({"metric": {}, "value": sample})).collect::<Vec<_>>()),
            _ => sample.clone(),
        };
        let body = if use_junk {
            junk
        } else {
            json!({"status": "success", "data": {"resultType": kind, "result": result}})
        };
        let out = prometheus::parse_response(status, body.to_string().as_bytes());
        if let Ok(s) = out {
            prop_assert!(s.value.is_finite());
            prop_assert!((200..300).contains(&status));
        }
        let wellformed = !use_junk && status == 200 && (kind == "scalar" || (kind == "vector" && series == 1));
        if wellformed {
            match value.parse::<f64>() {
                Ok(v) if v.is_finite() => prop_assert_eq!(out, Ok(prometheus::Sample { value: v, timestamp: ts })),
                _ => prop_assert!(out.is_err()),
            }
        }
    }

    #[test]
    fn prometheus_answers_survive_any_bytes(
        status in any::<u16>(),
        raw in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let _ = prometheus::parse_response(status, &raw);
    }
}

// ---------------------------------------------------------------- config loader

const SHIPPED: &str = include_str!("../conf/sluice.yaml");
const TENANTS: &str = include_str!("../conf/tenants.yaml");

fn load(text: &str) -> Result<Config, sluice_config::ConfigError> {
    Config::from_yaml(
        text,
        "fuzz.yaml",
        std::path::Path::new("/nonexistent"),
        Some(TENANTS),
        &|_| None,
    )
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn config_loader_names_the_file_for_any_mutation(
        line in any::<prop::sample::Index>(),
        replacement in prop_oneof![
            Just(String::new()),
            "[ -~]{0,30}",
            "  [a-z_]{1,12}: [ -~]{0,12}",
            "[a-z_]{1,12}:",
        ],
        value_only in any::<bool>(),
    ) {
        let mut lines: Vec<String> = SHIPPED.lines().map(str::to_string).collect();
        let i = line.index(lines.len());
        if value_only {
            if let Some((key, _)) = lines[i].split_once(':') {
                lines[i] = format!("{key}: {}", replacement.trim());
            }
        } else {
            lines[i] = replacement;
        }
        match load(&lines.join("\n")) {
            Ok(_) => {}
            Err(e) => prop_assert!(e.to_string().starts_with("fuzz.yaml") || e.file.contains("tenants"), "{e}"),
        }
    }

    #[test]
    fn config_loader_survives_any_text(raw in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = load(&String::from_utf8_lossy(&raw));
    }
}

#[test]
fn the_shipped_config_loads() {
    load(SHIPPED).expect("conf/sluice.yaml");
}
