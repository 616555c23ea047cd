#!/usr/bin/env bash
# Packs what bench/gpu_check.sh needs on a GPU machine that cannot reach a package registry
# (the device machine lent to some sessions): FlashInfer and the Python packages radixserve
# imports that such a machine lacks, as Python 3.12 / x86-64 wheels, in .devbundle/ (ignored
# by git; bench/gpu_device_run.sh installs them there).
#
# FlashInfer's wheel (101 MB) holds the CUDA sources of every kernel family it can build;
# radixserve builds only the batch prefill / decode attention kernels, whose sources are the
# top-level files of flashinfer/data/csrc and the headers beside it. The rest (csrc's
# subfolders and the sources under its experimental packages) is dropped and the package
# travels as one xz tarball (about 18 MB), within the device tool's 64 MiB.
#
# --kernels also builds FlashInfer's kernels for the H200 (sm_90a) here, with no GPU: CUDA
# 13.0's compiler from its wheels (the version of the device image's nvcc), about 10 min on 2
# cores, packed as .devbundle/kernels.tgz (<name>/<name>.so), which gpu_device_run.sh installs
# as FlashInfer's ahead-of-time modules, so the device run builds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
KERNELS=0
[[ ${1:-} == --kernels ]] && KERNELS=1
FLASHINFER=${FLASHINFER:-flashinfer-python==0.7.4}
BUNDLE="$PWD/.devbundle"  # absolute: the kernels' build runs in folders of its own
grep -qx '/.devbundle/' .git/info/exclude 2>/dev/null || echo '/.devbundle/' >> .git/info/exclude
rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/whl" "$BUNDLE/tmp"
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
# FlashInfer's own needs that the device image lacks (it has torch, numpy, ninja, einops,
# click, tabulate, nvidia-ml-py, and requests with urllib3, idna, certifi and
# charset-normalizer, which FlashInfer imports too), then radixserve's (the image has transformers, tokenizers,
# safetensors, prometheus-client, httpx, tqdm, matplotlib, hypothesis, pytest-timeout).
download "$BUNDLE/whl" 'apache-tvm-ffi<0.2,>=0.1.11' cuda-tile \
  msgspec xgrammar gguf starlette uvicorn jsonschema jsonschema-specifications referencing rpds-py \
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
download "$BUNDLE/tmp" "$FLASHINFER"
python3 -m pip install -q --no-deps --no-compile --target "$BUNDLE/tmp/site" "$BUNDLE"/tmp/*.whl
package="$BUNDLE/tmp/site/flashinfer"
find "$package/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$package" -type f -not -path "$package/data/*" \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \
  -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' -o -name '*.jinja' -o -name '*.inc' -o -name '*.inl' \
  -o -name '*.cubin' -o -name '*.ptx' \) -delete
rm -rf "$BUNDLE/tmp/site/bin"
tar -C "$BUNDLE/tmp/site" -cJf "$BUNDLE/flashinfer.tar.xz" .
if ((KERNELS)); then
  cuda="$BUNDLE/tmp/cuda" ws="$BUNDLE/tmp/workspace"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$BUNDLE/tmp/cudawhl" 'nvidia-cuda-nvcc==13.0.*' \
    'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*' 'nvidia-cuda-crt==13.0.*' 'nvidia-nvvm==13.0.*'
  for wheel in "$BUNDLE"/tmp/cudawhl/*.whl; do unzip -q -o "$wheel" -d "$cuda"; done
  # What importing FlashInfer takes here, for this machine's python (the bundle's are 3.12's).
  python3 -m pip install -q --no-deps --target "$BUNDLE/tmp/local" 'apache-tvm-ffi<0.2,>=0.1.11' \
    nvidia-ml-py einops tabulate cuda-tile ninja
  home="$cuda/nvidia/cu13"
  ln -sf libcudart.so.13 "$home/lib/libcudart.so" && ln -sfn lib "$home/lib64"
  # The link names -lcuda (the driver, which only the GPU machine has): an empty stub with its
  # soname; the module needs none of its symbols until it runs there.
  mkdir -p "$BUNDLE/tmp/stubs" && echo > "$BUNDLE/tmp/stubs/empty.c"
  cc -shared -Wl,-soname,libcuda.so.1 -o "$BUNDLE/tmp/stubs/libcuda.so" "$BUNDLE/tmp/stubs/empty.c"
  LIBRARY_PATH="$BUNDLE/tmp/stubs" CUDA_HOME="$home" MAX_JOBS=${MAX_JOBS:-2} \
    FLASHINFER_WORKSPACE_BASE="$ws" FLASHINFER_CUDA_ARCH_LIST=9.0a \
    PATH="$BUNDLE/tmp/local/bin:$home/bin:$PATH" PYTHONPATH="$BUNDLE/tmp/site:$BUNDLE/tmp/local:$PWD" \
    python3 bench/flashinfer_warmup.py --without-gpu
  ops=$(find "$ws" -type d -name cached_ops | head -1)
  (cd "$ops" && ls -d */*.so | tar -czf - -T -) > "$BUNDLE/kernels.tgz"
fi
rm -rf "$BUNDLE/tmp"
du -sh "$BUNDLE"/* && echo "carry $BUNDLE and run: bash bench/gpu_device_run.sh"
