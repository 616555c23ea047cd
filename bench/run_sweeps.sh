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

# Routing across 4 replicas, served-like: the CPU-sized "large" workloads of
# bench/cluster_routers.py, 4 x 5,120 tokens against 1 x 20,480, released by a closed loop of
# 16 clients as `bench serve` sends them; all replicas at one speed, then two at half speed
# (replicas sharing cores). "no-guard" is the rule without its conversation guard.
cluster() {  # cluster NAME WORKLOAD ARGS SPEEDS [EXTRA...]
  local name=$1 workload=$2 args=$3 speeds=$4; shift 4
  python -m radixserve bench simulate --workload "$workload" --workload-args "$args,vocab_size=2048" \
    --capacity-tokens 5120 --replicas 4 --concurrency 16 --replica-speeds "$speeds" \
    --max-batch-tokens 2048 --prefill-tokens-per-s 20000 --no-progress \
    --json "$OUT/$name.json" --markdown "$OUT/$name.md" "$@"
}
GSP=num_groups=16,prompts_per_group=64,system_len=512,question_len=64,output_len=8
MULTITURN=num_clients=32,num_turns=6,num_system_prompts=4,system_len=256,message_len=64,output_len=8
AGENT=num_agents=16,num_steps=6,system_len=512,task_len=64,tool_len=96,output_len=8
for speeds in 1,1,1,1 1,0.5,1,0.5; do
  for workload in gsp multiturn agent; do
    args=GSP; [ "$workload" = multiturn ] && args=MULTITURN; [ "$workload" = agent ] && args=AGENT
    cluster "cluster-$workload-$speeds" "$workload" "${!args}" "$speeds" \
      --router cache-aware,power-of-two,prefix-affinity
    cluster "cluster-$workload-$speeds-no-guard" "$workload" "${!args}" "$speeds" \
      --router cache-aware --router-kwargs share_abs=inf,cached_balance_abs=3
  done
done
