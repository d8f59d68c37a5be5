#!/usr/bin/env bash
# Regenerates examples/alphabet-sort/model/, the SFT'd starting model of rl.toml: the
# demonstrations (alphabet_sort.demos, seed 0), a tiny Qwen3 built offline with seed 0, then
# `sft @ sft.toml` (seed 0). Every step is seeded; another CPU type or thread count can change
# float sums in the last bits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUTPUT_DIR:-outputs}
run=alphabet-sort-sft-$(date +%s)
./uvw pip install -q -e environments/alphabet_sort
./uvw run python -m alphabet_sort.demos "$out/alphabet-sort/demos.jsonl" --lazy-fraction 0.25 --seed 0
./uvw run rlbus-tiny-model "$out/models/tiny-qwen3" --seed 0
./uvw run sft @ examples/alphabet-sort/sft.toml --model.name "$out/models/tiny-qwen3" \
  --data.path "$out/alphabet-sort/demos.jsonl" --output-dir "$out" --run.name "$run"
rm -rf examples/alphabet-sort/model
cp -r "$out/$run/model" examples/alphabet-sort/model
echo "examples/alphabet-sort/model <- $out/$run/model"
