//! Properties that hold whatever the reference: parallel and serial paths agree, bad sizes and
//! types are refused with errors naming them, unaligned buffers work, and the activation formats
//! (Q8_1, Q8_K, which no file format stores) keep their invariants.

use gguf::GgmlType;
use quant::blocks::{BlockQ8K, BlockQ8_1};
use quant::{
    can_dequantize, can_quantize, dequantize, dequantize_serial, dequantize_to_vec, quantize,
    quantize_serial, quantize_to_vec, QuantError,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const ALL_QUANTIZABLE: [GgmlType; 15] = {
    use GgmlType::*;
    [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K,
    ]
};

fn random_weights(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            // Block-to-block changes of scale, so parallel chunks see different data.
            let scale = 10f32.powi((i / 4096 % 7) as i32 - 3);
            let v: f32 = rng.gen_range(-1.0..1.0);
            if rng.gen_bool(0.02) {
                0.0
            } else {
                v * scale
            }
        })
        .collect()
}

#[test]
fn parallel_and_serial_agree_for_every_type() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0001);
    // Above the parallel threshold and not a multiple of the parallel chunk.
    let n = quant::dequant::PAR_MIN_ELEMS * 2 + 256 * 7;
    let x = random_weights(&mut rng, n);
    for ty in ALL_QUANTIZABLE {
        assert!(can_quantize(ty) && can_dequantize(ty), "{ty}");
        let bytes = ty.bytes_for(n as u64).expect("size") as usize;
        let (mut par, mut ser) = (vec![0u8; bytes], vec![0u8; bytes]);
        quantize(ty, &x, &mut par).expect("parallel quantize");
        quantize_serial(ty, &x, &mut ser).expect("serial quantize");
        assert!(par == ser, "{ty}: parallel and serial quantization differ");
        let (mut dp, mut ds) = (vec![0f32; n], vec![0f32; n]);
        dequantize(ty, &par, &mut dp).expect("parallel dequantize");
        dequantize_serial(ty, &par, &mut ds).expect("serial dequantize");
        assert!(
            dp.iter().zip(&ds).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty}: parallel and serial dequantization differ"
        );
    }
}

#[test]
fn round_trip_error_shrinks_with_more_bits() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0002);
    let n = 256 * 64;
    let x: Vec<f32> = (0..n)
        .map(|_| rng.gen_range(-1.0f32..1.0) + rng.gen_range(-1.0f32..1.0))
        .collect();
    let rmse = |ty: GgmlType| {
        let q = quantize_to_vec(ty, &x).expect("quantize");
        let y = dequantize_to_vec(ty, &q, n).expect("dequantize");
        (x.iter()
            .zip(&y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            / n as f64)
            .sqrt()
    };
    use GgmlType::*;
    let order = [Q2K, Q3K, Q4K, Q5K, Q6K, Q8_0, BF16, F16, F32];
    let errs: Vec<f64> = order.iter().map(|&t| rmse(t)).collect();
    for w in 0..order.len() - 1 {
        assert!(
            errs[w] > errs[w + 1],
            "{} ({:e}) should be worse than {} ({:e})",
            order[w],
            errs[w],
            order[w + 1],
            errs[w + 1]
        );
    }
    assert_eq!(errs[order.len() - 1], 0.0, "F32 is lossless");
    // Legacy 4/5-bit types against their K-quant peers: same ballpark, the K-quants no worse.
    assert!(rmse(Q4K) < rmse(Q4_0) && rmse(Q5K) < rmse(Q5_0));
}

#[test]
fn bad_sizes_and_types_are_refused_with_details() {
    use GgmlType::*;
    let x = vec![0.5f32; 33];
    match quantize_to_vec(Q4_0, &x) {
        Err(QuantError::NotBlockMultiple {
            ty: Q4_0,
            n: 33,
            block_size: 32,
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    let mut small = vec![0u8; 17];
    let e = quantize(Q4_0, &x[..32], &mut small).unwrap_err();
    assert_eq!(
        e,
        QuantError::BufferSize {
            ty: Q4_0,
            buffer: "destination",
            n: 32,
            expected: 18,
            got: 17
        }
    );
    assert!(
        e.to_string().contains("q4_0") && e.to_string().contains("18"),
        "{e}"
    );
    let mut out = vec![0f32; 256];
    let e = dequantize(Q6K, &[0u8; 209], &mut out).unwrap_err();
    assert_eq!(
        e,
        QuantError::BufferSize {
            ty: Q6K,
            buffer: "source",
            n: 256,
            expected: 210,
            got: 209
        }
    );
    let e = dequantize(Q4K, &[0u8; 144], &mut out[..255]).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::NotBlockMultiple {
                ty: Q4K,
                n: 255,
                block_size: 256
            }
        ),
        "{e:?}"
    );
    for ty in [I8, I16, I32, I64, F64] {
        assert!(!can_quantize(ty) && !can_dequantize(ty));
        assert_eq!(
            quantize_to_vec(ty, &[1.0]).unwrap_err(),
            QuantError::Unsupported { ty, op: "quantize" }
        );
        assert_eq!(
            dequantize_to_vec(ty, &[0u8; 8], 1).unwrap_err(),
            QuantError::Unsupported {
                ty,
                op: "dequantize"
            }
        );
    }
    // Empty input is a whole number (zero) of blocks.
    assert_eq!(quantize_to_vec(Q4K, &[]).expect("empty"), Vec::<u8>::new());
}

#[test]
fn unaligned_buffers_give_the_same_results() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0003);
    let x = random_weights(&mut rng, 1024);
    for ty in ALL_QUANTIZABLE {
        let q = quantize_to_vec(ty, &x).expect("quantize");
        // Shift the bytes by one so every block (and every f16/f32 field) is misaligned.
        let mut shifted = vec![0u8; q.len() + 1];
        shifted[1..].copy_from_slice(&q);
        quantize(ty, &x, &mut shifted[1..]).expect("quantize into unaligned");
        assert_eq!(&shifted[1..], &q[..], "{ty}");
        let a = dequantize_to_vec(ty, &q, x.len()).expect("aligned");
        let b = dequantize_to_vec(ty, &shifted[1..], x.len()).expect("unaligned");
        assert!(
            a.iter().zip(&b).all(|(p, r)| p.to_bits() == r.to_bits()),
            "{ty}"
        );
    }
}

fn read<T: Copy>(bytes: &[u8]) -> T {
    assert_eq!(bytes.len(), std::mem::size_of::<T>());
    // SAFETY: test-only read of a plain-data block struct from exactly its size in bytes.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr() as *const T) }
}

#[test]
fn q8_activation_formats_keep_their_invariants() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_0004);
    let mut x = random_weights(&mut rng, 256 * 8);
    x[256..512].fill(0.0); // an all-zero block
    let q = quantize_to_vec(GgmlType::Q8K, &x).expect("q8_K");
    for (i, chunk) in q.chunks_exact(std::mem::size_of::<BlockQ8K>()).enumerate() {
        let b: BlockQ8K = read(chunk);
        let xs = &x[256 * i..256 * (i + 1)];
        for g in 0..16 {
            let s: i32 = b.qs[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum();
            assert_eq!(b.bsums[g] as i32, s, "block {i} group {g}");
        }
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(
            (b.d.abs() - amax / 127.0).abs() <= amax / 127.0 * 1e-6,
            "block {i}: d {}",
            b.d
        );
        for (v, &qv) in xs.iter().zip(b.qs.iter()) {
            assert!(
                (v - b.d * qv as f32).abs() <= b.d.abs() * 0.5 * (1.0 + 1e-5),
                "block {i}: x {v} q {qv} d {}",
                b.d
            );
        }
    }
    let q = quantize_to_vec(GgmlType::Q8_1, &x).expect("q8_1");
    for (i, chunk) in q.chunks_exact(std::mem::size_of::<BlockQ8_1>()).enumerate() {
        let b: BlockQ8_1 = read(chunk);
        let d = b.d.to_f32();
        let sum: i32 = b.qs.iter().map(|&v| v as i32).sum();
        let amax = x[32 * i..32 * (i + 1)]
            .iter()
            .fold(0f32, |a, v| a.max(v.abs()));
        // Both fields are f16: half an ulp relative (2^-11), or half the subnormal step (2^-25).
        let f16_tol = |v: f32| v.abs() * (1.0 / 2048.0) + 1.0 / 33_554_432.0;
        let d_expect = amax / 127.0;
        assert!(
            (d - d_expect).abs() <= f16_tol(d_expect),
            "block {i}: d {d} vs {d_expect}"
        );
        // `s` is computed from the unrounded scale.
        let s_expect = sum as f32 * d_expect;
        assert!(
            (b.s.to_f32() - s_expect).abs() <= f16_tol(s_expect) * 1.001,
            "block {i}: s {} vs {s_expect}",
            b.s
        );
    }
}
