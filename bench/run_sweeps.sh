#!/usr/bin/env bash
# Reproduces every simulate table in bench/README.md and docs/benchmark.md (CPU only, about 30
# minutes on 2 idle cores).
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

# The host tier on the trace: device 0.5M tokens, host 0..16M (hit rate vs host capacity, with
# LRU, device-only and one-cache-of-the-same-size runs next to the default), then the write
# policies at the target configuration (device 0.5M + host 8M).
HOST_CAPS=0,0.5M,1M,2M,4M,8M,16M
sweep mooncake-host-sequential-p512 --trace "$TRACE" --capacity-tokens 0.5M --host-capacity-tokens "$HOST_CAPS" \
  --page-size 512 --sequential
sweep mooncake-host-serving-p512 --trace "$TRACE" --capacity-tokens 0.5M --host-capacity-tokens "$HOST_CAPS" \
  --page-size 512
sweep mooncake-host-serving-p16 --trace "$TRACE" --capacity-tokens 0.5M --host-capacity-tokens 8M --no-baselines
for policy in write-back write-through-selective; do
  sweep "mooncake-host-$policy-p512" --trace "$TRACE" --capacity-tokens 0.5M --host-capacity-tokens 8M \
    --page-size 512 --host-write-policy "$policy" --no-baselines
done

# Synthetic workloads under the serving loop (all requests at t=0; sessions turn by turn).
sweep gsp --workload gsp --capacity-tokens 50k,100k,200k,400k --study
sweep multiturn --workload multiturn --capacity-tokens 16k,32k,64k,128k --study
sweep agent --workload agent --capacity-tokens 16k,32k,64k,128k --study
sweep fewshot --workload fewshot --capacity-tokens 3k,4k,8k,16k --study

# The host tier on chat and agent sessions: a device pool too small for them, host 0..4x it.
sweep multiturn-host --workload multiturn --capacity-tokens 16k --host-capacity-tokens 0,16k,32k,64k
sweep agent-host --workload agent --capacity-tokens 16k --host-capacity-tokens 0,16k,32k,64k
