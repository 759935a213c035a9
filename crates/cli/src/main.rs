//! The `crossover` command line. Thin: parsing and printing; the work lives in the library crates.

mod backends;
mod cmd;
mod default_model;

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
    /// Serve the OpenAI-compatible HTTP API (chat and text completions, streaming, metrics).
    Serve(cmd::serve::ServeArgs),
    /// Generate text from a prompt, streaming it to stdout (timing line on stderr).
    Run(cmd::run::RunArgs),
    /// Talk to a model interactively; the conversation is kept between turns.
    Chat(cmd::run::ChatArgs),
    /// Show a GGUF file's architecture, hyper-parameters, tokenizer, tensors and memory needs.
    Inspect(cmd::inspect::InspectArgs),
    /// Write a random-weight model with a real architecture (for benchmarks and tests).
    Synth(cmd::synth::SynthArgs),
    /// Turn text into token ids with a model's tokenizer (or ids back into text with --decode).
    Tokenize(cmd::tokenize::TokenizeArgs),
    /// Measure time to first token, tokens/s and power per workload and backend.
    Bench(cmd::bench::BenchArgs),
    /// Measure backends across your prompt lengths and write a routing policy from the crossovers.
    Calibrate(cmd::calibrate::CalibrateArgs),
    /// List a model's ops with where they run on a backend, and the share that falls back.
    Audit(cmd::audit::AuditArgs),
}

/// llama.cpp's multi-letter short flags, which clap's one-letter shorts cannot declare, spelled
/// as their long forms (`-nr` -> `--no-repack`); arguments after `--` are left alone.
fn llama_short_flags(
    args: impl Iterator<Item = std::ffi::OsString>,
) -> impl Iterator<Item = std::ffi::OsString> {
    let mut positional = false;
    args.map(move |a| {
        if positional {
            return a;
        }
        if a == "--" {
            positional = true;
        }
        match a.to_str() {
            Some("-nr") => "--no-repack".into(),
            _ => a,
        }
    })
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse_from(llama_short_flags(std::env::args_os()));
    let result: anyhow::Result<()> = match cli.command {
        Command::Serve(a) => cmd::serve::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Chat(a) => cmd::run::chat(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Calibrate(a) => cmd::calibrate::run(a),
        Command::Audit(a) => cmd::audit::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
