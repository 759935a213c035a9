//! Synthetic models: every preset written at tiny scale reads back as the configuration it was
//! made from, with finite, well-scaled weights, the same bytes for the same seed whatever the
//! thread count.

mod common;

use common::{scratch, tiny, tiny_options};
use gguf::{GgmlType, GgufFile};
use model::mixture::{FileType, QuantScheme};
use model::synth::{llama3_rope_factors, synth_to_file, Preset};
use model::{Model, ModelError};

#[test]
fn every_preset_reads_back_as_written() {
    for preset in Preset::ALL {
        let spec = preset.spec();
        let (path, report) = tiny(preset, QuantScheme::Mixture(FileType::MostlyQ4_K_M), 11);
        let m = Model::open(&path).unwrap_or_else(|e| panic!("{}: {e}", preset.name()));
        let c = &m.config;
        assert_eq!(c, &report.config, "{}", preset.name());
        // What the shrink keeps from the published configuration.
        assert_eq!(c.arch, spec.arch);
        assert_eq!(c.head_dim, spec.n_embd / spec.n_head, "{}", spec.name);
        assert_eq!(c.n_gqa(), spec.n_head / spec.n_head_kv, "{}", spec.name);
        assert_eq!(c.n_head_kv, 1);
        assert_eq!(c.n_layer, 2);
        assert_eq!(c.n_ctx_train, spec.n_ctx_train);
        assert_eq!(c.rms_norm_eps, spec.rms_norm_eps);
        assert_eq!(c.rope_freq_base, spec.rope_theta);
        assert_eq!(c.rope_freqs, spec.llama3_rope.is_some());
        assert_eq!(c.tied_output, spec.tied);
        assert_eq!(c.qkv_bias, spec.qkv_bias);
        assert_eq!(
            c.n_vocab, 258,
            "byte-level vocabulary: 256 bytes + BOS + EOS"
        );
        assert_eq!(c.file_type, Some(FileType::MostlyQ4_K_M.id()));
        // The file holds exactly the planned tensors, in order, with the planned types.
        let got: Vec<_> = m
            .file
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.ty, t.dims.clone()))
            .collect();
        let want: Vec<_> = report
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.ty, t.dims.clone()))
            .collect();
        assert_eq!(got, want, "{}", spec.name);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            report.file_bytes,
            "{}",
            spec.name
        );
        if let (Some(r), Some(t)) = (spec.llama3_rope, &m.weights.rope_freqs) {
            let stored = quant::dequantize_to_vec(t.ty, m.file.tensor_data(t), c.n_rot / 2)
                .expect("rope freqs");
            assert_eq!(
                stored,
                llama3_rope_factors(c.rope_freq_base, c.head_dim, &r)
            );
        }
        std::fs::remove_file(&path).ok();
    }
}

#[test]
fn llama3_rope_factors_span_one_to_factor() {
    // Llama 3.2: factor 32, low/high 1/4, 8192 original positions, theta 500000, head size 64.
    let r = Preset::Llama32_1b.spec().llama3_rope.unwrap();
    let f = llama3_rope_factors(500000.0, 64, &r);
    assert_eq!(f.len(), 32);
    assert_eq!(f[0], 1.0, "the fastest rotation is left alone");
    assert_eq!(f[31], 32.0, "the slowest is divided by the full factor");
    assert!(f.windows(2).all(|w| w[0] <= w[1]), "monotone: {f:?}");
    assert!(
        f.iter().any(|&x| x > 1.0 && x < 32.0),
        "a smooth middle band"
    );
}

#[test]
fn same_seed_same_bytes_whatever_the_threads() {
    let scheme = QuantScheme::Mixture(FileType::MostlyQ4_K_M);
    let write = |seed: u64, threads: usize| {
        let mut o = tiny_options(Preset::Qwen25_05b, scheme, seed);
        o.threads = threads;
        let p = scratch("det.gguf");
        synth_to_file(&o, &p, &mut |_| {}).expect("synth");
        let b = std::fs::read(&p).unwrap();
        std::fs::remove_file(&p).ok();
        b
    };
    let a = write(5, 1);
    assert_eq!(a, write(5, 2), "thread count changed the bytes");
    assert_eq!(a, write(5, 0), "thread count changed the bytes");
    assert_ne!(a, write(6, 2), "the seed did not change the weights");
}

/// Every weight of every type decodes to finite values with the scale the generator promises.
#[test]
fn weights_are_finite_and_scaled() {
    for scheme in [
        QuantScheme::Mixture(FileType::MostlyQ4_K_M),
        QuantScheme::Mixture(FileType::MostlyQ8_0),
        QuantScheme::Mixture(FileType::MostlyF16),
        QuantScheme::Mixture(FileType::MostlyBF16),
        QuantScheme::Pure(GgmlType::Q4_0),
        QuantScheme::Pure(GgmlType::Q5_1),
        QuantScheme::Pure(GgmlType::Q3K),
    ] {
        let (path, _) = tiny(Preset::Llama32_1b, scheme, 3);
        let m = Model::open(&path).unwrap();
        let c = &m.config;
        for t in m.file.tensors() {
            let n = t.n_elements() as usize;
            let v = quant::dequantize_to_vec(t.ty, m.file.tensor_data(t), n).unwrap();
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{} {}",
                scheme.label(),
                t.name
            );
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
            let rms = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
            let std = (rms * rms - mean * mean).max(0.0).sqrt();
            let fan_in = t.dims[0] as f64;
            if t.name.ends_with("norm.weight") {
                assert!(
                    (mean - 1.0).abs() < 0.05 && std < 0.15,
                    "{}: {mean} {std}",
                    t.name
                );
            } else if t.name == "token_embd.weight" || t.name == "output.weight" {
                let want = model::synth::LOGIT_STD as f64 / (c.n_embd as f64).sqrt();
                assert!(
                    (std / want - 1.0).abs() < 0.15,
                    "{}: std {std} want {want}",
                    t.name
                );
            } else if t.dims.len() == 2 {
                let want = 1.0 / fan_in.sqrt();
                assert!(
                    (std / want - 1.0).abs() < 0.15,
                    "{} {}: std {std} want {want}",
                    scheme.label(),
                    t.name
                );
            }
        }
        std::fs::remove_file(&path).ok();
    }
}

#[test]
fn unknown_names_list_what_is_supported() {
    let e = Preset::from_name("gpt-5").unwrap_err().to_string();
    for p in Preset::ALL {
        assert!(e.contains(p.name()), "{e}");
    }
    let e = QuantScheme::parse("q1_x", false).unwrap_err().to_string();
    assert!(e.contains("q4_k_m") && e.contains("q8_0"), "{e}");
}

#[test]
fn a_missing_vocabulary_names_the_fetch_script() {
    let mut o = tiny_options(Preset::Llama32_1b, QuantScheme::Pure(GgmlType::Q8_0), 1);
    o.vocab = model::synth::VocabSource::File(scratch("no-such-vocab.gguf"));
    let out = scratch("never.gguf");
    let e = synth_to_file(&o, &out, &mut |_| {}).unwrap_err();
    assert!(matches!(e, ModelError::Vocab { .. }), "{e}");
    assert!(e.to_string().contains("scripts/fetch_vocabs.sh"), "{e}");
    assert!(!out.exists());
}

#[test]
fn the_vocabulary_is_copied_from_a_file() {
    let smol = common::fetched(
        "models/smollm2-135m-instruct-q4_1.gguf",
        "scripts/fetch_model.sh",
    );
    let mut o = tiny_options(Preset::Smollm2_135m, QuantScheme::Pure(GgmlType::Q8_0), 1);
    o.vocab = model::synth::VocabSource::File(smol.clone());
    let out = scratch("smol-vocab.gguf");
    let report = synth_to_file(&o, &out, &mut |_| {}).unwrap();
    let src = GgufFile::open(&smol).unwrap();
    let dst = GgufFile::open(&out).unwrap();
    let mut n = 0;
    for (k, v) in src.metadata().iter() {
        if k.starts_with("tokenizer.") {
            assert_eq!(dst.metadata().get(k), Some(v), "{k}");
            n += 1;
        }
    }
    assert!(n >= 10, "only {n} tokenizer keys copied");
    assert!(dst.metadata().contains_key("tokenizer.chat_template"));
    assert_eq!(report.config.n_vocab, 49152);
    std::fs::remove_file(&out).ok();
}
