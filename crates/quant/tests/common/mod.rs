//! Loading the fixtures written by `scripts/gen_quant_fixtures.py`; [`inputs`]: what the kernel
//! tests share about their random inputs.
#![allow(dead_code)]

pub mod inputs;

use std::path::{Path, PathBuf};

use gguf::GgmlType;
use serde_json::Value;

pub const REGEN: &str = "run `python3 scripts/gen_quant_fixtures.py` to (re)generate them";

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn manifest() -> Value {
    let path = fixture_dir().join("manifest.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}; {REGEN}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn read_bytes(name: &str) -> Vec<u8> {
    let path = fixture_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}; {REGEN}", path.display()))
}

fn read_f32(name: &str) -> Vec<f32> {
    read_bytes(name)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

pub struct Case {
    pub name: String,
    pub ty: GgmlType,
    pub source: String,
    pub input: Option<Vec<f32>>,
    pub n: usize,
    pub quant: Vec<u8>,
    /// The reference's dequantization of `quant`, where the case has one.
    pub dequant: Option<Vec<f32>>,
}

pub fn cases() -> Vec<Case> {
    let m = manifest();
    let inputs = &m["inputs"];
    m["cases"]
        .as_array()
        .expect("manifest.cases is an array")
        .iter()
        .map(|c| {
            let name = c["name"].as_str().expect("case name").to_string();
            let ty_name = c["type"].as_str().expect("case type");
            let ty = GgmlType::from_name(ty_name)
                .unwrap_or_else(|| panic!("{name}: unknown type {ty_name}"));
            let input = c["input"]
                .as_str()
                .map(|k| read_f32(inputs[k]["file"].as_str().expect("input file")));
            Case {
                ty,
                source: c["source"].as_str().expect("case source").to_string(),
                input,
                n: c["n"].as_u64().expect("case n") as usize,
                quant: read_bytes(c["quant"].as_str().expect("quant file")),
                dequant: c["dequant"].as_str().map(read_f32),
                name,
            }
        })
        .collect()
}

/// Index and bit patterns of the first mismatch, and how many elements differ.
pub fn bit_diff(a: &[f32], b: &[f32]) -> Option<(usize, u32, u32, usize)> {
    let diffs: Vec<usize> = (0..a.len())
        .filter(|&i| a[i].to_bits() != b[i].to_bits())
        .collect();
    diffs
        .first()
        .map(|&i| (i, a[i].to_bits(), b[i].to_bits(), diffs.len()))
}
