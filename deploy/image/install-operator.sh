#!/usr/bin/env bash
# Install the operator (kvmesh_operator and the torch-free kvmesh config modules it imports)
# from the source tree in the current folder into $PYTHON's environment: the `operator`
# extra's packages, then kvmesh itself with --no-deps (its own dependencies are the data
# plane's: torch, Ray, transformers). tests/deploy/test_dockerfile_steps.py runs this
# script as deploy/Dockerfile.operator does.
set -euo pipefail
PY=${PYTHON:-python}
mapfile -t requirements < <($PY -c 'import sys, tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["operator"]))')
$PY -m pip install --quiet "${requirements[@]}"
$PY -m pip install --quiet --no-deps .
$PY -c 'import kvmesh_operator.handlers, sys; assert "torch" not in sys.modules; print("kvmesh-operator ready")'
