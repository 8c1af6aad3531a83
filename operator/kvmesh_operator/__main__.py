"""`kvmesh-operator`: run the LLMService operator (kopf, standalone: one replica, no peering)."""

from __future__ import annotations

import argparse
import os

import kopf

import kvmesh_operator.handlers  # noqa: F401  (registers the kopf handlers)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh-operator", description=__doc__)
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="Namespace to watch (repeatable). Default: $KVMESH_WATCH_NAMESPACES (comma-separated).")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="Watch every namespace.")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint URL.")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 = off).")
    p.add_argument("--verbose", "-v", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    namespaces = args.namespace or [n for n in os.environ.get("KVMESH_WATCH_NAMESPACES", "").split(",") if n]
    if not namespaces and not args.all_namespaces:
        _parser().error("give --namespace NS (repeatable) or --all-namespaces")
    if namespaces and args.all_namespaces:
        _parser().error("--namespace and --all-namespaces exclude each other")
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port)
    kopf.configure(verbose=args.verbose)
    kopf.run(standalone=True, clusterwide=args.all_namespaces, namespaces=namespaces,
             liveness_endpoint=args.liveness)


if __name__ == "__main__":
    main()
