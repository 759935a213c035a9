//! The `crossover` command line. Thin: parsing and printing; the work lives in the library crates.

mod cmd;

use clap::{Parser, Subcommand};

/// On-device LLM inference runtime: one actor per compute backend, routed by measurement.
#[derive(Parser)]
#[command(name = "crossover", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    // Each subcommand lives in its own file under src/cmd/; add one variant and one match arm here.
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {};
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
