//! A fleet behind one endpoint, over real HTTP against `sluice serve` and `sluice sim`
//! replicas: requests reach only pools that serve their model (declared or discovered, LoRA
//! adapters included), `/v1/models` is the fleet's union, replicas are chosen by prompt head
//! and by load, the tier reaches vLLM's own scheduler where a pool asks for it, and a client
//! that goes away stops the work it started.

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn sim_stats(sim: &Proc) -> Value {
    get_json(&sim.url("/admin/stats")).await
}

/// What each simulator was asked for, by model.
async fn by_model(sim: &Proc) -> BTreeMap<String, u64> {
    serde_json::from_value(sim_stats(sim).await["requests_by_model"].clone()).unwrap()
}

/// A config of named pools (`[(name, backends, extra)]`); models are discovered quickly.
fn fleet(pools: &[(&str, &[&str], Value)]) -> Value {
    let mut cfg = config(&[], &[]);
    let hc = cfg["pools"]["on-demand"]["health_check"].clone();
    let mut map = serde_json::Map::new();
    for (name, backends, extra) in pools {
        let mut p = json!({"backends": backends, "health_check": hc});
        merge(&mut p, extra.clone());
        map.insert(name.to_string(), p);
    }
    cfg["pools"] = Value::Object(map);
    merge(
        &mut cfg,
        json!({"routing": {"models_refresh_ms": 200, "models_timeout_ms": 500}}),
    );
    cfg
}

async fn models_listed(s: &Sluice) -> BTreeSet<String> {
    let v = get_json(&s.url("/v1/models")).await;
    assert_eq!(v["object"], "list", "{v}");
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["object"], "model", "{m}");
            m["id"].as_str().unwrap().to_string()
        })
        .collect()
}

/// The backend address the decision record of `r` names.
async fn backend_of(s: &Sluice, r: &reqwest::Response) -> String {
    let rec = s.record(header(r, "x-request-id")).await;
    rec["backend"].as_str().unwrap_or_default().to_string()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

const TENANTS: [&str; 3] = ["support-bot", "coding-assistant", "batch-analytics"];

#[tokio::test]
async fn three_models_reach_only_their_pools_and_models_lists_the_union() {
    let big = sim("llama-3-70b", &[]).await;
    let big_spot = sim("llama-3-70b", &[]).await;
    let small = sim("llama-3-8b", &[]).await;
    let mistral = sim("mistral-7b", &[]).await;
    let s = serve(&fleet(&[
        ("on-demand", &[&big.addr], json!({})),
        ("spot", &[&big_spot.addr], json!({})),
        ("small", &[&small.addr], json!({})),
        (
            "mistral",
            &[&mistral.addr],
            json!({"models": ["mistral-7b"]}),
        ),
    ]))
    .await;
    wait_for(Duration::from_secs(5), "every model discovered", || async {
        let st = s.status().await;
        (st["routes"]["complete"] == true).then_some(())
    })
    .await;
    assert_eq!(
        models_listed(&s).await,
        set(&["llama-3-70b", "llama-3-8b", "mistral-7b"])
    );

    for model in ["llama-3-70b", "llama-3-8b", "mistral-7b"] {
        for tenant in TENANTS {
            let r = s.chat(tenant, chat_body(model, Some(4))).await;
            assert_eq!(r.status(), 200, "{tenant} {model}");
        }
    }
    let served: Vec<BTreeMap<String, u64>> = vec![
        by_model(&big).await,
        by_model(&big_spot).await,
        by_model(&small).await,
        by_model(&mistral).await,
    ];
    // Best-Effort's 70B request goes to spot; the models without a spot pool stay on theirs.
    assert_eq!(served[0], BTreeMap::from([("llama-3-70b".into(), 2)]));
    assert_eq!(served[1], BTreeMap::from([("llama-3-70b".into(), 1)]));
    assert_eq!(served[2], BTreeMap::from([("llama-3-8b".into(), 3)]));
    assert_eq!(served[3], BTreeMap::from([("mistral-7b".into(), 3)]));

    // An unknown model is answered by Sluice in OpenAI's shape; no backend hears of it.
    let r = s.chat("support-bot", chat_body("gpt-4", Some(4))).await;
    assert_eq!(r.status(), 404);
    assert_eq!(header(&r, "x-sluice-reason"), "model_not_found");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("gpt-4"));
    for sim in [&big, &big_spot, &small, &mistral] {
        assert!(!by_model(sim).await.contains_key("gpt-4"));
    }
}

#[tokio::test]
async fn an_adapter_loaded_later_is_discovered_and_reaches_only_its_backend() {
    let a = sim("llama-3-70b", &[]).await;
    let b = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&fleet(&[
        (
            "on-demand",
            &[&a.addr, &b.addr],
            json!({"selection": "round_robin"}),
        ),
        ("spot", &[&sp.addr], json!({})),
    ]))
    .await;
    // Until every backend has answered its first `/v1/models`, an unknown model is let through.
    wait_for(Duration::from_secs(5), "every model discovered", || async {
        (s.status().await["routes"]["complete"] == true).then_some(())
    })
    .await;
    let r = s.chat("support-bot", chat_body("sql-lora", Some(4))).await;
    assert_eq!(r.status(), 404, "not loaded anywhere yet");

    let r = client()
        .post(b.url("/v1/load_lora_adapter"))
        .json(&json!({"lora_name": "sql-lora", "lora_path": "/adapters/sql"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    wait_for(Duration::from_secs(5), "the adapter discovered", || async {
        models_listed(&s).await.contains("sql-lora").then_some(())
    })
    .await;
    for _ in 0..6 {
        let r = s.chat("support-bot", chat_body("sql-lora", Some(4))).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(by_model(&b).await.get("sql-lora"), Some(&6));
    assert_eq!(by_model(&a).await.get("sql-lora"), None);
}

/// Exactly `chars` characters of system prompt, distinct per `tag` from the first character.
fn system_prompt(tag: usize, chars: usize) -> String {
    let mut s = format!("[{tag}] You are the assistant of team {tag}. ");
    while s.len() < chars {
        s.push_str("Answer briefly, cite the runbook, never guess. ");
    }
    s.truncate(chars);
    s
}

fn chat_with(system: &str, user: &str) -> Value {
    json!({
        "model": "llama-3-70b",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    })
}

/// Which backend served each of 8 prompt heads, 4 requests each, one at a time.
async fn backends_by_prompt(selection: &str) -> (Vec<BTreeSet<String>>, u64) {
    let sims = [
        sim("llama-3-70b", &[]).await,
        sim("llama-3-70b", &[]).await,
        sim("llama-3-70b", &[]).await,
    ];
    let sp = sim("llama-3-70b", &[]).await;
    let addrs: Vec<&str> = sims.iter().map(|p| p.addr.as_str()).collect();
    let s = serve(&fleet(&[
        ("on-demand", &addrs, json!({"selection": selection})),
        ("spot", &[&sp.addr], json!({})),
    ]))
    .await;
    let mut by_prompt = Vec::new();
    for p in 0..8 {
        let system = system_prompt(p, 4000);
        let mut seen = BTreeSet::new();
        for turn in 0..4 {
            let r = s
                .chat(
                    "support-bot",
                    chat_with(&system, &format!("question {turn}")),
                )
                .await;
            assert_eq!(r.status(), 200);
            seen.insert(backend_of(&s, &r).await);
        }
        by_prompt.push(seen);
    }
    let mut hits = 0;
    for p in &sims {
        hits += sim_stats(p).await["prefix_cache_hit_tokens"]
            .as_u64()
            .unwrap();
    }
    (by_prompt, hits)
}

#[tokio::test]
async fn a_shared_prompt_head_stays_on_one_replica_and_hits_its_cache() {
    let (affine, affine_hits) = backends_by_prompt("prefix_affinity").await;
    for (p, seen) in affine.iter().enumerate() {
        assert_eq!(seen.len(), 1, "prompt {p} went to {seen:?}");
    }
    let used: BTreeSet<&String> = affine.iter().flatten().collect();
    assert!(used.len() >= 2, "8 prompt heads all on {used:?}");

    let (rr, rr_hits) = backends_by_prompt("round_robin").await;
    assert!(rr.iter().all(|seen| seen.len() >= 2), "{rr:?}");
    assert!(
        affine_hits > rr_hits,
        "prefix hits: affinity {affine_hits}, round robin {rr_hits}"
    );
}

/// Three replicas answering in 100 ms whatever they cached (so least load has no reason to
/// prefer one), whose free prefix cache keeps `cache_tokens` and whose answers report the
/// cached tokens, behind an on-demand pool with prefix affinity; a spot replica after them.
async fn affinity_pool(cache_tokens: u64) -> (std::sync::Arc<Sluice>, Vec<Proc>) {
    let cache = cache_tokens.to_string();
    let flags = [
        "--ttft-ms",
        "100",
        "--prefill-us-per-token",
        "0",
        "--enable-prompt-tokens-details",
        "--prefix-cache-tokens",
        &cache,
    ];
    let mut sims = Vec::new();
    for _ in 0..3 {
        sims.push(sim("llama-3-70b", &flags).await);
    }
    let sp = sim("llama-3-70b", &[]).await;
    let addrs: Vec<&str> = sims.iter().map(|p| p.addr.as_str()).collect();
    let mut cfg = fleet(&[
        ("on-demand", &addrs, json!({"selection": "prefix_affinity"})),
        ("spot", &[&sp.addr], json!({})),
    ]);
    merge(
        &mut cfg,
        json!({"tiers": {"Guaranteed": {"inflight_capacity": 64}}}),
    );
    let s = std::sync::Arc::new(serve(&cfg).await);
    // Spot last: it serves Best-Effort, which these tests do not send.
    sims.push(sp);
    (s, sims)
}

fn on_demand_affinity(status: &Value) -> Value {
    status["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "on-demand")
        .unwrap()
        .clone()
}

/// Four closed-loop clients cycling over `heads` system prompts (4,000 characters, more than the
/// head that keys a home: 62 cached blocks each) until the on-demand pool's affinity is in `state`; returns that pool's status.
async fn drive_until(s: &std::sync::Arc<Sluice>, heads: usize, state: &str) -> Value {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..4usize {
        let (s, stop) = (s.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let head = (c * 7 + n * 13) % heads;
                let body = chat_with(&system_prompt(head, 4000), &format!("q {c} {n}"));
                assert_eq!(s.chat("support-bot", body).await.status(), 200);
                n += 1;
            }
        }));
    }
    let pool = wait_for(Duration::from_secs(30), state, || async {
        let p = on_demand_affinity(&s.status().await);
        (p["affinity"]["state"] == state).then_some(p)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    pool
}

/// Nine requests of one head at once, each held ~0.4 s: how many each replica received.
async fn burst(s: &Sluice, sims: &[Proc], head: usize) -> Vec<u64> {
    let received = || async {
        let mut v = Vec::new();
        for p in sims {
            v.push(sim_stats(p).await["received"].as_u64().unwrap());
        }
        v
    };
    let before = received().await;
    let mut body = chat_with(&system_prompt(head, 4000), "burst");
    body["max_tokens"] = json!(300);
    let sends = (0..9).map(|_| s.chat("support-bot", body.clone()));
    for r in futures_util::future::join_all(sends).await {
        assert_eq!(r.status(), 200);
    }
    let after = received().await;
    after.iter().zip(&before).map(|(a, b)| a - b).collect()
}

#[tokio::test]
async fn prefix_affinity_spreads_by_load_when_homes_do_not_keep_their_heads() {
    // Three heads, and room for four in each replica's free cache: homes keep them.
    let (s, sims) = affinity_pool(4000).await;
    let pool = drive_until(&s, 3, "paying").await;
    let a = &pool["affinity"];
    assert_eq!(a["paying"], true, "{a}");
    assert!(a["verdict_hit_rate"].as_f64().unwrap() >= 0.85, "{a}");
    assert!(a["hit_rate"].as_f64().unwrap() >= 0.9, "{a}");
    assert_eq!(a["without_cached_tokens"], 0, "{a}");
    let burst_fit = burst(&s, &sims[..3], 0).await;
    assert!(
        burst_fit.iter().max().unwrap() >= &5,
        "a head's burst stays home up to its bound: {burst_fit:?}"
    );
    let fit_rate = wait_for(Duration::from_secs(5), "the scraped hit rate", || async {
        on_demand_affinity(&s.status().await)["prefix_cache_hit_rate"].as_f64()
    })
    .await;
    drop(s);

    // Thirty heads, ten a replica, and room for two in its free cache: homes lose them.
    let (s, sims) = affinity_pool(2000).await;
    let pool = drive_until(&s, 30, "spreading").await;
    let a = &pool["affinity"];
    assert_eq!(a["paying"], false, "{a}");
    assert!(a["verdict_hit_rate"].as_f64().unwrap() < 0.85, "{a}");
    assert!(a["retry_in_ms"].as_u64().unwrap() > 30_000, "{a}");
    // Logged when it happened: a log record whose message is the event's JSON.
    let events: Vec<Value> = s
        .log()
        .lines()
        .filter(|l| l.contains("prefix_affinity"))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|r| serde_json::from_str::<Value>(r["message"].as_str()?).ok())
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "prefix_affinity" && e["state"] == "spreading"),
        "{events:?}"
    );
    // The same burst now goes where load is least: every replica takes its part.
    let burst_thrash = burst(&s, &sims[..3], 0).await;
    assert!(
        burst_thrash.iter().all(|n| (2..=4).contains(n)),
        "spread by load: {burst_thrash:?}"
    );
    let thrash_rate = on_demand_affinity(&s.status().await)["prefix_cache_hit_rate"]
        .as_f64()
        .unwrap();
    assert!(
        thrash_rate < fit_rate,
        "vLLM's counters: {thrash_rate} thrashing, {fit_rate} fitting"
    );
}

#[tokio::test]
async fn least_load_sends_less_to_a_slowed_replica() {
    let fast = sim("llama-3-70b", &[]).await;
    let slow = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = fleet(&[
        (
            "on-demand",
            &[&fast.addr, &slow.addr],
            json!({"selection": "least_load"}),
        ),
        ("spot", &[&sp.addr], json!({})),
    ]);
    merge(
        &mut cfg,
        json!({"tiers": {"Guaranteed": {"inflight_capacity": 64}}}),
    );
    let s = std::sync::Arc::new(serve(&cfg).await);
    sim_admin(&slow, "/admin/latency", json!({"extra_ms": 400})).await;
    // Eight clients, each sending its next request when the last is answered.
    let mut clients = Vec::new();
    for c in 0..8 {
        let s = s.clone();
        clients.push(tokio::spawn(async move {
            for i in 0..8 {
                let body = chat_with(&system_prompt(c * 100 + i, 200), "hi");
                assert_eq!(s.chat("support-bot", body).await.status(), 200);
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    let on = |p: &Proc| {
        let p = p.url("/admin/stats");
        async move { get_json(&p).await["completed"].as_u64().unwrap() }
    };
    let (f, sl) = (on(&fast).await, on(&slow).await);
    assert_eq!(f + sl, 64);
    // Round robin would send it half; least load keeps it well under.
    assert!(sl * 4 <= f + sl, "slowed replica served {sl} of 64");
}

#[tokio::test]
async fn the_tier_reaches_vllm_only_where_the_pool_asks_for_it() {
    let od = sim("llama-3-70b", &["--scheduling-policy", "priority"]).await;
    let sp = sim("llama-3-70b", &["--scheduling-policy", "priority"]).await;
    let s = serve(&fleet(&[
        ("on-demand", &[&od.addr], json!({"vllm_priority": true})),
        ("spot", &[&sp.addr], json!({"vllm_priority": true})),
    ]))
    .await;
    for tenant in TENANTS {
        // A client's own priority is never trusted.
        let mut body = chat_body("llama-3-70b", Some(3));
        body["priority"] = json!(-100);
        assert_eq!(s.chat(tenant, body).await.status(), 200, "{tenant}");
    }
    let od_p = sim_stats(&od).await["admitted_by_priority"].clone();
    let sp_p = sim_stats(&sp).await["admitted_by_priority"].clone();
    assert_eq!(od_p, json!({"0": 1, "1": 1}), "Guaranteed 0, Standard 1");
    assert_eq!(sp_p, json!({"2": 1}), "Best-Effort 2");

    // Off (the default): vLLM with FCFS refuses a non-zero priority, so Sluice removes it.
    let fcfs = sim("llama-3-70b", &[]).await;
    let sp2 = sim("llama-3-70b", &[]).await;
    let s = serve(&fleet(&[
        ("on-demand", &[&fcfs.addr], json!({})),
        ("spot", &[&sp2.addr], json!({})),
    ]))
    .await;
    let mut body = chat_body("llama-3-70b", Some(3));
    body["priority"] = json!(-100);
    assert_eq!(s.chat("support-bot", body).await.status(), 200);
    assert_eq!(
        sim_stats(&fcfs).await["admitted_by_priority"],
        json!({"0": 1})
    );
}

/// Sends a chat request on a raw socket, reads the first bytes of the answer when `stream`,
/// then closes the connection while the backend is still generating.
async fn leave_midway(s: &Sluice, stream: bool) {
    let body = json!({
        "model": "llama-3-70b",
        "max_tokens": 400,
        "stream": stream,
        "messages": [{"role": "user", "content": "write a long essay"}],
    })
    .to_string();
    let mut sock = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nX-Tenant-ID: support-bot\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    if stream {
        let mut buf = [0u8; 256];
        let n = sock.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    } else {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    drop(sock);
}

#[tokio::test]
async fn a_client_that_goes_away_stops_the_backend_and_frees_its_slot() {
    // 400 tokens at 10 ms each: four seconds of work the client does not wait for.
    let od = sim("llama-3-70b", &["--itl-ms", "10"]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&config(&[&od.addr], &[&sp.addr])).await;
    for (i, stream) in [(1, true), (2, false)] {
        leave_midway(&s, stream).await;
        wait_for(
            Duration::from_secs(2),
            "the backend aborts the request",
            || async {
                let st = sim_stats(&od).await;
                (st["aborted"] == i && st["running"] == 0).then_some(())
            },
        )
        .await;
        wait_for(Duration::from_secs(2), "the slot returns", || async {
            (s.tier("Guaranteed").await["inflight"] == 0).then_some(())
        })
        .await;
    }
    assert_eq!(sim_stats(&od).await["completed"], 0);
}

#[tokio::test]
async fn a_queued_client_that_leaves_is_never_sent() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({
            "tiers": {"Standard": {"inflight_capacity": 1}},
            "queue": {"max_size": 4, "max_wait_seconds": 10},
        }),
    );
    let s = std::sync::Arc::new(serve(&cfg).await);
    sim_admin(&od, "/admin/latency", json!({"extra_ms": 1500})).await;
    let holder = {
        let s = s.clone();
        tokio::spawn(async move {
            s.chat("coding-assistant", chat_body("llama-3-70b", Some(3)))
                .await
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let leaver = {
        let s = s.clone();
        tokio::spawn(async move {
            let _ = s
                .chat("coding-assistant", chat_body("llama-3-70b", Some(3)))
                .await;
        })
    };
    wait_for(Duration::from_secs(3), "a queued request", || async {
        (s.tier("Standard").await["queued"] == 1).then_some(())
    })
    .await;
    leaver.abort();
    wait_for(Duration::from_secs(3), "the queue empties", || async {
        (s.tier("Standard").await["queued"] == 0).then_some(())
    })
    .await;
    assert_eq!(holder.await.unwrap(), 200);
    let gone = wait_for(Duration::from_secs(3), "the client_gone record", || async {
        s.recent("limit=20")
            .await
            .into_iter()
            .find(|d| d["reason"] == "client_gone")
    })
    .await;
    assert_eq!(gone["status"], 499, "{gone}");
    assert!(gone["backend"].is_null(), "{gone}");
    assert_eq!(
        sim_stats(&od).await["received"],
        1,
        "only the holder was sent"
    );
}

#[tokio::test]
async fn a_large_body_is_routed_by_a_model_named_at_its_end() {
    let big = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let small = sim("llama-3-8b", &["--kv-tokens", "200000"]).await;
    let s = serve(&fleet(&[
        (
            "on-demand",
            &[&big.addr],
            json!({"models": ["llama-3-70b"]}),
        ),
        ("spot", &[&sp.addr], json!({"models": ["llama-3-70b"]})),
        ("small", &[&small.addr], json!({"models": ["llama-3-8b"]})),
    ]))
    .await;
    // ~300 KiB of conversation before the model: more than one read of the body.
    let long = "lorem ipsum ".repeat(25_000);
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{long}"}}],"max_tokens":2,"model":"llama-3-8b"}}"#
    );
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .header("x-tenant-id", "support-bot")
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(by_model(&small).await.get("llama-3-8b"), Some(&1));

    // The same body chunked, as streaming uploads send it: no length to read ahead by.
    let mut sock = tokio::net::TcpStream::connect(&s.addr).await.unwrap();
    let (head, tail) = body.split_at(body.len() / 2);
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nX-Tenant-ID: support-bot\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
         {:x}\r\n{head}\r\n{:x}\r\n{tail}\r\n0\r\n\r\n",
        head.len(),
        tail.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut answer = String::new();
    sock.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(by_model(&small).await.get("llama-3-8b"), Some(&2));
    assert!(by_model(&big).await.is_empty());
}
