#!/usr/bin/env bash
# The checks that need a GPU, as one run for a CUDA machine (not run yet: no GPU was lent so far).
#   1. FlashInfer against the torch backend on random ragged batches (tests/test_flashinfer.py),
#      and the model tests (which then run through FlashInfer's backend choice on CUDA);
#   2. the host tier's CUDA path (pinned host pool, side-stream load-back: tests/test_host_tier_cuda.py);
#   3. the serving comparison (prefix cache on / off / transformers) on the GPU.
# Needs radixserve installed with its gpu and test extras (flashinfer-python, pytest, ...).
# Results go to $OUT (the device tool's output folder) or bench/results.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python -c "import torch, flashinfer; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(), flashinfer.__version__)"
python -m pytest -q -p no:cacheprovider tests/test_flashinfer.py tests/test_attention.py tests/test_host_tier_cuda.py 2>&1 \
  | tee "$OUT/gpu-tests.log"
python -m radixserve bench compare --no-progress --server-args "--dtype bfloat16" --json "$OUT/compare-gpu.json" --plot "$OUT/compare-gpu-ttft.png" \
  2>&1 | tee "$OUT/compare-gpu.log"
