#!/usr/bin/env bash
# Regenerates examples/reverse-text/model/, the SFT'd starting model of rl.toml:
# a tiny Qwen3 built offline with seed 0, then `sft @ sft.toml` (seed 0, 700 steps, ~4 min on
# 2 CPU cores). Both steps are seeded: on our 2-core VM this reproduced the shipped files bit for
# bit (2026-12-02). Another CPU type or thread count can change float sums in the last bits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUTPUT_DIR:-outputs}
run=reverse-text-sft-$(date +%s)
./uvw run rlbus-tiny-model "$out/models/tiny-qwen3" --seed 0
./uvw run sft @ examples/reverse-text/sft.toml --model.name "$out/models/tiny-qwen3" \
  --output-dir "$out" --run.name "$run"
rm -rf examples/reverse-text/model
cp -r "$out/$run/model" examples/reverse-text/model
echo "examples/reverse-text/model <- $out/$run/model"
