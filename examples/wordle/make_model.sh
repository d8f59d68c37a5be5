#!/usr/bin/env bash
# Regenerates examples/wordle/model/, the SFT'd starting model of rl.toml: a tiny Qwen3 built
# offline with seed 0, demonstration games written by rlbus_wordle.demos (seed 0), then
# `sft @ sft.toml` (seed 0). Every step is seeded; another CPU type or thread count can change
# float sums in the last bits. Needs the environment package (`./uvw run rl env install
# environments/wordle`) for the demonstrations.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUTPUT_DIR:-outputs}
run=wordle-sft-$(date +%s)
./uvw run rlbus-tiny-model "$out/models/tiny-qwen3" --seed 0
./uvw run python -m rlbus_wordle.demos "$out/wordle/demos.jsonl" --num-games 4000 --weak-fraction 0.2 \
  --sloppy-fraction 0.25 --seed 0
./uvw run sft @ examples/wordle/sft.toml --model.name "$out/models/tiny-qwen3" \
  --data.path "$out/wordle/demos.jsonl" --output-dir "$out" --run.name "$run"
rm -rf examples/wordle/model
cp -r "$out/$run/model" examples/wordle/model
echo "examples/wordle/model <- $out/$run/model"
