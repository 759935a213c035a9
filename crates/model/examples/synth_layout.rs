//! Prints, as JSON, the full-size layout of a synthetic preset in F32: its hyper-parameter
//! metadata and every tensor's name and shape. scripts/mixture_fixture.py builds a data-less
//! (sparse) GGUF from it and asks llama.cpp which type each tensor gets in each file type, without
//! writing gigabytes of weights.
//!
//! Usage: `cargo run -p model --example synth_layout -- PRESET`

use model::mixture::{FileType, QuantScheme};
use model::synth::{tensor_plan, Preset, Shrink};
use serde_json::json;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = std::env::args()
        .nth(1)
        .ok_or("usage: synth_layout PRESET")?;
    let preset = Preset::from_name(&name)?;
    let config = preset.config(preset.spec().n_vocab, &Shrink::default())?;
    let mut md = gguf::Metadata::new();
    md.insert("general.architecture", config.arch.name());
    md.insert("general.name", format!("synthetic {}", preset.name()));
    config.write_metadata(&mut md);
    let metadata: Vec<_> = md
        .iter()
        .map(|(k, v)| match v {
            gguf::Value::U32(x) => json!([k, "u32", x]),
            gguf::Value::F32(x) => json!([k, "f32", x]),
            gguf::Value::String(x) => json!([k, "str", x]),
            other => json!([k, "unsupported", format!("{other:?}")]),
        })
        .collect();
    let tensors: Vec<_> = tensor_plan(&config, QuantScheme::Mixture(FileType::AllF32))
        .into_iter()
        .map(|t| json!([t.name, t.dims]))
        .collect();
    println!(
        "{}",
        json!({"preset": preset.name(), "metadata": metadata, "tensors": tensors})
    );
    Ok(())
}
