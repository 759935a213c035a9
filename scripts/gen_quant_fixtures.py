#!/usr/bin/env python3
"""Generate the quantization fixtures that crates/quant/tests/quant_fixtures.rs checks against.

Two independent references produce them:

* the PyPI `gguf` package (`gguf.quants`): quantize F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 from
  seeded random f32 rows, and dequantize every type (the quantized bytes above, plus random block
  bytes for every type, K-quants included, with finite random f16 scales);
* llama.cpp itself, through llama-cpp-python's low-level `llama_model_quantize`: the script writes
  a tiny but loadable llama-architecture F32 GGUF whose `blk.0.attn_q.weight` holds the input rows,
  quantizes it with `pure` set (so every weight matrix gets the requested type) to each K-quant and
  legacy type, and takes that tensor's bytes out of the result. The activation formats Q8_1 and
  Q8_K, which no model file holds, come from ggml's reference quantizers in the libggml-base that
  llama-cpp-python ships.

Files (all little-endian, raw): `<input>.f32` input rows, `<case>.quant` quantized bytes,
`<case>.dequant.f32` the reference dequantization of those bytes (by `gguf`). `manifest.json` lists
the cases, their types and element counts, and the reference versions.

Usage:
    python3 scripts/gen_quant_fixtures.py [--out crates/quant/tests/fixtures] [--seed 20240607]
                                          [--skip-llama]

`--skip-llama` keeps the llama.cpp cases already in the manifest (for machines without
llama-cpp-python); without it, llama_cpp must import. Requires: numpy, gguf (pip install gguf).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "crates" / "quant" / "tests" / "fixtures"

COLS = 512  # two K-quant super-blocks, sixteen legacy blocks per row
QUANTIZE_TYPES = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
DEQUANT_RANDOM_TYPES = [
    T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
]
# Byte offsets of the f16 scale fields inside each block (ggml-common.h layouts).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
# llama_ftype whose default type is the one wanted; with `pure` no tensor gets another type.
LLAMA_FTYPES = {
    T.Q4_0: "LLAMA_FTYPE_MOSTLY_Q4_0",
    T.Q4_1: "LLAMA_FTYPE_MOSTLY_Q4_1",
    T.Q5_0: "LLAMA_FTYPE_MOSTLY_Q5_0",
    T.Q5_1: "LLAMA_FTYPE_MOSTLY_Q5_1",
    T.Q8_0: "LLAMA_FTYPE_MOSTLY_Q8_0",
    T.Q2_K: "LLAMA_FTYPE_MOSTLY_Q2_K",
    T.Q3_K: "LLAMA_FTYPE_MOSTLY_Q3_K_S",
    T.Q4_K: "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    T.Q5_K: "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    T.Q6_K: "LLAMA_FTYPE_MOSTLY_Q6_K",
}
PROBE_TENSOR = "blk.0.attn_q.weight"


def awkward_rows(rng: np.random.Generator, n_rows: int) -> np.ndarray:
    """Rows of very different character; every row is NaN-free and fits f16 after scaling."""
    rows = []
    kinds = [
        "normal", "large", "small", "edge_blocks", "heavy_tail", "biased",
    ]
    for r in range(n_rows):
        kind = kinds[r % len(kinds)] if r < len(kinds) else ("normal", "heavy_tail", "biased")[r % 3]
        if kind == "normal":
            x = rng.standard_normal(COLS)
        elif kind == "large":
            x = rng.standard_normal(COLS) * 1000.0
            idx = rng.choice(COLS, 6, replace=False)
            x[idx] = rng.choice([-1.0, 1.0], 6) * rng.uniform(1.5e4, 3.0e4, 6)
        elif kind == "small":
            x = rng.standard_normal(COLS) * 1e-3
            idx = rng.choice(COLS, 40, replace=False)
            x[idx] = rng.standard_normal(40) * 1e-6
        elif kind == "edge_blocks":
            x = rng.standard_normal(COLS) * 0.1
            x[rng.random(COLS) < 0.1] = 0.0  # scattered exact zeros
            x[0:32] = 0.0  # an all-zero legacy block
            x[32:64] = 0.75  # a constant block (max == min)
            x[64:96] = rng.uniform(0.5, 2.0, 32)  # all positive
            x[96:128] = -rng.uniform(0.5, 2.0, 32)  # all negative
            x[128:160] = rng.uniform(-1.0, 1.0, 32)
            x[130], x[150] = 1.5, -1.5  # equal magnitude extremes of both signs
            x[256:512] = 0.0  # an all-zero K-quant super-block
            x[300] = 1e-3  # ... except one element, in a 16/32 group of its own
        elif kind == "heavy_tail":
            x = rng.laplace(0.0, 0.02, COLS)
            x[rng.random(COLS) < 0.01] *= 40.0
        elif kind == "biased":
            x = rng.uniform(-1.0, 1.0, COLS) + 0.5
        rows.append(x)
    return np.asarray(rows, dtype=np.float32)


def float_edge_row(rng: np.random.Generator) -> np.ndarray:
    """Values that probe f16/bf16 rounding: ties, subnormals, overflow, signed zeros, infinities."""
    vals: list[float] = []
    # exact midpoints between neighbouring f16 values (ties to even, both parities)
    h = rng.integers(0x0001, 0x7bff, 96).astype(np.uint16)
    a = h.view(np.float16).astype(np.float64)
    b = (h + 1).view(np.float16).astype(np.float64)
    mids = (a + b) / 2
    vals += list(mids) + list(-mids)
    # f16 subnormal range and the underflow edge
    vals += [2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 6.0e-8, 3.0e-8, 1.0e-7, 6.1e-5, 6.103515625e-05]
    vals += list(rng.uniform(1e-8, 1e-4, 40))
    # around the f16 maximum (65504) and above it
    vals += [65504.0, 65519.99, 65520.0, 65535.0, 70000.0, 1e6, -65520.0, -1e6]
    # bf16 ties and near-ties: low 16 bits 0x8000 / 0x7fff / 0x8001 on both mantissa parities
    base = rng.integers(0x0080_0000, 0x7f00_0000, 24).astype(np.uint32) & np.uint32(0xffff_0000)
    for low in (0x8000, 0x7FFF, 0x8001):
        vals += list((base | np.uint32(low)).view(np.float32).astype(np.float64))
        vals += list((base | np.uint32(0x1_0000 | low)).view(np.float32).astype(np.float64))
    vals += [float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max), 1e-40, -1e-40, 1e-45]
    vals += [0.0, -0.0, float("inf"), float("-inf")]
    x = np.array(vals, dtype=np.float32)
    pad = rng.standard_normal(COLS - len(x)).astype(np.float32) * 100.0
    return np.concatenate([x, pad])[:COLS].reshape(1, COLS)


def random_f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values over a wide exponent range, both signs, some zero and subnormal."""
    mag = 10.0 ** rng.uniform(-6.0, 3.0, n)
    s = (rng.choice([-1.0, 1.0], n, p=[0.2, 0.8]) * mag).astype(np.float16)
    s[rng.random(n) < 0.05] = 0.0
    return s


def random_blocks(rng: np.random.Generator, qtype: T, n_blocks: int) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (T.F16, T.BF16):
        bits = rng.integers(0, 1 << 16, n_blocks, dtype=np.uint32).astype(np.uint16)
        exp_all_ones = (bits & 0x7C00) == 0x7C00 if qtype == T.F16 else (bits & 0x7F80) == 0x7F80
        nan = exp_all_ones & ((bits & (0x03FF if qtype == T.F16 else 0x007F)) != 0)
        bits[nan] ^= 0x4000  # clear one exponent bit: NaN becomes a finite value
        return bits.view(np.uint8)
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint16).astype(np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = random_f16_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def write_f32(path: Path, a: np.ndarray) -> None:
    path.write_bytes(np.ascontiguousarray(a, dtype="<f4").tobytes())


def gguf_cases(rng: np.random.Generator, out: Path) -> tuple[dict, list]:
    inputs = {}
    cases = []
    x = awkward_rows(rng, 6)
    write_f32(out / "gguf_input.f32", x)
    inputs["gguf_input"] = {"file": "gguf_input.f32", "rows": x.shape[0], "cols": COLS}
    xf = np.concatenate([x, float_edge_row(rng)])
    write_f32(out / "gguf_float_input.f32", xf)
    inputs["gguf_float_input"] = {"file": "gguf_float_input.f32", "rows": xf.shape[0], "cols": COLS}

    for qtype in QUANTIZE_TYPES:
        src_name, src = ("gguf_float_input", xf) if qtype in (T.F16, T.BF16) else ("gguf_input", x)
        with np.errstate(over="ignore"):  # values beyond f16's range become inf, on purpose
            q = np.ascontiguousarray(gguf_quantize(src, qtype)).view(np.uint8).reshape(-1)
        deq = gguf_dequantize(q.reshape(src.shape[0], -1), qtype)
        stem = f"gguf_{qtype.name.lower()}"
        (out / f"{stem}.quant").write_bytes(q.tobytes())
        write_f32(out / f"{stem}.dequant.f32", deq)
        cases.append({
            "name": f"{stem}_quantize", "type": qtype.name, "source": "gguf", "input": src_name,
            "n": int(src.size), "quant": f"{stem}.quant", "dequant": f"{stem}.dequant.f32",
        })

    for qtype in DEQUANT_RANDOM_TYPES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = 8 if block_size == 256 else (64 if block_size == 32 else 2048)
        q = random_blocks(rng, qtype, n_blocks)
        n = n_blocks * block_size
        deq = gguf_dequantize(q.reshape(1, -1), qtype)
        stem = f"gguf_{qtype.name.lower()}_random"
        (out / f"{stem}.quant").write_bytes(q.tobytes())
        write_f32(out / f"{stem}.dequant.f32", deq)
        cases.append({
            "name": stem, "type": qtype.name, "source": "gguf", "input": None, "n": n,
            "quant": f"{stem}.quant", "dequant": f"{stem}.dequant.f32",
        })
    return inputs, cases


def write_probe_model(path: Path, x: np.ndarray, rng: np.random.Generator) -> None:
    """A minimal llama-architecture GGUF that llama_model_quantize accepts: hyper-parameters, a
    tiny vocabulary, and F32 weights; the rows under test are `blk.0.attn_q.weight`."""
    n_embd = COLS
    n_vocab = 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("quant-fixture-probe")
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(n_embd)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_rope_dimension_count(n_embd // 4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(n_vocab)])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([1] * n_vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def rnd(*shape):  # numpy shape (rows, cols) = ggml ne reversed
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rnd(n_vocab, n_embd))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor(PROBE_TENSOR, np.ascontiguousarray(x, dtype=np.float32))
    w.add_tensor("blk.0.attn_k.weight", rnd(n_embd, n_embd))
    w.add_tensor("blk.0.attn_v.weight", rnd(n_embd, n_embd))
    w.add_tensor("blk.0.attn_output.weight", rnd(n_embd, n_embd))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", rnd(n_embd, n_embd))
    w.add_tensor("blk.0.ffn_up.weight", rnd(n_embd, n_embd))
    w.add_tensor("blk.0.ffn_down.weight", rnd(n_embd, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", rnd(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(llama_cpp, src: Path, dst: Path, ftype_name: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.pure = True
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype_name}) returned {rc}")


def llama_cases(rng: np.random.Generator, out: Path) -> tuple[dict, list, str]:
    import llama_cpp  # noqa: PLC0415 (optional dependency, imported only when used)

    x = np.concatenate([awkward_rows(rng, 6), awkward_rows(rng, 18)])
    x[9, 256:512] = 0.0  # one entirely zero super-block (row 9 is an "edge_blocks" row)
    write_f32(out / "llama_input.f32", x)
    inputs = {"llama_input": {"file": "llama_input.f32", "rows": x.shape[0], "cols": COLS}}
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe-f32.gguf"
        write_probe_model(src, x, rng)
        for qtype, ftype_name in LLAMA_FTYPES.items():
            dst = Path(tmp) / f"probe-{qtype.name}.gguf"
            llama_quantize(llama_cpp, src, dst, ftype_name)
            reader = gguf.GGUFReader(str(dst))
            tensor = next((t for t in reader.tensors if t.name == PROBE_TENSOR), None)
            if tensor is None:
                raise RuntimeError(f"{dst}: no tensor {PROBE_TENSOR}")
            if tensor.tensor_type != qtype:
                raise RuntimeError(f"{PROBE_TENSOR} came out as {tensor.tensor_type.name}, wanted {qtype.name}")
            q = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
            expect = x.size // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
            if q.size != expect:
                raise RuntimeError(f"{qtype.name}: {q.size} bytes, expected {expect}")
            stem = f"llama_{qtype.name.lower()}"
            (out / f"{stem}.quant").write_bytes(q.tobytes())
            # No dequantized copy: the gguf cases already pin dequantization of every type.
            cases.append({
                "name": stem, "type": qtype.name, "source": "llama.cpp", "input": "llama_input",
                "n": int(x.size), "quant": f"{stem}.quant", "dequant": None,
            })
    cases += ggml_activation_cases(llama_cpp, x, out)
    version = getattr(llama_cpp, "__version__", "unknown")
    return inputs, cases, version


def ggml_activation_cases(llama_cpp, x: np.ndarray, out: Path) -> list:
    """Q8_1 and Q8_K are never stored in model files, so llama_model_quantize cannot make them;
    ggml's reference quantizers are called directly from the libggml-base that llama-cpp-python
    ships (Q8_K is dequantized by ggml too; Q8_1, which ggml does not dequantize, by numpy)."""
    import ctypes  # noqa: PLC0415

    lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    found = sorted(lib_dir.glob("libggml-base.*"))
    if not found:
        raise RuntimeError(f"no libggml-base library in {lib_dir}")
    ggml = ctypes.CDLL(str(found[0]))
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    vp = ctypes.c_void_p
    cases = []
    # gguf's size table still has Q8_1's old f32 layout (40 bytes); ggml's block is 36 bytes.
    sizes = {T.Q8_1: (32, 36), T.Q8_K: (256, 292)}
    for qtype in (T.Q8_1, T.Q8_K):
        block_size, type_size = sizes[qtype]
        # Zeroed: ggml leaves Q8_K's bsums untouched for an all-zero block.
        q = np.zeros(flat.size // block_size * type_size, dtype=np.uint8)
        fn = getattr(ggml, f"quantize_row_{qtype.name.lower().replace('_k', '_K')}_ref")
        fn.argtypes, fn.restype = [vp, vp, ctypes.c_int64], None
        fn(flat.ctypes.data, q.ctypes.data, flat.size)
        if qtype == T.Q8_K:
            deq = np.zeros(flat.size, dtype=np.float32)
            dq = ggml.dequantize_row_q8_K
            dq.argtypes, dq.restype = [vp, vp, ctypes.c_int64], None
            dq(q.ctypes.data, deq.ctypes.data, flat.size)
        else:
            blocks = q.reshape(-1, type_size)
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
            deq = (blocks[:, 4:].view(np.int8).astype(np.float32) * d).reshape(-1)
        stem = f"ggml_{qtype.name.lower()}"
        (out / f"{stem}.quant").write_bytes(q.tobytes())
        write_f32(out / f"{stem}.dequant.f32", deq)
        cases.append({
            "name": stem, "type": qtype.name, "source": "llama.cpp", "input": "llama_input",
            "n": int(flat.size), "quant": f"{stem}.quant", "dequant": f"{stem}.dequant.f32",
        })
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=20240607)
    ap.add_argument("--skip-llama", action="store_true", help="keep the existing llama.cpp cases")
    args = ap.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    from importlib.metadata import version as pkg_version  # noqa: PLC0415

    manifest = {
        "generator": "scripts/gen_quant_fixtures.py",
        "seed": args.seed,
        "gguf_version": pkg_version("gguf"),
        "numpy_version": np.__version__,
        "inputs": {},
        "cases": [],
    }
    rng = np.random.default_rng(args.seed)
    inputs, cases = gguf_cases(rng, out)
    manifest["inputs"].update(inputs)
    manifest["cases"] += cases

    old_path = out / "manifest.json"
    if args.skip_llama:
        if old_path.exists():
            old = json.loads(old_path.read_text())
            manifest["llama_cpp_python_version"] = old.get("llama_cpp_python_version")
            manifest["inputs"].update({k: v for k, v in old["inputs"].items() if k.startswith("llama")})
            manifest["cases"] += [c for c in old["cases"] if c["source"] == "llama.cpp"]
    else:
        # A separate stream so the gguf fixtures do not change when this part changes.
        llama_rng = np.random.default_rng(args.seed + 1)
        inputs, cases, version = llama_cases(llama_rng, out)
        manifest["llama_cpp_python_version"] = version
        manifest["inputs"].update(inputs)
        manifest["cases"] += cases

    old_path.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {len(manifest['cases'])} cases to {out} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
