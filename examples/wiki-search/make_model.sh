#!/usr/bin/env bash
# Regenerates examples/wiki-search/model/, the SFT'd starting model of rl.toml: a tiny Qwen3
# built offline with seed 0, the environment's demonstrations (seed 0, mixed quality, practice
# pages, not the shipped ones), then `sft @ sft.toml` (seed 0). Every step is seeded, and the
# trainer runs one thread (OMP_NUM_THREADS=1) so that the float sums do not depend on the core
# count; another CPU type can still change them in the last bits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUTPUT_DIR:-outputs}
run=wiki-search-sft-$(date +%s)
./uvw pip install -q -e environments/wiki_search
./uvw run rlbus-tiny-model "$out/models/tiny-qwen3" --seed 0
./uvw run python -m wiki_search.demos "$out/wiki-search/demos.jsonl" --num 3200 --seed 0
OMP_NUM_THREADS=1 ./uvw run sft @ examples/wiki-search/sft.toml \
  --model.name "$out/models/tiny-qwen3" --data.path "$out/wiki-search/demos.jsonl" \
  --output-dir "$out" --run.name "$run"
rm -rf examples/wiki-search/model
cp -r "$out/$run/model" examples/wiki-search/model
echo "examples/wiki-search/model <- $out/$run/model"
