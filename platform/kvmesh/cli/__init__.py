"""The `kvmesh` command: generate, serve (Ray or --local), worker, router, quantize, optimize, sim,
models, warm, bench.

Subcommands live one per module; engine flags are generated from EngineConfig
(cli/args.py), so every engine option is reachable from every subcommand that runs an
engine.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvmesh.cli import bench, generate, models, processes, serve, sim, warm
from kvmesh.errors import KVMeshError
from kvmesh.optimize.cli import add_optimize_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh LLM engine and serving platform")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    serve.add_parser(sub)
    processes.add_worker_parser(sub)
    processes.add_router_parser(sub)
    processes.add_epp_parser(sub)
    generate.add_quantize_parser(sub)
    add_optimize_parser(sub)
    sim.add_parser(sub)
    models.add_parser(sub)
    warm.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (KVMeshError, ValueError) as exc:
        print(f"kvmesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
