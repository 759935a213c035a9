#!/usr/bin/env python3
"""Makes the GGUF reader's test fixtures (run from the repository root; needs `pip install gguf numpy`).

1. crates/gguf/tests/fixtures/py_*.gguf: files written by the reference writer `gguf.GGUFWriter`,
   covering every metadata value type (scalars, typed arrays of each type, nested arrays) and tensors
   of several types and ranks, with seeded random contents. Each has a `.json` description of what
   was written (values as given to the writer, tensor bytes as hex; offsets as gguf.GGUFReader reports
   them). The description is checked against gguf.GGUFReader before it is saved.
2. crates/gguf/tests/malformed/*.gguf: small files, each broken in one way, built byte by byte here
   (independently of the Rust writer), listed in manifest.json with the error kind the reader must
   return and the absolute byte offset it must name.

The same description format is what scripts/check_gguf_with_gguf_py.py checks a file against; the Rust
test suite uses it in the other direction (our writer -> gguf.GGUFReader).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFValueType as VT, GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gguf_with_gguf_py import check_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "crates/gguf/tests/fixtures"
BAD = ROOT / "crates/gguf/tests/malformed"

TYPE_NAMES = {
    VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32",
    VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool", VT.STRING: "string", VT.ARRAY: "array",
    VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT64: "f64",
}
INT_RANGES = {
    VT.UINT8: (0, 2**8 - 1), VT.INT8: (-2**7, 2**7 - 1), VT.UINT16: (0, 2**16 - 1),
    VT.INT16: (-2**15, 2**15 - 1), VT.UINT32: (0, 2**32 - 1), VT.INT32: (-2**31, 2**31 - 1),
    VT.UINT64: (0, 2**64 - 1), VT.INT64: (-2**63, 2**63 - 1),
}


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def describe_scalar(vt: VT, v):
    """JSON form of one value: floats as their exact bit patterns, the rest as themselves."""
    if vt == VT.FLOAT32:
        return f32_bits(v)
    if vt == VT.FLOAT64:
        return f64_bits(v)
    return v


def describe(vt: VT, v, sub: VT | None = None) -> dict:
    if vt != VT.ARRAY:
        return {"type": TYPE_NAMES[vt], "value": describe_scalar(vt, v)}
    if sub == VT.ARRAY:
        # nested: each element is itself a (typed) array; v is a list of (sub_type, values)
        return {"type": "array", "elem": "array",
                "value": [describe(VT.ARRAY, inner, isub) for isub, inner in v]}
    return {"type": "array", "elem": TYPE_NAMES[sub], "value": [describe_scalar(sub, x) for x in v]}


def rand_int(rng, vt):
    lo, hi = INT_RANGES[vt]
    # numpy cannot draw the full u64 range directly: combine two 32-bit draws
    raw = (int(rng.integers(0, 2**32)) << 32) | int(rng.integers(0, 2**32))
    return lo + raw % (hi - lo + 1)


def rand_f32(rng) -> float:
    return float(np.float32(rng.standard_normal() * 10.0 ** int(rng.integers(-3, 4))))


RANDOM_WORDS = ["hello", "wörld", "✓", "🦀 crab", "", " space", "tab\t", "new\nline", "Ġthe", "▁la"]


def rand_str(rng) -> str:
    return "".join(str(rng.choice(RANDOM_WORDS)) for _ in range(int(rng.integers(0, 4))))


def write_py_fixture(name: str, rng, alignment: int | None, with_nested: bool, tensor_specs):
    path = FIX / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    kv = [{"key": "general.architecture", **describe(VT.STRING, "llama")}]

    def add(key, vt, v, sub=None, pyval=None):
        w.add_key_value(key, v if pyval is None else pyval, vt, sub_type=sub)
        kv.append({"key": key, **describe(vt, v, sub)})

    if alignment is not None:
        w.add_custom_alignment(alignment)
        kv.append({"key": "general.alignment", **describe(VT.UINT32, alignment)})

    for vt in INT_RANGES:
        add(f"test.scalar.{TYPE_NAMES[vt]}", vt, rand_int(rng, vt))
    add("test.scalar.f32", VT.FLOAT32, rand_f32(rng))
    add("test.scalar.f64", VT.FLOAT64, float(rng.standard_normal() * 1e100))
    add("test.scalar.bool_true", VT.BOOL, True)
    add("test.scalar.bool_false", VT.BOOL, False)
    add("test.scalar.string", VT.STRING, "héllo ✓ 🦀 " + rand_str(rng))
    add("test.scalar.empty_string", VT.STRING, "")

    for vt in INT_RANGES:
        n = int(rng.integers(1, 9))
        add(f"test.array.{TYPE_NAMES[vt]}", VT.ARRAY, [rand_int(rng, vt) for _ in range(n)], vt)
    add("test.array.f32", VT.ARRAY, [rand_f32(rng) for _ in range(int(rng.integers(1, 9)))], VT.FLOAT32)
    add("test.array.f64", VT.ARRAY, [float(rng.standard_normal()) for _ in range(5)], VT.FLOAT64)
    add("test.array.bool", VT.ARRAY, [bool(rng.integers(0, 2)) for _ in range(7)], VT.BOOL)
    add("test.array.string", VT.ARRAY, [rand_str(rng) for _ in range(int(rng.integers(3, 12)))], VT.STRING)

    if with_nested:
        # gguf-py infers each inner list's element type from its first item: int -> i32, str -> string
        ints = [[int(rng.integers(-1000, 1000)) for _ in range(int(rng.integers(1, 4)))] for _ in range(3)]
        strs = [[rand_str(rng) + "x" for _ in range(int(rng.integers(1, 3)))] for _ in range(2)]
        w.add_key_value("test.nested.i32", ints, VT.ARRAY)
        kv.append({"key": "test.nested.i32",
                   **describe(VT.ARRAY, [(VT.INT32, x) for x in ints], VT.ARRAY)})
        w.add_key_value("test.nested.string", strs, VT.ARRAY)
        kv.append({"key": "test.nested.string",
                   **describe(VT.ARRAY, [(VT.STRING, x) for x in strs], VT.ARRAY)})

    tensors = []
    for tname, np_shape, qtype in tensor_specs:
        ggml_dims = list(reversed(np_shape))
        if qtype in (QT.F32, QT.F16, QT.F64):
            dt = {QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64}[qtype]
            arr = rng.standard_normal(np_shape).astype(dt)
            w.add_tensor(tname, arr)
        elif qtype in (QT.I8, QT.I16, QT.I32, QT.I64):
            dt = {QT.I8: np.int8, QT.I16: np.int16, QT.I32: np.int32, QT.I64: np.int64}[qtype]
            info = np.iinfo(dt)
            arr = rng.integers(info.min, info.max, size=np_shape, dtype=dt, endpoint=True)
            w.add_tensor(tname, arr)
        else:
            # block types: raw bytes in gguf-py's byte shape (last dim in bytes)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*np_shape[:-1], np_shape[-1] // block * size)
            arr = rng.integers(0, 256, size=byte_shape, dtype=np.uint8)
            w.add_tensor(tname, arr, raw_dtype=qtype)
        tensors.append({"name": tname, "dims": ggml_dims, "type": int(qtype), "type_name": qtype.name,
                        "n_bytes": int(arr.nbytes), "data_hex": arr.tobytes().hex()})

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = gguf.GGUFReader(str(path))
    for t, rt in zip(tensors, r.tensors):
        t["offset"] = int(rt.data_offset) - int(r.data_offset)
    desc = {"version": 3, "alignment": alignment or 32, "data_offset": int(r.data_offset),
            "file_size": path.stat().st_size, "kv": kv, "tensors": tensors}
    check_file(path, desc)
    (FIX / f"{name}.json").write_text(json.dumps(desc, indent=1, ensure_ascii=False) + "\n")
    return path, desc


def write_fixtures():
    FIX.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240601)
    specs = [
        ("tok_embd.weight", (3, 64), QT.Q8_0),
        ("f32.2d", (3, 5), QT.F32),
        ("f32.4d", (2, 2, 3, 2), QT.F32),
        ("f32.1d", (7,), QT.F32),
        ("f16.2d", (4, 8), QT.F16),
        ("bf16.1d", (16,), QT.BF16),
        ("f64.1d", (3,), QT.F64),
        ("i8.1d", (5,), QT.I8),
        ("i16.2d", (2, 3), QT.I16),
        ("i32.1d", (9,), QT.I32),
        ("i64.1d", (2,), QT.I64),
        ("q4_0.2d", (2, 32), QT.Q4_0),
        ("q4_1.1d", (64,), QT.Q4_1),
        ("q5_0.1d", (32,), QT.Q5_0),
        ("q5_1.1d", (32,), QT.Q5_1),
        ("q2_k.1d", (256,), QT.Q2_K),
        ("q3_k.1d", (256,), QT.Q3_K),
        ("q4_k.2d", (2, 256), QT.Q4_K),
        ("q5_k.1d", (256,), QT.Q5_K),
        ("q6_k.1d", (512,), QT.Q6_K),
    ]
    write_py_fixture("py_all_types", rng, None, True, specs)
    write_py_fixture("py_align64", rng, 64, False,
                     [("a", (3,), QT.F32), ("b", (5, 1), QT.F16), ("c", (1, 32), QT.Q8_0)])
    path, desc = write_py_fixture("py_v2", rng, None, False, [("x", (2, 3), QT.F32)])
    # Versions 2 and 3 are laid out identically for little-endian files: make a v2 file by patching.
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path.write_bytes(bytes(data))
    desc["version"] = 2
    check_file(path, desc)
    (FIX / "py_v2.json").write_text(json.dumps(desc, indent=1, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------------
# Malformed corpus: a minimal byte-level GGUF builder that records where each field lands.

def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def gstr(b: bytes): return u64(len(b)) + b


class Raw:
    def __init__(self):
        self.b = bytearray()
        self.at = {}

    def put(self, label, data: bytes):
        self.at.setdefault(label, []).append(len(self.b))
        self.b += data
        return self

    def pos(self):
        return len(self.b)


def build(kvs=(), tensors=(), *, version=3, n_kv=None, n_tensors=None, data=b"", alignment=32,
          pad=True, magic=b"GGUF"):
    """kvs: (key bytes, type id, encoded value); tensors: (name bytes, dims, type id, offset).
    Labels recorded in .at: magic, version, n_tensors, n_kv, key, type, value, name, n_dims, dims,
    ttype, toffset, data."""
    r = Raw()
    r.put("magic", magic).put("version", u32(version))
    r.put("n_tensors", u64(len(tensors) if n_tensors is None else n_tensors))
    r.put("n_kv", u64(len(kvs) if n_kv is None else n_kv))
    for key, ty, val in kvs:
        r.put("key", gstr(key)).put("type", u32(ty)).put("value", val)
    for name, dims, ty, off in tensors:
        r.put("name", gstr(name)).put("n_dims", u32(len(dims)))
        for d in dims:
            r.put("dims", u64(d))
        r.put("ttype", u32(ty)).put("toffset", u64(off))
    if pad:
        r.b += b"\0" * ((-len(r.b)) % alignment)
    r.put("data", data)
    return r


def arr(elem_ty, count, payload: bytes):
    return u32(elem_ty) + u64(count) + payload


def rand_bytes(rng, n):
    return bytes(rng.integers(0, 256, size=n, dtype=np.uint8))


def malformed_cases(rng):
    """Yields (file stem, expected kind or None for a valid file, expected offset, note, bytes)."""
    arch = (b"general.architecture", VT.STRING, gstr(b"llama"))
    f32_4x2 = (b"w", [4, 2], QT.F32, 0)  # 32 bytes
    good = build([arch, (b"n", VT.UINT32, u32(7))], [f32_4x2, (b"v", [32], QT.Q8_0, 32)],
                 data=rand_bytes(rng, 32 + 34) + b"\0" * 30)
    yield "ok_baseline", None, None, "valid file the broken ones are variations of", good.b

    yield "empty", "truncated", 0, "zero bytes", b""
    yield "magic_only", "truncated", 4, "file ends before the version", b"GGUF"
    yield "bad_magic", "bad_magic", 0, "GGML instead of GGUF", b"GGML" + good.b[4:]
    for v, note in [(1, "GGUFv1 (u32 counts) is not supported"), (4, "future version"),
                    (0, "version 0"), (0x03000000, "big-endian v3")]:
        b = bytearray(good.b)
        b[4:8] = u32(v)
        yield f"version_{v:x}", "unsupported_version", 4, note, bytes(b)
    yield "truncated_header", "truncated", 16, "cut inside n_kv", good.b[:20]

    r = build([arch], n_kv=1 << 60)
    yield "n_kv_huge", "count_overrun", r.at["n_kv"][0], "n_kv = 2^60", r.b
    r = build([arch], n_tensors=(1 << 64) - 1)
    yield "n_tensors_huge", "count_overrun", r.at["n_tensors"][0], "n_tensors = 2^64-1", r.b
    r = build([arch], n_tensors=3)
    yield "n_tensors_small_overrun", "count_overrun", r.at["n_tensors"][0], \
        "3 tensor infos declared, none present", r.b

    r = build([(b"k", VT.UINT32, u32(1))])
    b = bytearray(r.b)
    b[r.at["key"][0]:r.at["key"][0] + 8] = u64(1 << 40)
    yield "key_length_overrun", "count_overrun", r.at["key"][0], "key length 2^40", bytes(b)

    r = build([arch, (b"s", VT.STRING, u64(1000) + b"short")])
    yield "string_length_overrun", "count_overrun", r.at["value"][1], \
        "string length 1000 with 5 bytes left", r.b

    r = build([arch, (b"big", VT.UINT64, u64(5))], pad=False)
    cut = r.at["value"][1] + 3
    yield "truncated_in_value", "truncated", r.at["value"][1], "file ends inside a u64 value", r.b[:cut]

    r = build([arch, (b"x", 13, u32(0))])
    yield "unknown_value_type", "unknown_value_type", r.at["type"][1], "value type 13", r.b
    r = build([arch, (b"x", VT.ARRAY, arr(99, 1, b"\0" * 8))])
    yield "unknown_array_elem_type", "unknown_value_type", r.at["value"][1], "array of type 99", r.b

    r = build([(b"a", VT.ARRAY, arr(VT.UINT32, 1 << 62, b"\0" * 16))])
    yield "array_count_huge", "count_overrun", r.at["value"][0] + 4, "u32 array of 2^62 elements", r.b
    r = build([(b"a", VT.ARRAY, arr(VT.UINT64, 3, u64(1) + u64(2)))], pad=False)
    yield "array_count_overrun", "count_overrun", r.at["value"][0] + 4, \
        "3 u64 elements, 2 present", r.b
    r = build([(b"a", VT.ARRAY, arr(VT.STRING, 1 << 40, gstr(b"x")))])
    yield "string_array_count_huge", "count_overrun", r.at["value"][0] + 4, "2^40 strings", r.b
    r = build([(b"a", VT.ARRAY, arr(VT.ARRAY, 1 << 50, arr(VT.UINT8, 0, b"")))])
    yield "nested_array_count_huge", "count_overrun", r.at["value"][0] + 4, "2^50 inner arrays", r.b

    r = build([(b"ok", VT.UINT8, b"\1"), (b"bad\xffkey", VT.UINT8, b"\1")])
    yield "invalid_utf8_key", "invalid_utf8", r.at["key"][1] + 8 + 3, "0xff in a key", r.b
    r = build([arch, (b"s", VT.STRING, gstr(b"ab\xc3("))])
    yield "invalid_utf8_value", "invalid_utf8", r.at["value"][1] + 8 + 2, \
        "broken two-byte sequence", r.b
    strs = gstr(b"fine") + gstr(b"\xe2\x82") + gstr(b"x")
    r = build([(b"toks", VT.ARRAY, arr(VT.STRING, 3, strs))])
    yield "invalid_utf8_array_element", "invalid_utf8", r.at["value"][0] + 12 + 12 + 8, \
        "truncated 3-byte sequence in element 1", r.b
    r = build([arch], [(b"t\xfe", [32], QT.F32, 0)], data=b"\0" * 128)
    yield "invalid_utf8_tensor_name", "invalid_utf8", r.at["name"][0] + 8 + 1, "0xfe in a name", r.b

    r = build([arch, (b"flag", VT.BOOL, b"\2")])
    yield "invalid_bool", "invalid_bool", r.at["value"][1], "bool byte 2", r.b
    r = build([(b"flags", VT.ARRAY, arr(VT.BOOL, 4, b"\0\1\1\x80"))])
    yield "invalid_bool_array", "invalid_bool", r.at["value"][0] + 12 + 3, "bool byte 0x80", r.b

    depth = 20
    nested = arr(VT.UINT8, 0, b"")
    for _ in range(depth - 1):
        nested = arr(VT.ARRAY, 1, nested)
    r = build([(b"deep", VT.ARRAY, nested)])
    # The reader allows 16 levels: the 17th array header (16 headers of 12 bytes in) is refused.
    yield "nesting_too_deep", "nesting_too_deep", r.at["value"][0] + 16 * 12, \
        f"{depth} nested arrays", r.b

    r = build([(b"", VT.UINT8, b"\1")])
    yield "empty_key", "empty_key", r.at["key"][0], "zero-length key", r.b
    r = build([arch, (b"n", VT.UINT32, u32(1)), (b"n", VT.UINT32, u32(2))])
    yield "duplicate_key", "duplicate_key", r.at["key"][2], "key 'n' twice", r.b
    r = build([arch], [(b"t", [8], QT.F32, 0), (b"t", [8], QT.F32, 32)], data=b"\0" * 64)
    yield "duplicate_tensor", "duplicate_tensor", r.at["name"][1], "tensor 't' twice", r.b

    for v, note in [(0, "alignment 0"), (48, "alignment 48")]:
        r = build([arch, (b"general.alignment", VT.UINT32, u32(v))])
        yield f"alignment_{v}", "bad_alignment", r.at["value"][1], note, r.b
    r = build([arch, (b"general.alignment", VT.UINT64, u64(32))])
    yield "alignment_u64", "bad_alignment", r.at["value"][1], "alignment stored as u64", r.b

    r = build([arch], [(b"t", [1, 1, 1, 1, 32], QT.F32, 0)], data=b"\0" * 128)
    yield "too_many_dims", "too_many_dims", r.at["n_dims"][0], "5 dimensions", r.b
    r = build([arch], [(b"t", [], QT.F32, 0)], data=b"\0" * 32)
    b = bytearray(r.b)
    b[r.at["n_dims"][0]:r.at["n_dims"][0] + 4] = u32(0x80000000)
    yield "n_dims_huge", "too_many_dims", r.at["n_dims"][0], "n_dims = 2^31", bytes(b)

    for tid, note in [(4, "removed Q4_2"), (23, "IQ4_XS (not supported)"), (1000, "garbage")]:
        r = build([arch], [(b"t", [32], tid, 0)], data=b"\0" * 256)
        yield f"tensor_type_{tid}", "unknown_tensor_type", r.at["ttype"][0], note, r.b

    r = build([arch], [(b"t", [1 << 32, 1 << 32], QT.F32, 0)], data=b"\0" * 32)
    yield "element_count_overflow", "element_count_overflow", r.at["n_dims"][0], \
        "2^32 x 2^32 elements", r.b
    r = build([arch], [(b"t", [1 << 63], QT.I8, 0)], data=b"\0" * 32)
    yield "dim_over_i64", "element_count_overflow", r.at["n_dims"][0], "a dim of 2^63", r.b
    r = build([arch], [(b"t", [1 << 61, 1], QT.F64, 0)], data=b"\0" * 32)
    yield "byte_size_overflow", "element_count_overflow", r.at["n_dims"][0], \
        "2^61 f64 elements: byte size exceeds i64", r.b

    r = build([arch], [(b"t", [33, 2], QT.Q4_0, 0)], data=b"\0" * 128)
    yield "row_not_whole_blocks", "tensor_shape_mismatch", r.at["n_dims"][0], \
        "Q4_0 row of 33 elements", r.b
    r = build([arch], [(b"t", [100], QT.Q4_K, 0)], data=b"\0" * 256)
    yield "kquant_row_not_whole_blocks", "tensor_shape_mismatch", r.at["n_dims"][0], \
        "Q4_K row of 100 elements", r.b

    r = build([arch], [(b"a", [4], QT.F32, 0), (b"b", [4], QT.F32, 16)], data=b"\0" * 64)
    yield "misaligned_tensor", "misaligned_tensor", r.at["toffset"][1], \
        "offset 16 with alignment 32", r.b
    r = build([arch, (b"general.alignment", VT.UINT32, u32(64))],
              [(b"a", [4], QT.F32, 0), (b"b", [4], QT.F32, 32)], data=b"\0" * 128, alignment=64)
    yield "misaligned_tensor_align64", "misaligned_tensor", r.at["toffset"][1], \
        "offset 32 with alignment 64", r.b

    r = build([arch], [(b"a", [16], QT.F32, 0), (b"b", [8], QT.F32, 32)], data=b"\0" * 128)
    yield "overlapping_tensors", "tensor_overlap", r.at["toffset"][1], \
        "'a' spans 0..64, 'b' starts at 32", r.b
    r = build([arch], [(b"late", [8], QT.F32, 64), (b"early", [32], QT.F32, 0)], data=b"\0" * 128)
    yield "overlapping_tensors_unordered", "tensor_overlap", r.at["toffset"][0], \
        "'early' spans 0..128 and covers 'late' (listed first)", r.b
    r = build([arch], [(b"a", [8], QT.F32, 0), (b"b", [8], QT.F32, 0)], data=b"\0" * 64)
    yield "same_offset_tensors", "tensor_overlap", r.at["toffset"][1], "two tensors at offset 0", r.b

    r = build([arch], [(b"t", [64], QT.F32, 0)], data=b"\0" * 100)
    yield "tensor_beyond_eof", "tensor_out_of_bounds", r.at["toffset"][0], \
        "256-byte tensor, 100 bytes of data", r.b
    r = build([arch], [(b"t", [8], QT.F32, (1 << 64) - 32)], data=b"\0" * 32)
    yield "tensor_offset_huge", "tensor_out_of_bounds", r.at["toffset"][0], \
        "offset near 2^64 (start overflows)", r.b
    r = build([arch], [(b"t", [8], QT.F32, 0)], pad=False)
    yield "tensor_no_data_section", "tensor_out_of_bounds", r.at["toffset"][0], \
        "file ends at the tensor table", r.b

    r = build([arch], [(b"t", [8, 8], QT.F32, 0)], data=b"\0" * 256, pad=False)
    cut = r.at["dims"][1] + 5
    yield "truncated_tensor_info", "truncated", r.at["dims"][1], "file ends inside dims[1]", r.b[:cut]
    r = build([arch], [(b"t", [8], QT.F32, 0)], pad=False)
    cut = r.at["toffset"][0] + 2
    yield "truncated_tensor_offset", "truncated", r.at["toffset"][0], "file ends inside the offset", \
        r.b[:cut]


def write_malformed():
    BAD.mkdir(parents=True, exist_ok=True)
    for old in BAD.glob("*.gguf"):
        old.unlink()
    rng = np.random.default_rng(7)
    manifest = []
    for stem, kind, offset, note, data in malformed_cases(rng):
        (BAD / f"{stem}.gguf").write_bytes(bytes(data))
        manifest.append({"file": f"{stem}.gguf", "kind": kind, "offset": offset, "note": note})
        # Cross-check with the reference reader: it must reject what we expect rejected (where it
        # validates that aspect) and accept the baseline.
        if kind is None:
            gguf.GGUFReader(str(BAD / f"{stem}.gguf"))
    (BAD / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    os.chdir(ROOT)
    write_fixtures()
    write_malformed()
    print(f"wrote fixtures to {FIX.relative_to(ROOT)} and {BAD.relative_to(ROOT)}")
