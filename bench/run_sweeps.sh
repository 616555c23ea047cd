#!/usr/bin/env bash
# Reproduces every table in bench/README.md and docs/benchmark.md (CPU only, about 15 minutes).
# Results (JSON, markdown tables, PNG plots) go to bench/results/ (not tracked).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=bench/results
TRACE=bench/data/mooncake_synthetic_trace.jsonl
MOONCAKE_CAPS=0.5M,1M,2M,4M
mkdir -p "$OUT"

sweep() {  # sweep NAME ARGS...: one `radixserve bench simulate` sweep with json, table and plot
  local name=$1; shift
  python -m radixserve bench simulate "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
    --plot "$OUT/$name.png"
}

# Mooncake trace. 1) The README's setting: 512-token pages, one request at a time.
sweep mooncake-sequential-p512 --trace "$TRACE" --capacity-tokens "$MOONCAKE_CAPS" --page-size 512 \
  --sequential --study
# 2) The same at 16-token pages, and 3) under the serving loop (trace timestamps, continuous batching).
sweep mooncake-sequential-p16 --trace "$TRACE" --capacity-tokens "$MOONCAKE_CAPS" --sequential --study
sweep mooncake-serving-p16 --trace "$TRACE" --capacity-tokens "$MOONCAKE_CAPS" --study

# Synthetic workloads under the serving loop (all requests at t=0; sessions turn by turn).
sweep gsp --workload gsp --capacity-tokens 50k,100k,200k,400k --study
sweep multiturn --workload multiturn --capacity-tokens 16k,32k,64k,128k --study
sweep agent --workload agent --capacity-tokens 16k,32k,64k,128k --study
sweep fewshot --workload fewshot --capacity-tokens 3k,4k,8k,16k --study
