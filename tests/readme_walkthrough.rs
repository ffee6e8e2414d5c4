//! The README's walk-through, run the way a user runs it: `sluice demo` started, the addresses it
//! prints put where the README says to put them, and each fenced `sh` block of "## Walk-through"
//! pasted line by line into one bash. Every line that documents its answer with a trailing
//! `# <status> <decision> <reason> [<pool>]` is checked against what that line printed: status,
//! decision and reason always, the pool when the README names one. A comment that mentions a
//! status code in any other shape ("still 200") fails the test: there are no approximate
//! answers. The thresholds-mode block runs against a demo in thresholds mode, after the first
//! block's definitions (the lines before its first answer), as a user's shell still has them.

mod common;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one line may run: the README's `until` loops wait for the controller, which takes
/// seconds, longer on a loaded 2-core machine.
const LINE_TIMEOUT: Duration = Duration::from_secs(120);

/// The end of a line's output, with its exit status after it.
const MARKER: &str = "__readme_walkthrough_line_done__";

/// One demo at a time: two walk-throughs loading the same 2 cores would time each other.
static SERIAL: Mutex<()> = Mutex::new(());

const DECISIONS: [&str; 5] = ["pass", "degrade", "queue", "fallback", "reject"];

#[derive(Debug, Clone, PartialEq)]
struct Answer {
    status: String,
    decision: String,
    reason: String,
    pool: Option<String>,
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.status, self.decision, self.reason)?;
        if let Some(p) = &self.pool {
            write!(f, " {p}")?;
        }
        Ok(())
    }
}

/// One command as bash reads it: one README line, or several joined by continuations.
#[derive(Debug, Clone)]
struct Cmd {
    /// README.md line number of its first line.
    line: usize,
    text: String,
    expect: Option<Answer>,
}

/// A fenced `sh` block of the walk-through.
#[derive(Debug)]
struct Block {
    /// README.md line number of the opening fence.
    line: usize,
    cmds: Vec<Cmd>,
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where a shell comment starts in `line`: a `#` at the start of a word, outside quotes.
fn comment_start(line: &str) -> Option<usize> {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single && prev != '\\' => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return Some(i),
            _ => {}
        }
        prev = c;
    }
    None
}

fn is_status(word: &str) -> bool {
    word.len() == 3
        && word.bytes().all(|b| b.is_ascii_digit())
        && (b'1'..=b'5').contains(&word.as_bytes()[0])
}

/// The answer a comment documents: `None` for prose. A comment that names an HTTP status in
/// another shape is an error: an answer is either documented exactly or not at all.
fn documented(comment: &str) -> Result<Option<Answer>, String> {
    let words: Vec<&str> = comment.split_whitespace().collect();
    let Some(first) = words.first() else {
        return Ok(None);
    };
    if !is_status(first) {
        let loose = words
            .iter()
            .map(|w| w.trim_matches(|c: char| !c.is_ascii_alphanumeric()))
            .find(|w| {
                is_status(w) && (w.starts_with('2') || w.starts_with('4') || w.starts_with('5'))
            });
        return match loose {
            Some(w) => Err(format!(
                "the comment {comment:?} mentions {w} but is not `<status> <decision> <reason> [<pool>]`"
            )),
            None => Ok(None),
        };
    }
    let reasons: Vec<&str> = sluice_policy::Reason::ALL
        .iter()
        .map(|r| r.as_str())
        .collect();
    let pool_name = |p: &str| {
        p.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    match words[..] {
        [status, decision, reason] | [status, decision, reason, _]
            if DECISIONS.contains(&decision)
                && reasons.contains(&reason)
                && words.get(3).is_none_or(|p| pool_name(p)) =>
        {
            Ok(Some(Answer {
                status: status.into(),
                decision: decision.into(),
                reason: reason.into(),
                pool: words.get(3).map(|p| p.to_string()),
            }))
        }
        _ => Err(format!(
            "the comment {comment:?} is not `<status> <decision> <reason> [<pool>]` with a decision \
             of {DECISIONS:?}, a reason code of docs/api.md and a pool's name"
        )),
    }
}

/// Whether bash reads `text` as complete commands (no open quote, brace, loop or continuation).
fn complete(text: &str) -> bool {
    Command::new("bash")
        .args(["-n", "-c", text])
        .stderr(Stdio::null())
        .status()
        .expect("bash runs")
        .success()
}

/// The fenced `sh` blocks of README.md's "## Walk-through" section, each as the commands bash
/// reads from it, in order.
fn walkthrough_blocks(readme: &str) -> Vec<Block> {
    let start = readme
        .lines()
        .position(|l| l.starts_with("## Walk-through"))
        .expect("README.md has a '## Walk-through' section");
    let mut blocks = Vec::new();
    let mut open: Option<(usize, Vec<(usize, String)>)> = None;
    for (i, line) in readme.lines().enumerate().skip(start + 1) {
        let n = i + 1;
        if line.starts_with("## ") {
            break;
        }
        let fence = line.trim_start().starts_with("```");
        match (&mut open, fence) {
            (None, true) if line.trim() == "```sh" => open = Some((n, Vec::new())),
            (Some(_), true) => {
                let (at, lines) = open.take().unwrap();
                blocks.push(Block {
                    line: at,
                    cmds: commands(&lines),
                });
            }
            (Some((_, lines)), false) => lines.push((n, line.to_string())),
            _ => {}
        }
    }
    assert!(open.is_none(), "an unclosed fence in the walk-through");
    blocks
}

/// Groups a block's lines into the commands bash reads, each with the answer its last line
/// documents. Blank and comment-only lines are skipped.
fn commands(lines: &[(usize, String)]) -> Vec<Cmd> {
    let mut cmds = Vec::new();
    let mut acc: Option<(usize, String)> = None;
    for (n, line) in lines {
        if acc.is_none() && line.trim().is_empty() {
            continue;
        }
        if let Some(prose) = line
            .trim_start()
            .strip_prefix('#')
            .filter(|_| acc.is_none())
        {
            // A comment on its own documents nothing, and may not pretend to.
            match documented(prose) {
                Ok(None) => continue,
                Ok(Some(a)) => panic!("README.md line {n}: the answer {a} documents no command"),
                Err(e) => panic!("README.md line {n}: {e}"),
            }
        }
        let (first, text) = acc.get_or_insert_with(|| (*n, String::new()));
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(line);
        if !complete(text) {
            continue;
        }
        let comment = comment_start(line).map(|i| line[i + 1..].trim());
        let expect = comment
            .map(documented)
            .transpose()
            .unwrap_or_else(|e| panic!("README.md line {n}: {e}"))
            .flatten();
        cmds.push(Cmd {
            line: *first,
            text: text.clone(),
            expect,
        });
        acc = None;
    }
    if let Some((n, text)) = acc {
        panic!("README.md line {n}: bash never reads a complete command from {text:?}");
    }
    cmds
}

/// The addresses `sluice demo` printed, by the name it printed them under.
#[derive(Debug)]
struct Printed {
    proxy: String,
    ops: String,
    spot: String,
}

fn printed(stdout: &str) -> Option<Printed> {
    let url = |name: &str| {
        stdout
            .lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .map(|u| {
                // `http://host:port/status,` → `http://host:port`
                let scheme = "http://";
                let tail = u.strip_prefix(scheme).unwrap_or(u);
                let host = tail.split(['/', ',']).next().unwrap_or(tail);
                format!("{scheme}{host}")
            })
    };
    Some(Printed {
        proxy: url("proxy ")?,
        ops: url("operations ")?,
        spot: url("spot ")?,
    })
}

/// The README's addresses replaced with the ones the demo printed, as a user does: the default
/// listeners (the test runs the demo on free ports) and the spot simulator's `PORT`.
fn substitute(text: &str, demo: &Printed) -> String {
    text.replace("http://127.0.0.1:8080", &demo.proxy)
        .replace("http://127.0.0.1:8081", &demo.ops)
        .replace("http://127.0.0.1:PORT", &demo.spot)
}

/// A running `sluice demo` and what it printed.
struct Demo {
    _proc: Proc,
    printed: Printed,
    out: PathBuf,
    log: PathBuf,
}

impl Drop for Demo {
    /// Its output stays for a failure's reader only.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.out);
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// Starts `sluice demo` on free ports (again on others should one be taken before it binds)
/// and waits until it is ready.
fn start_demo(mode: &str) -> Demo {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = std::env::temp_dir();
    let tag = format!("{}-{mode}", std::process::id());
    let out = dir.join(format!("sluice-readme-walkthrough-{tag}.out"));
    let log = dir.join(format!("sluice-readme-walkthrough-{tag}.log"));
    for _ in 0..3 {
        let addr = format!("127.0.0.1:{}", free_port());
        let ops = format!("127.0.0.1:{}", free_port());
        let child = Command::new(BIN)
            .args(["demo", "--listen", &addr, "--ops-listen", &ops])
            .env("SLUICE_POLICY_MODE", mode)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut proc = Proc::new(child, addr);
        let ready = format!("http://{ops}/readyz");
        if rt.block_on(wait_started(&mut proc, &ready, &log)) {
            let stdout = std::fs::read_to_string(&out).unwrap_or_default();
            let printed = printed(&stdout)
                .unwrap_or_else(|| panic!("sluice demo did not print its addresses:\n{stdout}"));
            return Demo {
                _proc: proc,
                printed,
                out,
                log,
            };
        }
    }
    panic!("the demo found its port in use three times");
}

/// One bash, fed a command at a time, in its own process group so that whatever the README
/// leaves running in the background (the load) ends with it.
struct Shell {
    child: Child,
    stdin: ChildStdin,
    out: Receiver<String>,
    stderr: PathBuf,
}

impl Shell {
    fn start(tag: &str) -> Shell {
        let stderr = std::env::temp_dir().join(format!(
            "sluice-readme-walkthrough-{}-{tag}.stderr",
            std::process::id()
        ));
        let mut child = Command::new("bash")
            .args(["--noprofile", "--norc"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0)
            .spawn()
            .expect("bash runs");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, out) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Shell {
            child,
            stdin,
            out,
            stderr,
        }
    }

    /// Runs `text` in the shell (its definitions stay for the next commands) and returns what
    /// it printed on stdout and its exit status, or `Err` with the output so far if it did not
    /// end in time.
    fn run(&mut self, text: &str) -> Result<(Vec<String>, String), Vec<String>> {
        // The braces keep it in this shell; stdin is the README's lines, never the command's.
        let script = format!("{{\n{text}\n}} </dev/null\nprintf '\\n{MARKER} %s\\n' \"$?\"\n");
        self.stdin.write_all(script.as_bytes()).unwrap();
        self.stdin.flush().unwrap();
        let deadline = Instant::now() + LINE_TIMEOUT;
        let mut lines = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.out.recv_timeout(left) {
                Ok(l) if l.starts_with(MARKER) => {
                    if lines.last().is_some_and(|l: &String| l.is_empty()) {
                        lines.pop();
                    }
                    let status = l[MARKER.len()..].trim().to_string();
                    return Ok((lines, status));
                }
                Ok(l) => lines.push(l),
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(lines)
                }
            }
        }
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group of a child we started as its leader.
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.stderr);
        }
    }
}

/// On-demand's admission control as `/status` shows it, for a failure's message.
fn admission(ops: &str) -> String {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "5", &format!("{ops}/status")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
    let p = &v["admission_control"]["pools"]["on-demand"];
    format!(
        "level {}, vLLM queue delay {} ms, moved {}",
        p["level"], p["vllm_queue_delay_ms"], p["moved"]
    )
}

/// Runs `cmds` in one shell against `demo`, checking every documented answer.
fn run_block(demo: &Demo, cmds: &[Cmd], tag: &str) {
    let mut shell = Shell::start(tag);
    for cmd in cmds {
        let text = substitute(&cmd.text, &demo.printed);
        let started = Instant::now();
        let result = shell.run(&text);
        eprintln!(
            "README.md:{} ({:.1} s) $ {}",
            cmd.line,
            started.elapsed().as_secs_f64(),
            cmd.text.lines().next().unwrap_or_default()
        );
        let context = || {
            format!(
                "\non-demand now: {}\nbash's stderr:\n{}\nthe demo's log: {}",
                admission(&demo.printed.ops),
                std::fs::read_to_string(&shell.stderr).unwrap_or_default(),
                demo.log.display()
            )
        };
        let (out, status) = match result {
            Ok(done) => done,
            Err(out) => panic!(
                "README.md line {}: `{}` did not finish within {LINE_TIMEOUT:?}; it printed:\n{}{}",
                cmd.line,
                cmd.text,
                out.join("\n"),
                context()
            ),
        };
        for l in &out {
            let cut: String = l.chars().take(160).collect();
            let more = if cut.len() < l.len() { " …" } else { "" };
            eprintln!("    {cut}{more}");
        }
        assert!(
            status == "0",
            "README.md line {}: `{}` exited with status {status}; it printed:\n{}{}",
            cmd.line,
            cmd.text,
            out.join("\n"),
            context()
        );
        let Some(expect) = &cmd.expect else { continue };
        eprintln!("    (then on-demand: {})", admission(&demo.printed.ops));
        let last = out.iter().rev().find(|l| !l.trim().is_empty());
        let words: Vec<&str> = last.map_or(Vec::new(), |l| l.split_whitespace().collect());
        let got = |i: usize| words.get(i).copied().unwrap_or("");
        let matches = got(0) == expect.status
            && got(1) == expect.decision
            && got(2) == expect.reason
            && expect.pool.as_deref().is_none_or(|p| got(3) == p);
        assert!(
            matches,
            "README.md line {}: `{}`\n  documents: {expect}\n  printed:   {}{}",
            cmd.line,
            cmd.text,
            last.map_or("(nothing)", |l| l.as_str()),
            context()
        );
    }
}

fn blocks() -> Vec<Block> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let blocks = walkthrough_blocks(&readme);
    assert!(
        !blocks.is_empty(),
        "the walk-through has no ```sh block to run"
    );
    // The first block runs against the demo, the second in thresholds mode; a later one is not
    // run, so it may document no answer.
    for b in blocks.iter().skip(2) {
        assert!(
            b.cmds.iter().all(|c| c.expect.is_none()),
            "README.md line {}: a third ```sh block documents answers no test checks",
            b.line
        );
    }
    blocks
}

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn the_walkthrough_holds_against_sluice_demo() {
    let _one = serial();
    let blocks = blocks();
    let first = &blocks[0];
    let text: String = first.cmds.iter().map(|c| c.text.as_str()).collect();
    for placeholder in [
        "http://127.0.0.1:8080",
        "http://127.0.0.1:8081",
        "http://127.0.0.1:PORT",
    ] {
        assert!(
            text.contains(placeholder),
            "README.md line {}: the first walk-through block no longer sets {placeholder}, \
             which this test replaces with what the demo prints",
            first.line
        );
    }
    // The rungs the walk-through exists to show: a pass, a capped Standard request, a lower tier
    // shed for a higher one, a tightened first token refused, the KV rail.
    let reasons: Vec<&str> = first
        .cmds
        .iter()
        .filter_map(|c| c.expect.as_ref().map(|a| a.reason.as_str()))
        .collect();
    for rung in [
        &["admitted_slo_headroom"][..],
        &["degrade_slo_headroom", "degrade_brownout"],
        &["reject_slo_headroom"],
        &["reject_slo_unattainable"],
        &["reject_pressure_rail"],
    ] {
        assert!(
            rung.iter().any(|r| reasons.contains(r)),
            "README.md line {}: the walk-through no longer shows {rung:?}",
            first.line
        );
    }
    let demo = start_demo("adaptive");
    run_block(&demo, &first.cmds, "adaptive");
}

#[test]
fn the_thresholds_block_holds_in_thresholds_mode() {
    let _one = serial();
    let blocks = blocks();
    let Some(block) = blocks.get(1) else {
        panic!("the walk-through has no second (thresholds mode) ```sh block");
    };
    let defs: Vec<Cmd> = blocks[0]
        .cmds
        .iter()
        .take_while(|c| c.expect.is_none())
        .cloned()
        .collect();
    assert!(
        block.cmds.iter().any(|c| c.expect.is_some()),
        "README.md line {}: the thresholds block documents no answer",
        block.line
    );
    let demo = start_demo("thresholds");
    let cmds: Vec<Cmd> = defs.into_iter().chain(block.cmds.iter().cloned()).collect();
    run_block(&demo, &cmds, "thresholds");
}

#[test]
fn answers_are_read_exactly_and_loose_ones_refused() {
    let ans = |c: &str| documented(c).unwrap();
    assert_eq!(
        ans("200 pass admitted_slo_headroom spot"),
        Some(Answer {
            status: "200".into(),
            decision: "pass".into(),
            reason: "admitted_slo_headroom".into(),
            pool: Some("spot".into()),
        })
    );
    assert_eq!(ans("429 reject reject_slo_headroom").unwrap().pool, None);
    assert_eq!(ans("spot is reclaimed: on-demand takes everyone"), None);
    assert_eq!(ans("on-demand KV at 100 %"), None);
    for loose in [
        "still 200: Best-Effort runs on spot",
        "200 degrade degrade_slo_headroom (then degrade_brownout)",
        "200 pass",
        "200 passes admitted_slo_headroom",
        "429 reject not_a_reason",
        "200 pass admitted_slo_headroom (maybe)",
    ] {
        assert!(documented(loose).is_err(), "{loose:?} was accepted");
    }
    assert_eq!(comment_start("chat x   # 200 pass a"), Some(9));
    assert_eq!(comment_start("curl -H 'a: #1' -d \"#\" x"), None);
    assert_eq!(comment_start("echo a#b"), None);
    let cmds = commands(&[
        (1, "f() { echo a \\".into()),
        (2, "  b; }   # 200 pass admitted_slo_headroom".into()),
        (3, String::new()),
        (4, "# prose".into()),
        (5, "f".into()),
    ]);
    assert_eq!(cmds.len(), 2);
    assert_eq!(cmds[0].line, 1);
    assert!(cmds[0].expect.is_some() && cmds[1].expect.is_none());
    let p = printed(
        "  proxy      http://127.0.0.1:1\n  operations http://127.0.0.1:2/status, x\n  \
         on-demand  http://127.0.0.1:3  (sim)\n  spot       http://127.0.0.1:4  (sim)\n",
    )
    .unwrap();
    assert_eq!(
        substitute(
            "U=http://127.0.0.1:8080; O=http://127.0.0.1:8081; SP=http://127.0.0.1:PORT",
            &p
        ),
        "U=http://127.0.0.1:1; O=http://127.0.0.1:2; SP=http://127.0.0.1:4"
    );
}
