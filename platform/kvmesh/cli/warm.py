"""`kvmesh warm`: fill the caches a first request would otherwise fill: convert packaged models
(into $KVMESH_CACHE_DIR) and build the native CPU kernels (into $TORCH_EXTENSIONS_DIR).

The runtime image runs it at build time (deploy/image/warm-runtime.sh), so a pod starts from a
converted model and compiled kernels; with KVMESH_CPU_MARCH=portable the kernels it bakes run
on any CPU of their ISA tier, not only on the build machine's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from kvmesh.checkpoint.packaged import find_packaged
from kvmesh.errors import KVMeshError
from kvmesh.layers import native

_PREBUILD = "import sys; from kvmesh.layers import native; print(native.prebuild(sys.argv[1]))"


def add_parser(sub) -> None:
    p = sub.add_parser("warm", help="convert packaged models and build the native CPU kernels into the caches "
                       "(image builds, init containers)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="packaged model to convert (repeatable; default: the embedded model; `kvmesh models` "
                   "lists them)")
    p.add_argument("--isa", action="append", choices=native.TIERS,
                   help="kernel tier to build (repeatable). Default: KVMESH_CPU_MARCH=portable, every tier this "
                   "CPU runs but generic; otherwise this CPU's own")
    p.add_argument("--no-kernels", action="store_true", help="convert models only")
    p.set_defaults(func=cmd_warm)


def _default_tiers() -> list[str]:
    if native.march() != "portable":
        return [native.isa("native")]
    return [t for t in native.runnable_tiers() if t != "generic"] or ["generic"]


def build_kernels(tiers: list[str]) -> list[str]:
    """Each tier's kernels, built in a process of its own (a process holds one build): their paths."""
    paths = []
    for tier in tiers:
        done = subprocess.run([sys.executable, "-c", _PREBUILD, tier], capture_output=True, text=True)
        if done.returncode != 0:
            raise KVMeshError(f"kernels {tier}: the build failed:\n{done.stderr[-4000:]}")
        paths.append(done.stdout.strip().splitlines()[-1])
    return paths


def cmd_warm(args: argparse.Namespace) -> int:
    # Every argument is checked before the first (minutes-long) step.
    models = [(name, find_packaged(name)) for name in args.model or ["embedded"]]
    for name, model in models:
        if model is None:
            raise KVMeshError(f"--model {name!r}: not a packaged model; `kvmesh models` lists them")
    tiers = [] if args.no_kernels else args.isa or _default_tiers()
    for tier in tiers:
        if tier not in native.runnable_tiers():
            raise KVMeshError(f"--isa {tier}: this CPU runs {', '.join(native.runnable_tiers())}; build the "
                              f"{tier} kernels on a CPU that runs them (CPUs of a wider tier load a narrower build)")
    for _, model in models:
        print(f"model {model.name}: {model.resolve(progress=False)}", flush=True)
    for tier, path in zip(tiers, build_kernels(tiers)):
        print(f"kernels {tier} ({native.march()}): {path}", flush=True)
    return 0
