#!/usr/bin/env bash
# Regenerate the gRPC stubs in platform/kvmesh/_proto/ from protos/kvmesh/v1/*.proto.
#
#   scripts/gen_protos.sh            # write into platform/kvmesh/_proto/
#   scripts/gen_protos.sh OUT_DIR    # write elsewhere (the staleness test compares)
#
# Uses grpc_tools.protoc (pip package grpcio-tools, in the `test` extra). protoc emits
# absolute imports (`from kvmesh.v1 import llm_pb2`) for a `kvmesh/v1/` folder; the
# stubs live flat in the `kvmesh._proto` package instead, so those imports are
# rewritten to package-relative ones.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-platform/kvmesh/_proto}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
$PY -m grpc_tools.protoc -I protos \
    --python_out="$TMP" --grpc_python_out="$TMP" --pyi_out="$TMP" \
    protos/kvmesh/v1/llm.proto protos/kvmesh/v1/worker.proto protos/kvmesh/v1/ext_proc.proto
mkdir -p "$OUT"
for f in "$TMP"/kvmesh/v1/*.py "$TMP"/kvmesh/v1/*.pyi; do
    sed -E 's/^from kvmesh\.v1 import /from . import /' "$f" > "$OUT/$(basename "$f")"
done
if [ ! -f "$OUT/__init__.py" ]; then
    cat > "$OUT/__init__.py" <<'PYEOF'
"""Generated gRPC stubs for protos/kvmesh/v1 (do not edit; run scripts/gen_protos.sh)."""
PYEOF
fi
echo "stubs written to $OUT"
