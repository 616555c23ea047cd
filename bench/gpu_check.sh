#!/usr/bin/env bash
# The checks that need a GPU, as one run on a CUDA machine: FlashInfer's kernels are built
# first, all variants in parallel (bench/flashinfer_warmup.py), then every stage runs under
# its own time bound, cut to what is left of GPU_CHECK_BUDGET_S when that is set.
#   1. FlashInfer against the torch backend on random ragged batches, both decode wrappers
#      (CUDA cores and tensor cores), sliding windows (window_left), and the demo model's
#      logits (tests/test_flashinfer.py); the host tier's CUDA path (pinned host pool,
#      side-stream load-back: tests/test_host_tier_cuda.py);
#   2. the engine through FlashInfer in bfloat16 against the torch backend on the same
#      weights: greedy generation, the cache-hit path, heavy eviction with preemption, and
#      sliding-window models (every layer windowed, and full next to windowed layers)
#      (tests/test_flashinfer_engine.py);
#   3. the serving comparison in bfloat16, in process and over HTTP, against transformers on
#      the same GPU, with the engine's step-time breakdown;
#   4. tensor parallelism at TP=2 (NCCL, FlashInfer on each rank) against TP=1, with eviction,
#      preemption, the host tier and the per-rank KV check (tests/test_tensor_parallel_cuda.py;
#      needs two GPUs: skipped on one, NCCL puts one rank per GPU).
# Needs radixserve installed with its gpu and test extras: pip install -e '.[gpu,test]'.
# Results go to $OUT (the device tool's output folder) or bench/results.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
SECONDS=0
# Without FlashInfer the stages still run: the host tier's CUDA test and the comparison need
# only torch (the FlashInfer tests then skip, and say so).
timeout 120 python -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name())" \
  | tee "$OUT/gpu-env.log"
timeout 120 python -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 \
  | tee -a "$OUT/gpu-env.log" && have_flashinfer=1 || have_flashinfer=0
stage() { echo "== $1 ($SECONDS s so far)" | tee -a "$OUT/gpu-stages.log"; }
# Each stage's own bound, cut to what is left of GPU_CHECK_BUDGET_S (the device call's limit,
# from gpu_device_run.sh): a stage that cannot start in time is skipped and counted failed.
BUDGET=${GPU_CHECK_BUDGET_S:-100000}
bounded() {
  local limit=$1 left=$((BUDGET - SECONDS))
  shift
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "skipped: the time budget is spent"; return 1; fi
  timeout "$limit" "$@"
}
status=0  # every stage runs; the script fails at the end if any did

if ((have_flashinfer)) && [[ -z ${GPU_CHECK_SKIP_WARMUP:-} ]]; then
  stage "FlashInfer's kernels built, every variant at once"
  bounded 330 python bench/flashinfer_warmup.py > "$OUT/gpu-warmup.log" 2>&1 || status=1
  tail -n 25 "$OUT/gpu-warmup.log"
fi

stage "FlashInfer kernels vs the torch backend; the host tier on CUDA"
bounded 150 python -m pytest -q -p no:cacheprovider -rs tests/test_flashinfer.py tests/test_attention.py \
  tests/test_host_tier_cuda.py 2>&1 \
  | tee "$OUT/gpu-kernel-tests.log" || status=1

stage "engine through FlashInfer (bfloat16) vs the torch backend"
bounded 150 python -m pytest -q -p no:cacheprovider -rs tests/test_flashinfer_engine.py 2>&1 \
  | tee "$OUT/gpu-engine-tests.log" || status=1

stage "serving comparison, bfloat16 (in process and over HTTP)"
bounded 180 python -m radixserve bench compare --no-progress --mode both --server-args "--dtype bfloat16" \
  --json "$OUT/compare-gpu.json" --plot "$OUT/compare-gpu-ttft.png" 2>&1 | tee "$OUT/compare-gpu.log" \
  || status=1

stage "tensor parallelism: TP=2 over NCCL with FlashInfer vs TP=1 (two GPUs)"
bounded 90 python -m pytest -q -p no:cacheprovider -rs tests/test_tensor_parallel_cuda.py 2>&1 \
  | tee "$OUT/gpu-tensor-parallel.log" || status=1

stage "done (status $status)"
# FlashInfer compiles each kernel variant on first use unless an ahead-of-time build is
# installed (flashinfer-jit-cache, or a wheel with AOT kernels); the compiled kernels are
# cached (~/.cache/flashinfer), so a second run takes the figures above without compiling.
exit $status
