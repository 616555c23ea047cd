#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the llama.cpp that the llama-cpp-python sdist
# vendors, and convert SmolLM2-135M-Instruct to F32 / Q8_0 / BF16 GGUF with llama.cpp's own converter,
# for `radixserve bench peers`. Everything is cached under $RADIXSERVE_PEERS_CACHE
# (default ~/.cache/radixserve-peers): a second run only redoes what is missing.
# Never part of the test suite. About 20 minutes on 2 cores the first time.
#
#   bash bench/build_llama_server.sh            # build + convert
#   bash bench/build_llama_server.sh --print    # print the paths it produced
set -euo pipefail

VERSION=0.3.36
CACHE=${RADIXSERVE_PEERS_CACHE:-$HOME/.cache/radixserve-peers}
SRC=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$CACHE/build
SERVER=$BUILD/bin/llama-server
HF_DIR=$CACHE/smollm2-hf
GGUF_F32=$CACHE/smollm2-f32.gguf
GGUF_Q8=$CACHE/smollm2-q8_0.gguf
GGUF_BF16=$CACHE/smollm2-bf16.gguf  # the same arithmetic as `--dtype bfloat16`
JOBS=${JOBS:-2}
REPO_ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [[ "${1:-}" == "--print" ]]; then
    echo "server=$SERVER"; echo "f32=$GGUF_F32"; echo "q8_0=$GGUF_Q8"; echo "bf16=$GGUF_BF16"; exit 0
fi

mkdir -p "$CACHE"
cd "$CACHE"

# 1. Source: the sdist from the registry (llama.cpp commit 0c1e57098 under vendor/llama.cpp).
if [[ ! -f llama_cpp_python-$VERSION.tar.gz ]]; then
    pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
fi
if [[ ! -f $SRC/CMakeLists.txt ]]; then
    tar xzf "llama_cpp_python-$VERSION.tar.gz" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi

# 2. llama-server, CPU only. CURL/OpenSSL off (no network here); the web UI is neither built nor
#    fetched (LLAMA_USE_PREBUILT_UI would download it).
if [[ ! -x $SERVER ]]; then
    cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_HTML=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
    nice -n 10 cmake --build "$BUILD" --target llama-server -j "$JOBS"
fi
echo "llama-server: $SERVER"

# 3. An HF checkpoint of the same weights radixserve serves: radixserve's own GGUF loader
#    dequantises the packaged Q4_1 file to float32 and we save that with transformers. The F32
#    GGUF is therefore bit-identical to the float32 weights radixserve computes with (both are
#    the dequantised Q4_1 values), not the original bf16 release.
if [[ ! -f $HF_DIR/config.json ]]; then
    PYTHONPATH=$REPO_ROOT nice -n 10 python "$REPO_ROOT/bench/export_hf_checkpoint.py" \
        --model smollm2 --out "$HF_DIR"
fi

# 4. llama.cpp's converter, with the gguf-py it ships (not the installed gguf package). Its
#    Llama vocab step imports sentencepiece before falling back to tokenizer.json.
python -c "import sentencepiece" 2>/dev/null || pip install sentencepiece
for pair in "f32:$GGUF_F32" "q8_0:$GGUF_Q8" "bf16:$GGUF_BF16"; do
    outtype=${pair%%:*}; out=${pair#*:}
    if [[ ! -f $out ]]; then
        PYTHONPATH=$SRC/gguf-py nice -n 10 python "$SRC/convert_hf_to_gguf.py" "$HF_DIR" \
            --outtype "$outtype" --outfile "$out"
    fi
    echo "gguf $outtype: $out"
done
