//! The `sluice` binary: parses the command line and assembles the crates; the only place that
//! ends the process.

mod demo;
mod server;
mod services;

use clap::{Parser, Subcommand};
use server::ServerFlags;
use services::Drained;
use sluice_config::Config;
use std::path::PathBuf;
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: sluice_runtime::alloc::Allocator = sluice_runtime::alloc::Allocator;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "QoS-aware capacity governance proxy for self-hosted LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        #[arg(short, long, default_value = "conf/sluice.yaml")]
        config: PathBuf,
        /// Replace the configured listeners with this address.
        #[arg(long)]
        listen: Option<String>,
        /// Take over the listening sockets of a running Sluice (graceful upgrade).
        #[arg(short, long)]
        upgrade: bool,
        /// Run in the background.
        #[arg(short, long)]
        daemon: bool,
        /// Test the configuration and exit.
        #[arg(short, long)]
        test: bool,
    },
    /// Validate a configuration and exit non-zero with file, key and reason on error.
    Check {
        #[arg(short, long, default_value = "conf/sluice.yaml")]
        config: PathBuf,
    },
    /// Run the vLLM simulator.
    Sim(sluice_sim::SimArgs),
    /// Run two simulator pools and the proxy on the embedded default config.
    Demo(demo::DemoArgs),
    /// Decide recorded traffic again under a candidate config and report what would change.
    Replay(sluice_replay::ReplayArgs),
}

fn main() -> ExitCode {
    server::init_logging();
    let result = match Cli::parse().command {
        Command::Serve {
            config,
            listen,
            upgrade,
            daemon,
            test,
        } => Config::load(&config)
            .map_err(|e| e.to_string())
            .and_then(|mut cfg| {
                let config = std::fs::canonicalize(&config).unwrap_or(config);
                if let Some(l) = listen {
                    cfg.listen = vec![l];
                }
                let flags = ServerFlags {
                    upgrade,
                    daemon,
                    test,
                };
                let (server, drained) = server::build(cfg, flags, Some(config))?;
                exit_when(drained);
                server.run_forever()
            }),
        Command::Check { config } => Config::load(&config)
            .map(|cfg| {
                let pools: Vec<String> = cfg
                    .pools
                    .iter()
                    .map(|p| {
                        let n = p.config.backends.len();
                        format!("{} ({}, {n} backends)", p.name, p.class().as_str())
                    })
                    .collect();
                println!(
                    "{}: ok ({} tenants, pools {}, {} fallbacks)",
                    config.display(),
                    cfg.tenants.len(),
                    pools.join(", "),
                    cfg.fallbacks.len()
                );
                for line in cfg.objectives() {
                    println!("  {line}");
                }
            })
            .map_err(|e| e.to_string()),
        Command::Sim(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
            .and_then(|rt| {
                rt.block_on(sluice_sim::run(args))
                    .map_err(|e| e.to_string())
            }),
        Command::Demo(args) => demo::run(args),
        Command::Replay(args) => sluice_replay::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Ends the process once the drain reports nothing left in flight, instead of sleeping out the
/// rest of Pingora's fixed grace period (`run_forever` never returns on its own).
fn exit_when(drained: Drained) {
    std::thread::spawn(move || {
        if drained.recv().is_ok() {
            std::process::exit(0);
        }
    });
}
