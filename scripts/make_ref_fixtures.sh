#!/usr/bin/env bash
# Remakes every llama.cpp reference fixture of the CPU engine's tests, from scratch:
#   crates/cpu/tests/fixtures/smollm2_q4_1_logits.json        (scripts/ref_logits.py)
#   crates/cpu/tests/fixtures/smollm2_chat_ref.json           (scripts/ref_chat.py)
#   crates/cpu/tests/fixtures/synth_llama1b_q4_k_m_logits.json (scripts/ref_logits.py on
#       `crossover synth --preset llama-3.2-1b --quant q4_k_m --seed 1`)
# Needs llama-cpp-python (scripts/setup_llama_cpp.sh) and cargo (or CROSSOVER_BIN).
# Run it when `crossover synth` changes what it writes, or the teacher text changes.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FIX=$REPO/crates/cpu/tests/fixtures
PY=${PYTHON:-python3}
SYNTH_SEED=1

"$REPO/scripts/setup_llama_cpp.sh"
SMOL=$("$REPO/scripts/fetch_model.sh" | tail -n 1)
"$PY" "$REPO/scripts/ref_logits.py" --model "$SMOL" --out "$FIX/smollm2_q4_1_logits.json"
"$PY" "$REPO/scripts/ref_chat.py" --model "$SMOL" --out "$FIX/smollm2_chat_ref.json"

SYNTH=$(SYNTH_FORCE=1 "$REPO/scripts/synth_model.sh" llama-3.2-1b q4_k_m "$SYNTH_SEED" | tail -n 1)
"$PY" "$REPO/scripts/ref_logits.py" --model "$SYNTH" \
    --synth-command "synth --preset llama-3.2-1b --quant q4_k_m --seed $SYNTH_SEED" \
    --out "$FIX/synth_llama1b_q4_k_m_logits.json"
