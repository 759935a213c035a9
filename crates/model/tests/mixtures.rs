//! Which tensor gets which type: ours against llama.cpp's own quantizer, run in dry-run mode on
//! every preset at full size for every file type (fixture by scripts/mixture_fixture.py).

mod common;

use gguf::GgmlType;
use model::mixture::{FileType, QuantScheme};
use model::synth::{tensor_plan, Preset, Shrink};
use serde_json::Value;

#[test]
fn mixtures_match_llama_cpp_for_every_preset_and_file_type() {
    let p = common::repo().join("crates/model/tests/fixtures/llama_cpp_mixtures.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let presets = fx["presets"].as_object().unwrap();
    assert_eq!(
        presets.len(),
        Preset::ALL.len(),
        "fixture covers every preset"
    );
    let mut compared = 0;
    for preset in Preset::ALL {
        let entry = &presets[preset.name()];
        let names: Vec<&str> = entry["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        let config = preset
            .config(preset.spec().n_vocab, &Shrink::default())
            .unwrap();
        let types = entry["types"].as_object().unwrap();
        assert_eq!(types.len(), FileType::ALL.len(), "{}", preset.name());
        for ftype in FileType::ALL {
            let theirs: Vec<GgmlType> = types[ftype.name()]
                .as_str()
                .unwrap()
                .split(' ')
                .map(|t| GgmlType::from_name(t).unwrap_or_else(|| panic!("type {t}")))
                .collect();
            let ours = tensor_plan(&config, QuantScheme::Mixture(ftype));
            assert_eq!(
                ours.len(),
                names.len(),
                "{} {}",
                preset.name(),
                ftype.name()
            );
            for ((t, name), want) in ours.iter().zip(&names).zip(&theirs) {
                assert_eq!(t.name, *name);
                assert_eq!(
                    t.ty,
                    *want,
                    "{} {}: {} (shape {:?})",
                    preset.name(),
                    ftype.name(),
                    t.name,
                    t.dims
                );
                compared += 1;
            }
        }
    }
    assert!(compared > 10_000, "{compared}");
}

/// The mixtures the issue names in their expected shape: Q4_K_M on a 1B-shaped model is Q4_K with
/// Q6_K on the output (tied: the embedding) and on some attn_v / ffn_down.
#[test]
fn q4_k_m_on_llama_3_2_1b_mixes_q4_k_and_q6_k() {
    let preset = Preset::Llama32_1b;
    let config = preset
        .config(preset.spec().n_vocab, &Shrink::default())
        .unwrap();
    let plan = tensor_plan(&config, QuantScheme::Mixture(FileType::MostlyQ4_K_M));
    let mut kinds = std::collections::BTreeSet::new();
    for t in &plan {
        kinds.insert(t.ty);
    }
    assert_eq!(
        kinds.into_iter().collect::<Vec<_>>(),
        vec![GgmlType::F32, GgmlType::Q4K, GgmlType::Q6K]
    );
}
