#!/usr/bin/env bash
# Runs bench/gpu_check.sh on the lent GPU machine from the bundle bench/gpu_bundle.sh made here:
#   device run: bash bench/gpu_device_run.sh   (carry: .devbundle; timeout_s: 590)
# First each package is imported in its own process under a time bound that prints the
# stack of a hang (the first try, in session 21, spent its whole lease on an import that
# never returned, unseen); then the kernels are built and kept in $OUT/kernels.tgz: copied
# here as .devbundle/kernels.tgz, they are installed as FlashInfer's ahead-of-time modules
# (flashinfer/data/aot/<name>/<name>.so, which it loads without building) on a later machine.
# Everything ends within RUN_BUDGET_S (570 s: the device call's 590 less a margin).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p "${OUT:-bench/results}"
export PYTHONUNBUFFERED=1 OUT=$(realpath "${OUT:-bench/results}")
RUN_BUDGET_S=${RUN_BUDGET_S:-570}
SECONDS=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .devbundle/whl/*.whl 2>&1 | tail -3
tar -C /tmp/site -xJf .devbundle/flashinfer.tar.xz
# A wrapper, not a link: a link to a virtual environment's python loses the environment.
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/bin/python
chmod +x /tmp/bin/python
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer
echo "set up in $SECONDS s; python $(command -v python3)"
nvidia-smi -L; nvcc --version | tail -1; nproc
# Each import under a time bound that prints the stack of a hang: torch, then FlashInfer (the
# likeliest to hang: it probes the GPU and its own caches), then radixserve's other packages.
import_bounded() {  # name, python statements
  local start=$SECONDS
  timeout -s KILL 75 python -X faulthandler -c "
import faulthandler; faulthandler.dump_traceback_later(60, exit=True)
$2
print('imported $1')" 2>&1 | tail -25
  local rc=${PIPESTATUS[0]}
  echo "  ($1: $((SECONDS - start)) s, rc $rc)"
  return "$rc"
}
import_bounded torch "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" || exit 1
failed=()
import_bounded flashinfer "import pynvml, tvm_ffi, cuda.tile; import flashinfer; print(flashinfer.__version__)" \
  || failed+=(flashinfer)
import_bounded others "import xgrammar, msgspec, starlette, uvicorn, gguf, jsonschema" || exit 1
python -c "import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name())" || exit 1
if [[ " ${failed[*]} " == *" flashinfer "* ]]; then
  # The rest still runs on the torch backend (the first CUDA run of the engine is worth having).
  echo "flashinfer does not import: removed; the checks run without it"; rm -rf /tmp/site/flashinfer
else
  if [[ -f .devbundle/kernels.tgz ]]; then
    mkdir -p /tmp/site/flashinfer/data/aot && tar -C /tmp/site/flashinfer/data/aot -xzf .devbundle/kernels.tgz
  fi
  PYTHONPATH=$PWD:/tmp/site timeout 330 python bench/flashinfer_warmup.py > "$OUT/warmup.log" 2>&1
  echo "kernels built: rc=$? at $SECONDS s"; tail -n 20 "$OUT/warmup.log"
  # Each built module as <name>/<name>.so, the layout of FlashInfer's ahead-of-time folder.
  ops=$(find /tmp/flashinfer -type d -name cached_ops | head -1)
  if [[ -n $ops ]]; then
    (cd "$ops" && ls -d */*.so | tar -czf "$OUT/kernels.tgz" -T -) && ls -la "$OUT/kernels.tgz"
  fi
  export GPU_CHECK_SKIP_WARMUP=1  # built above
fi
GPU_CHECK_BUDGET_S=$((RUN_BUDGET_S - SECONDS)) bash bench/gpu_check.sh; echo "gpu_check: rc=$? at $SECONDS s"
