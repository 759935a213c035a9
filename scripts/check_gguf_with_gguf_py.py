#!/usr/bin/env python3
"""Reads a GGUF file with the reference reader `gguf.GGUFReader` (PyPI `gguf`) and checks it against a
JSON description: version, alignment, data offset, every key in order with its type and value (floats
compared bit for bit), and every tensor's name, ggml dims, type, offset and bytes.

    python3 scripts/check_gguf_with_gguf_py.py FILE.gguf FILE.json

Exit status 0 when everything matches; otherwise 1, with each mismatch printed. The Rust test
`crates/gguf/tests/gguf_py.rs` writes random files with our writer and runs this on them; the fixture
script scripts/make_gguf_fixtures.py runs it on the files gguf-py itself wrote.

Description format (the one the fixtures in crates/gguf/tests/fixtures/*.json use):
  {"version": 3, "alignment": 32, "data_offset": N, "file_size": N,
   "kv": [{"key": K, "type": "u8".."f64"|"bool"|"string", "value": V}            (floats: bit patterns)
          {"key": K, "type": "array", "elem": T, "value": [V, ...]}
          {"key": K, "type": "array", "elem": "array", "value": [{"type": "array", "elem": T, ...}]}],
   "tensors": [{"name", "dims" (ggml order), "type" (ggml id), "offset" (relative), "n_bytes",
                "data_hex" (or "data_crc32", zlib's CRC-32, for large files)}]}
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFValueType as VT

NAMES = {
    "u8": VT.UINT8, "i8": VT.INT8, "u16": VT.UINT16, "i16": VT.INT16, "u32": VT.UINT32,
    "i32": VT.INT32, "f32": VT.FLOAT32, "bool": VT.BOOL, "string": VT.STRING, "array": VT.ARRAY,
    "u64": VT.UINT64, "i64": VT.INT64, "f64": VT.FLOAT64,
}


def scalar_from_part(vt: VT, part) -> object:
    """A value from one numpy part as gguf-py stores it, in the description's JSON form."""
    if vt == VT.FLOAT32:
        return int(np.asarray(part, dtype=np.float32).view(np.uint32)[0])
    if vt == VT.FLOAT64:
        return int(np.asarray(part, dtype=np.float64).view(np.uint64)[0])
    if vt == VT.BOOL:
        return bool(part[0])
    if vt == VT.STRING:
        return bytes(part).decode("utf-8")
    return int(part[0])


def decode_items(parts, i: int, elem: VT, count: int):
    """Decodes `count` items of type `elem` from gguf-py's flat `parts` list starting at parts[i].
    Returns (values, next index). Nested arrays come back as description dicts (gguf-py's own
    contents() does not handle them)."""
    out = []
    for _ in range(count):
        if elem == VT.STRING:
            # a string item is two parts: length, bytes
            out.append(bytes(parts[i + 1]).decode("utf-8"))
            i += 2
        elif elem == VT.ARRAY:
            inner_elem = VT(int(parts[i][0]))
            inner_count = int(parts[i + 1][0])
            vals, i = decode_items(parts, i + 2, inner_elem, inner_count)
            inner = {"type": "array", "elem": [k for k, v in NAMES.items() if v == inner_elem][0],
                     "value": vals}
            out.append(inner)
        else:
            out.append(scalar_from_part(elem, parts[i]))
            i += 1
    return out, i


def field_value(field) -> dict:
    main = VT(field.types[0])
    name = [k for k, v in NAMES.items() if v == main][0]
    if main != VT.ARRAY:
        return {"type": name, "value": scalar_from_part(main, field.parts[-1])}
    # parts: key length, key bytes, value type, element type, count, items...
    elem = VT(int(field.parts[3][0]))
    count = int(field.parts[4][0])
    vals, end = decode_items(field.parts, 5, elem, count)
    if end != len(field.parts):
        raise AssertionError(f"{field.name}: decoded {end} of {len(field.parts)} parts")
    return {"type": "array", "elem": [k for k, v in NAMES.items() if v == elem][0], "value": vals}


def check_file(path: str | Path, desc: dict) -> None:
    """Raises AssertionError listing every difference between the file (as gguf-py reads it) and desc."""
    r = gguf.GGUFReader(str(path))
    errs: list[str] = []

    def eq(what, got, want):
        if got != want:
            errs.append(f"{what}: gguf-py reads {got!r}, expected {want!r}")

    eq("version", int(r.fields["GGUF.version"].parts[-1][0]), desc["version"])
    eq("alignment", int(r.alignment), desc["alignment"])
    eq("data_offset", int(r.data_offset), desc["data_offset"])
    eq("file_size", Path(path).stat().st_size, desc["file_size"])

    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    eq("key order", keys, [kv["key"] for kv in desc["kv"]])
    for kv in desc["kv"]:
        f = r.fields.get(kv["key"])
        if f is None:
            continue
        want = {k: v for k, v in kv.items() if k != "key"}
        eq(f"key {kv['key']}", field_value(f), want)

    eq("tensor count", len(r.tensors), len(desc["tensors"]))
    for t, want in zip(r.tensors, desc["tensors"]):
        n = want["name"]
        eq(f"tensor {n} name", t.name, n)
        eq(f"tensor {n} dims", [int(d) for d in t.shape], want["dims"])
        eq(f"tensor {n} type", int(t.tensor_type), want["type"])
        eq(f"tensor {n} offset", int(t.data_offset) - int(r.data_offset), want["offset"])
        eq(f"tensor {n} n_bytes", int(t.n_bytes), want["n_bytes"])
        data = np.ascontiguousarray(t.data).tobytes()
        if "data_hex" in want:
            eq(f"tensor {n} data", data.hex(), want["data_hex"])
        else:
            eq(f"tensor {n} data crc32", zlib.crc32(data), want["data_crc32"])
    if errs:
        raise AssertionError(f"{path}:\n  " + "\n  ".join(errs))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        check_file(argv[1], json.loads(Path(argv[2]).read_text()))
    except AssertionError as e:
        print(f"MISMATCH {e}", file=sys.stderr)
        return 1
    print(f"ok: {argv[1]} matches {argv[2]} (read with gguf {gguf.__name__} GGUFReader)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
