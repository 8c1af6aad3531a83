#!/usr/bin/env bash
# Install llama.cpp's Python bindings (PyPI `llama-cpp-python`) into a venv of its own, as the
# batch-1 decode peer of benchmarks/engine_throughput.py. pip compiles llama.cpp from the sdist
# for the CPU it runs on (-DGGML_NATIVE=ON: AVX2 / AVX-512 as present): a few minutes on 2 cores.
# The extracted sdist stays in VENV/src: its vendor/llama.cpp/convert_hf_to_gguf.py turns kvmesh's
# float32 HF folder into an F32 GGUF for the f32 comparison; the benchmark runs that script with
# kvmesh's own interpreter (it has torch and transformers; the script brings its own gguf-py).
# Usage: scripts/install_llamacpp.sh [VENV]     (default /tmp/llamacpp-venv)
set -euo pipefail
VENV=${1:-/tmp/llamacpp-venv}
VERSION=${LLAMACPP_VERSION:-0.3.36}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
mkdir -p "$VENV/src"
"$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$VENV/src" "llama-cpp-python==$VERSION"
SDIST=$(ls "$VENV"/src/llama_cpp_python-"$VERSION".tar.gz)
tar -xzf "$SDIST" -C "$VENV/src"
SRC="$VENV/src/llama_cpp_python-$VERSION"
# Native ISA, CPU only, no OpenMP surprises: the runner sets n_threads itself.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_CURL=OFF}" \
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$VENV/bin/pip" install -q "$SRC"
# convert_hf_to_gguf.py imports sentencepiece even for BPE tokenizers; kvmesh's interpreter lacks
# it, so it goes into a folder of its own that the benchmark puts on PYTHONPATH for the conversion.
"$VENV/bin/pip" install -q --no-deps --target "$VENV/convert-extras" sentencepiece
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed in $VENV')"
echo "convert script: $SRC/vendor/llama.cpp/convert_hf_to_gguf.py"
