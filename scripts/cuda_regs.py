#!/usr/bin/env python3
"""Registers, shared memory and spills of the CUDA kernels as ptxas reports them, without a GPU.

Compiles the kernel program the way crates/cuda/src/compile.rs does (the .cu files in SOURCES
order, each after a #line directive; the same NVRTC options) to an sm_90 CUBIN with
`--ptxas-options=-v` and prints the report lines of the kernels whose names match PATTERN.
REV is a git revision whose crates/cuda/kernels are read, or WT for the working tree.
Needs libnvrtc.so.13 (the PyPI wheel nvidia-cuda-nvrtc; LIBNVRTC names another path).
CUBIN_OUT=FILE also writes the CUBIN, for `cuobjdump -sass` (PyPI nvidia-cuda-cuobjdump with
nvidia-cuda-nvdisasm on PATH).

  python3 scripts/cuda_regs.py WT 'attn_batch|attn_one'
  python3 scripts/cuda_regs.py 9959f4c attn_batch
"""
import ctypes
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def sources(rev):
    text = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:crates/cuda/src/compile.rs"] if rev != "WT" else
        ["cat", os.path.join(ROOT, "crates/cuda/src/compile.rs")],
        capture_output=True, check=True, text=True).stdout
    names = re.findall(r'\("(\w+\.cu)", include_str!', text)
    src = ""
    for n in names:
        if rev == "WT":
            with open(os.path.join(ROOT, "crates/cuda/kernels", n)) as f:
                t = f.read()
        else:
            t = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:crates/cuda/kernels/{n}"],
                               capture_output=True, check=True, text=True).stdout
        src += f'#line 1 "{n}"\n{t}\n'
    return src


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rev = sys.argv[1]
    pat = re.compile(sys.argv[2] if len(sys.argv) > 2 else ".")
    default = None
    try:
        import nvidia.cu13  # noqa: F401  (the wheel's package)
        default = os.path.join(list(nvidia.cu13.__path__)[0], "lib", "libnvrtc.so.13")
    except ImportError:
        default = "libnvrtc.so.13"
    lib = ctypes.CDLL(os.environ.get("LIBNVRTC", default))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), sources(rev).encode(), b"crossover.cu", 0,
                              None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"--fmad=true", b"-default-device",
            b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    kernel = None
    for line in log.value.decode(errors="replace").splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
        elif kernel and pat.search(kernel) and ("Used" in line or "spill" in line):
            print(f"{kernel}: {line.split(':', 1)[-1].strip()}")
    if rc:
        print(log.value.decode(errors="replace"))
        sys.exit(f"compile failed ({rc})")
    out = os.environ.get("CUBIN_OUT")
    if out:
        n = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, buf)
        with open(out, "wb") as f:
            f.write(buf.raw)


if __name__ == "__main__":
    main()
