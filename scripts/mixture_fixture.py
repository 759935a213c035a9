#!/usr/bin/env python3
"""Writes crates/model/tests/fixtures/llama_cpp_mixtures.json: the type llama.cpp itself gives each
tensor of each synthetic preset, at full size, for each file type `crossover synth --quant` offers.

How: for each preset, the model crate's `synth_layout` example prints the full-size F32 layout
(hyper-parameter metadata, tensor names and shapes). This script writes it as a GGUF with the `gguf`
package, leaving the data section sparse (a hole, no bytes written: an 8B model in F32 would be
32 GB), then runs llama.cpp's quantizer (llama-cpp-python's `llama_model_quantize`) in dry-run
mode, which decides every tensor's type without reading data, and records the decisions from its
log. The model crate's test compares `QuantScheme::tensor_type` with them.

Needs llama-cpp-python 0.3.36 (scripts/setup_llama_cpp.sh) and cargo.
Usage: python3 scripts/mixture_fixture.py
"""

import ctypes
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "crates" / "model" / "tests" / "fixtures" / "llama_cpp_mixtures.json"
PRESETS = ["smollm2-135m", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-0.5b"]
# llama-quantize's names (lower-cased) and llama.cpp's own enum values for them.
FTYPES = {
    "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_k_s": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_k_s": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    "q5_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
}

# One line per tensor of the dry run, e.g.
# [  12/ 147]             blk.1.attn_k.weight - [ 2048,   512,     1,     1], type =    f32, size =    4.000 MiB ->    1.125 MiB (q4_K)
# or, for a tensor left as it is: ... type =    f32, size =    0.008 MiB
LINE = re.compile(
    r"\[\s*\d+/\s*\d+\]\s+(?P<name>\S+)\s+-\s+\[[^\]]*\],\s+type =\s+(?P<src>\S+),\s+"
    r"size =\s+[\d.]+ MiB(?:\s+->\s+[\d.]+ MiB \((?P<dst>\S+)\))?"
)

_log = []


@llama_cpp.llama_log_callback
def _on_log(level, text, user_data):
    _log.append(text.decode("utf-8", "replace"))


def layout(preset: str) -> dict:
    out = subprocess.run(
        ["cargo", "run", "-q", "--release", "-p", "model", "--example", "synth_layout", "--", preset],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def write_sparse(lay: dict, path: str) -> None:
    md = {k: (t, v) for k, t, v in lay["metadata"]}
    arch = md["general.architecture"][1]
    w = gguf.GGUFWriter(path, arch)
    for k, (t, v) in md.items():
        if k == "general.architecture":
            continue
        {"u32": w.add_uint32, "f32": w.add_float32, "str": w.add_string}[t](k, v)
    total = 0
    for name, dims in lay["tensors"]:
        n = int(np.prod(dims)) * 4
        # gguf-py takes numpy order (slowest dimension first); ggml order is the reverse.
        w.add_tensor_info(name, list(reversed(dims)), np.dtype(np.float32), n, gguf.GGMLQuantizationType.F32)
        total += gguf.GGUFWriter.ggml_pad(n, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    start = fout.tell()
    # The data section is left as a hole: llama.cpp checks it lies within the file, never reads it.
    fout.truncate(start + total)
    w.close()


def dry_run(path: str, ftype: int) -> dict:
    _log.clear()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.dry_run = True
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(path.encode(), (path + ".out").encode(), ctypes.byref(params))
    text = "".join(_log)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc}) on {path}:\n{text[-3000:]}")
    types = {}
    for m in LINE.finditer(text):
        types[m["name"]] = m["dst"] or m["src"]
    return types


def main() -> None:
    llama_cpp.llama_log_set(_on_log, ctypes.c_void_p(0))
    doc = {
        "generator": "scripts/mixture_fixture.py",
        "llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
        "presets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for preset in PRESETS:
            lay = layout(preset)
            path = os.path.join(tmp, preset + "-f32.gguf")
            write_sparse(lay, path)
            names = [n for n, _ in lay["tensors"]]
            entry = {"tensors": names, "types": {}}
            for fname, ftype in FTYPES.items():
                types = dry_run(path, ftype)
                missing = [n for n in names if n not in types]
                if missing:
                    sys.exit(f"{preset} {fname}: no decision logged for {missing[:5]}")
                entry["types"][fname] = " ".join(types[n] for n in names)
            doc["presets"][preset] = entry
            os.remove(path)
            print(f"{preset}: {len(names)} tensors x {len(FTYPES)} file types")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
