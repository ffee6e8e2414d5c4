//! The `sluice replay` command: where the records come from, the candidate config, the output.

use crate::source::{self, Item, Skipped};
use crate::{compare, report, time};
use sluice_config::Config;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Where the recorded decisions are read from.
#[derive(Debug, Clone, clap::Args)]
pub struct SourceArgs {
    /// Read the PostgreSQL ledger at this URL (with --since)
    #[arg(long, conflicts_with = "jsonl")]
    pub database_url: Option<String>,
    /// The ledger's schema [default: the config's ledger.schema, else public]
    #[arg(long)]
    pub schema: Option<String>,
    /// Start of the range: RFC 3339 (2024-05-01T00:00:00Z), unix ms, or a span ago (24h, 90m, 7d)
    #[arg(long)]
    pub since: Option<String>,
    /// End of the range (exclusive), in the same forms [default: now]
    #[arg(long)]
    pub until: Option<String>,
    /// Read decision records from a JSONL file instead (`sluice replay export`, the
    /// sluice::request log lines, a ledger spool segment, a saved /decisions/recent answer)
    #[arg(long)]
    pub jsonl: Option<PathBuf>,
}

#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ReplayArgs {
    #[command(subcommand)]
    pub command: Option<ReplayCommand>,
    /// The candidate config, the one you would reload
    #[arg(short, long, required = true)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub source: SourceArgs,
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// Changed decisions listed one by one in the text output
    #[arg(long, default_value_t = 20)]
    pub show: usize,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum ReplayCommand {
    /// Write the ledger's decision records over a time range as JSONL (one record per line),
    /// the input of `sluice replay --jsonl`
    Export {
        /// The PostgreSQL ledger's URL
        #[arg(long, required = true)]
        database_url: String,
        /// The ledger's schema
        #[arg(long, default_value = "public")]
        schema: String,
        /// Start of the range: RFC 3339, unix ms, or a span ago (24h)
        #[arg(long, required = true)]
        since: String,
        /// End of the range (exclusive) [default: now]
        #[arg(long)]
        until: Option<String>,
        /// Write here instead of standard output
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn range(since: &str, until: Option<&str>) -> Result<(u64, u64), String> {
    let now = now_ms();
    let since = time::parse_time(since, now).map_err(|e| format!("--since: {e}"))?;
    let until = match until {
        Some(u) => time::parse_time(u, now).map_err(|e| format!("--until: {e}"))?,
        None => now,
    };
    if until <= since {
        return Err("--until must be after --since".into());
    }
    Ok((since, until))
}

pub fn run(args: ReplayArgs) -> Result<(), String> {
    match args.command {
        Some(ReplayCommand::Export {
            database_url,
            schema,
            since,
            until,
            output,
        }) => export(&database_url, &schema, &since, until.as_deref(), output),
        None => compare(args),
    }
}

fn export(
    url: &str,
    schema: &str,
    since: &str,
    until: Option<&str>,
    output: Option<PathBuf>,
) -> Result<(), String> {
    let (since, until) = range(since, until)?;
    let out: Box<dyn Write> = match &output {
        Some(p) => Box::new(std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut out = std::io::BufWriter::new(out);
    let mut failed = None;
    let n = sluice_ledger::export::scan(url, schema, since, until, |row| {
        if failed.is_none() {
            let line = serde_json::to_string(&row).map_err(|e| e.to_string());
            failed = line
                .and_then(|l| writeln!(out, "{l}").map_err(|e| e.to_string()))
                .err();
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    out.flush().map_err(|e| e.to_string())?;
    eprintln!("sluice replay export: {n} decision records");
    Ok(())
}

fn compare(args: ReplayArgs) -> Result<(), String> {
    let path = args.config.ok_or("--config is required")?;
    let cfg = Config::load(&path).map_err(|e| e.to_string())?;
    let rules = cfg.policy_rules();
    let mut skipped = Skipped::default();
    let mut items: Vec<Item> = Vec::new();
    let mut read = 0u64;
    let mut keep = |r| {
        read += 1;
        items.extend(source::item_of(r, &mut skipped));
    };
    let src = &args.source;
    let source = match (&src.database_url, &src.jsonl) {
        (Some(url), None) => {
            let since = src
                .since
                .as_deref()
                .ok_or("--since is required with --database-url")?;
            let (since_ms, until_ms) = range(since, src.until.as_deref())?;
            let schema = src.schema.clone().unwrap_or(cfg.ledger.schema.clone());
            sluice_ledger::export::scan(url, &schema, since_ms, until_ms, &mut keep)?;
            report::Source::Ledger {
                schema,
                since_ms,
                until_ms,
            }
        }
        (None, Some(file)) => {
            let f = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
            let mut lines = Skipped::default();
            source::read_jsonl(std::io::BufReader::new(f), &mut lines, &mut keep)?;
            skipped.other_lines = lines.other_lines;
            report::Source::Jsonl {
                path: file.display().to_string(),
            }
        }
        _ => {
            return Err(
                "give the recorded decisions: --database-url URL --since TIME, or --jsonl FILE"
                    .into(),
            )
        }
    };
    source::sort(&mut items);
    let replay = compare::replay(&items, &rules);
    let summaries = compare::summarise(&items, &replay.outcomes);
    let report = report::Report::new(
        source,
        report::Candidate {
            config: path.display().to_string(),
            mode: rules.mode.as_str(),
        },
        read,
        skipped,
        &items,
        &replay.outcomes,
        replay.notes,
        summaries,
    );
    let text = match args.format {
        Format::Json => report.json(),
        Format::Text => report.text(args.show),
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}").map_err(|e| e.to_string())
}
