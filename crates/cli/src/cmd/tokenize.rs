//! `crossover tokenize`: text to token ids (and back) with a model's own tokenizer, as
//! llama.cpp's `llama-tokenize` does.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use tokenizer::Tokenizer;

/// Turn text into token ids with a model's tokenizer (or ids back into text with --decode).
#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// The GGUF file whose tokenizer is used.
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// The text (with --decode: token ids, as `1 2 3`, `1,2,3` or `[1, 2, 3]`). Read from stdin
    /// with --stdin.
    pub text: Option<String>,
    /// Read the text from stdin.
    #[arg(long, conflicts_with_all = ["text", "jsonl"])]
    pub stdin: bool,
    /// Plain text exactly as llama.cpp's tokenizer tests take it: no BOS/EOS added and special
    /// token text (e.g. `<|im_start|>`) not recognised.
    #[arg(long)]
    pub no_special: bool,
    /// Add no BOS/EOS even if the model asks for them.
    #[arg(long)]
    pub no_bos: bool,
    /// Do not recognise special-token text (with --decode: do not render special tokens).
    #[arg(long)]
    pub no_parse_special: bool,
    /// Print a JSON array of ids (with --decode: a JSON string).
    #[arg(long)]
    pub json: bool,
    /// Print the ids as `[1, 2, 3]` on one line.
    #[arg(long, conflicts_with = "json")]
    pub ids: bool,
    /// Batch mode: read one JSON string per line on stdin and print one JSON array of ids per
    /// line (with --decode: read JSON arrays of ids, print JSON strings).
    #[arg(long, conflicts_with = "text")]
    pub jsonl: bool,
    /// Reverse direction: token ids in, text out.
    #[arg(long)]
    pub decode: bool,
    /// Also print the number of tokens.
    #[arg(long)]
    pub show_count: bool,
}

struct Mode {
    add_special: bool,
    parse_special: bool,
}

/// Parses `1 2 3`, `1,2,3` or `[1, 2, 3]`.
fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
    inner
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .enumerate()
        .map(|(i, t)| {
            t.parse::<u32>()
                .with_context(|| format!("token id #{i} {t:?} is not a non-negative integer"))
        })
        .collect()
}

fn ids_json(ids: &[u32]) -> String {
    serde_json::Value::from(ids.to_vec()).to_string()
}

/// Runs the subcommand.
pub fn run(args: TokenizeArgs) -> Result<()> {
    let file = gguf::GgufFile::open(&args.model)
        .with_context(|| format!("reading {}", args.model.display()))?;
    let tok = Tokenizer::from_gguf(&file)
        .with_context(|| format!("building the tokenizer of {}", args.model.display()))?;
    let mode = Mode {
        add_special: !(args.no_special || args.no_bos),
        parse_special: !(args.no_special || args.no_parse_special),
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());

    if args.jsonl {
        let stdin = std::io::stdin();
        for (n, line) in stdin.lock().lines().enumerate() {
            let line = line.context("reading stdin")?;
            if line.trim().is_empty() {
                continue;
            }
            if args.decode {
                let ids: Vec<u32> = serde_json::from_str(&line)
                    .with_context(|| format!("stdin line {}: not a JSON array of ids", n + 1))?;
                let bytes = tok
                    .detokenize(&ids, false, mode.parse_special)
                    .with_context(|| format!("stdin line {}", n + 1))?;
                let text = String::from_utf8_lossy(&bytes);
                writeln!(out, "{}", serde_json::Value::from(text.as_ref()))?;
            } else {
                let text: String = serde_json::from_str(&line)
                    .with_context(|| format!("stdin line {}: not a JSON string", n + 1))?;
                let ids = tok
                    .encode(&text, mode.add_special, mode.parse_special)
                    .with_context(|| format!("stdin line {}", n + 1))?;
                writeln!(out, "{}", ids_json(&ids))?;
            }
        }
        out.flush()?;
        return Ok(());
    }

    let input = if args.stdin {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin (must be UTF-8)")?;
        s
    } else {
        match args.text {
            Some(t) => t,
            None => bail!("no text given: pass TEXT, --stdin, or --jsonl"),
        }
    };

    if args.decode {
        let ids = parse_ids(&input)?;
        let bytes = tok.detokenize(&ids, false, mode.parse_special)?;
        let text = String::from_utf8_lossy(&bytes);
        if args.json {
            writeln!(out, "{}", serde_json::Value::from(text.as_ref()))?;
        } else {
            writeln!(out, "{text}")?;
        }
        if args.show_count {
            writeln!(out, "Total number of tokens: {}", ids.len())?;
        }
        out.flush()?;
        return Ok(());
    }

    let ids = tok.encode(&input, mode.add_special, mode.parse_special)?;
    if args.json {
        writeln!(out, "{}", ids_json(&ids))?;
    } else if args.ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(out, "[{}]", list.join(", "))?;
    } else {
        for &id in &ids {
            let piece = tok.token_to_piece(id, true).unwrap_or_default();
            match std::str::from_utf8(piece) {
                Ok(s) => writeln!(out, "{id:6} -> '{s}'")?,
                Err(_) => {
                    let hex: Vec<String> = piece.iter().map(|b| format!("{b:02x}")).collect();
                    writeln!(out, "{id:6} -> '<{}>' (partial UTF-8)", hex.join(" "))?
                }
            }
        }
    }
    if args.show_count {
        writeln!(out, "Total number of tokens: {}", ids.len())?;
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_ids;

    #[test]
    fn id_lists_in_the_usual_spellings() {
        assert_eq!(parse_ids("[1, 2, 3]").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids("4,5 6").unwrap(), [4, 5, 6]);
        assert_eq!(parse_ids(" ").unwrap(), Vec::<u32>::new());
        assert!(parse_ids("1 -2").is_err());
        assert!(parse_ids("x").is_err());
    }
}
