#!/usr/bin/env bash
# The checks that need a GPU, as one run on a CUDA machine (under 5 minutes on one GPU once
# FlashInfer's kernels are compiled; see the note at the end). Not run yet: no GPU was lent.
#   1. the engine through FlashInfer in bfloat16 against the torch backend on the same
#      weights: greedy generation, the cache-hit path, heavy eviction with preemption, and
#      sliding-window models (every layer windowed, and full next to windowed layers)
#      (tests/test_flashinfer_engine.py);
#   2. FlashInfer against the torch backend on random ragged batches, both decode wrappers
#      (CUDA cores and tensor cores), sliding windows (window_left), and the demo model's
#      logits (tests/test_flashinfer.py);
#      the host tier's CUDA path (pinned host pool, side-stream load-back:
#      tests/test_host_tier_cuda.py);
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
python -c "import torch, flashinfer; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(), 'flashinfer', flashinfer.__version__)" \
  | tee "$OUT/gpu-env.log"
stage() { echo "== $1 ($SECONDS s so far)" | tee -a "$OUT/gpu-stages.log"; }
status=0  # every stage runs; the script fails at the end if any did

stage "engine through FlashInfer (bfloat16) vs the torch backend"
python -m pytest -q -p no:cacheprovider -rs tests/test_flashinfer_engine.py 2>&1 \
  | tee "$OUT/gpu-engine-tests.log" || status=1

stage "FlashInfer kernels vs the torch backend; the host tier on CUDA"
python -m pytest -q -p no:cacheprovider -rs tests/test_flashinfer.py tests/test_attention.py \
  tests/test_host_tier_cuda.py 2>&1 \
  | tee "$OUT/gpu-kernel-tests.log" || status=1

stage "serving comparison, bfloat16 (in process and over HTTP)"
python -m radixserve bench compare --no-progress --mode both --server-args "--dtype bfloat16" \
  --json "$OUT/compare-gpu.json" --plot "$OUT/compare-gpu-ttft.png" 2>&1 | tee "$OUT/compare-gpu.log" \
  || status=1

stage "tensor parallelism: TP=2 over NCCL with FlashInfer vs TP=1 (two GPUs)"
python -m pytest -q -p no:cacheprovider -rs tests/test_tensor_parallel_cuda.py 2>&1 \
  | tee "$OUT/gpu-tensor-parallel.log" || status=1

stage "done (status $status)"
# FlashInfer compiles each kernel variant on first use unless an ahead-of-time build is
# installed (flashinfer-jit-cache, or a wheel with AOT kernels); the compiled kernels are
# cached (~/.cache/flashinfer), so a second run takes the figures above without compiling.
exit $status
