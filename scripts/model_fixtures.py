#!/usr/bin/env python3
"""Writes crates/model/tests/fixtures/smollm2_layout.json: what the `gguf` Python package (the
reference reader) sees in the default SmolLM2 model: the architecture's hyper-parameter keys, the
vocabulary size, and every tensor's name, type and shape. The model crate's tests check that
`ModelConfig::from_gguf` and `ModelWeights::from_gguf` read the same file the same way.

Usage: python3 scripts/model_fixtures.py [MODEL.gguf]   (default: the file scripts/fetch_model.sh
fetches into .cache/models/).
"""

import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import gguf

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("CROSSOVER_CACHE", REPO / ".cache"))
DEFAULT = CACHE / "models" / "smollm2-135m-instruct-q4_1.gguf"
OUT = REPO / "crates" / "model" / "tests" / "fixtures" / "smollm2_layout.json"


def scalar(field):
    """The value of a scalar or string metadata field."""
    v = field.contents()
    return v


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    if not path.is_file():
        sys.exit(f"{path} is missing: run scripts/fetch_model.sh first")
    r = gguf.GGUFReader(str(path))
    arch = scalar(r.fields["general.architecture"])
    metadata = {}
    for name, field in r.fields.items():
        if name.startswith(arch + ".") or name in ("general.architecture", "general.file_type", "general.name"):
            metadata[name] = scalar(field)
    tokens = r.fields["tokenizer.ggml.tokens"]
    tensors = [[t.name, t.tensor_type.name, [int(d) for d in t.shape]] for t in r.tensors]
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    doc = {
        "source": path.name,
        "sha256": sha,
        "reader": f"gguf {importlib.metadata.version('gguf')}",
        "metadata": metadata,
        "n_tokens": len(tokens.data),
        "tensors": tensors,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    # One tensor per line keeps the fixture readable and its diffs small.
    text = json.dumps({k: v for k, v in doc.items() if k != "tensors"}, indent=1)[:-2]
    rows = ",\n".join("  " + json.dumps(t) for t in tensors)
    OUT.write_text(text + ',\n "tensors": [\n' + rows + "\n ]\n}\n")
    print(f"wrote {OUT} ({len(tensors)} tensors)")


if __name__ == "__main__":
    main()
