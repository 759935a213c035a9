#!/usr/bin/env python3
"""Dump llama.cpp's intermediate tensors (llama-cpp-python 0.3.36, CPU) for one batch of tokens.

A debugging aid for matching the CPU engine's numerics to llama.cpp's op by op: llama.cpp's
graph evaluation callback (`cb_eval`) is asked to stop after every node whose name matches
(`attn_norm-0`, `Qcur-0`, `kq-0`, ...), and each such f32/f16 tensor is written, in ggml's
element order (ne[0] fastest), to a raw f32 file in the output directory, with its shape, op and type in meta.json. The same
settings as scripts/ref_logits.py (one batch, n_ctx = tokens, no flash attention) so the
tensors come from the path the teacher-forced fixtures were made by.

The engine side is `cargo run --release -p cpu --example trace` (crates/cpu/examples/trace.rs),
which prints where ours first differs.

Usage: dump_llama_tensors.py --model M.gguf --out DIR [--tokens-from FIXTURE.json]
       [--n 64] [--layers 0,1] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import re
import sys
from pathlib import Path

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64


class GgmlTensor(C.Structure):
    """`struct ggml_tensor` of the ggml vendored by llama-cpp-python 0.3.36 (ggml.h)."""

    _fields_ = [
        ("type", C.c_int),
        ("buffer", C.c_void_p),
        ("ne", C.c_int64 * GGML_MAX_DIMS),
        ("nb", C.c_size_t * GGML_MAX_DIMS),
        ("op", C.c_int),
        ("op_params", C.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", C.c_int32),
        ("src", C.c_void_p * GGML_MAX_SRC),
        ("view_src", C.c_void_p),
        ("view_offs", C.c_size_t),
        ("data", C.c_void_p),
        ("name", C.c_char * GGML_MAX_NAME),
        ("extra", C.c_void_p),
        ("padding", C.c_char * 8),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="directory to write")
    ap.add_argument("--tokens-from", type=Path, help="a ref_logits fixture: use its tokens")
    ap.add_argument("--n", type=int, default=0, help="first N tokens only (0: all)")
    ap.add_argument("--layers", default="0", help="comma-separated layer indices to dump")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import llama_cpp as L

    if args.tokens_from:
        tokens = json.loads(args.tokens_from.read_text())["tokens"]
    else:
        sys.exit("error: --tokens-from is required")
    if args.n:
        tokens = tokens[: args.n]
    n = len(tokens)
    layers = {int(x) for x in args.layers.split(",") if x}
    pat = re.compile(r"^(.*)-(\d+)$")

    dumped: dict[str, np.ndarray] = {}
    meta: dict[str, dict] = {}
    counts: dict[str, int] = {}

    def wanted(name: str) -> bool:
        m = pat.match(name)
        if m:
            return int(m.group(2)) in layers
        return name in ("result_norm", "result_output", "inp_embd")

    @L.ggml_backend_sched_eval_callback
    def cb(t_ptr, ask, _ud):
        t = GgmlTensor.from_address(t_ptr)
        name = t.name.decode(errors="replace")
        if ask:
            return wanted(name)
        if t.type not in (0, 1) or not t.data:
            return True
        esz = 4 if t.type == 0 else 2
        ne = [t.ne[i] for i in range(4)]
        nb = [t.nb[i] for i in range(4)]
        span = sum((ne[i] - 1) * nb[i] for i in range(4)) + esz
        buf = (C.c_uint8 * span).from_address(t.data)
        raw = np.frombuffer(bytes(buf), dtype=np.float32 if t.type == 0 else np.float16)
        arr = np.lib.stride_tricks.as_strided(
            raw, shape=ne[::-1], strides=[s for s in nb[::-1]]
        ).astype(np.float32)
        k = counts.get(name, 0)
        counts[name] = k + 1
        key = f"{name}#{k}"
        dumped[key] = np.ascontiguousarray(arr)
        meta[key] = {"op": t.op, "type": t.type, "ne": ne}
        return True

    @L.llama_log_callback
    def quiet(_level, _text, _ud):
        pass

    L.llama_log_set(quiet, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(args.model).encode(), mp)
    if not model:
        sys.exit(f"error: cannot load {args.model}")
    cp = L.llama_context_default_params()
    cp.n_ctx = n
    cp.n_batch = n
    cp.n_ubatch = n
    cp.n_threads = args.threads
    cp.n_threads_batch = args.threads
    cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED, as scripts/ref_logits.py
    cp.cb_eval = cb
    cp.cb_eval_user_data = None
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("error: cannot create context")
    arr = (L.llama_token * n)(*tokens)
    batch = L.llama_batch_get_one(arr, n)
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        sys.exit(f"error: llama_decode returned {rc}")
    # One raw little-endian f32 file per tensor (what the engine's trace example reads), plus
    # an index.
    args.out.mkdir(parents=True, exist_ok=True)
    for k, a in dumped.items():
        a.astype("<f4").tofile(args.out / f"{k}.f32")
    (args.out / "meta.json").write_text(json.dumps({"tokens": tokens, "tensors": meta}))
    for k, m in meta.items():
        print(f"{k:28s} op={m['op']:3d} type={m['type']} ne={m['ne']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
