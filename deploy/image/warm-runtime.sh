#!/usr/bin/env bash
# Bake the caches into the image: the embedded model converted into $KVMESH_CACHE_DIR and the
# native CPU kernels compiled into $TORCH_EXTENSIONS_DIR (KVMESH_CPU_MARCH=portable: one build
# per ISA tier, each runs on any CPU of its tier). KERNEL_ISAS (space-separated: avx512 avx2)
# picks the tiers; empty: every tier the build machine runs.
set -euo pipefail
: "${KVMESH_CACHE_DIR:?set KVMESH_CACHE_DIR}" "${TORCH_EXTENSIONS_DIR:?set TORCH_EXTENSIONS_DIR}"
args=()
for tier in ${KERNEL_ISAS:-}; do args+=(--isa "$tier"); done
kvmesh warm "${args[@]}"
