"""`kvmesh serve [MODEL]`: the typed ServingConfig (defaults, --config FILE, then flags)
deployed on Ray Serve, or with --local as plain processes on this machine. vLLM's
spellings (MODEL, --served-model-name, --api-key, --ssl-*, --gpu-memory-utilization,
--speculative-config) mean what they mean there (cli/vllm_args.py); --port stays the gRPC
port, with a note to whoever expected vLLM's HTTP port."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time

from kvmesh.cli.args import add_chat_args, add_engine_args, add_tls_args, chat_overrides, engine_config
from kvmesh.cli.vllm_args import add_serve_aliases, apply_api_key, merged_model, served_model_name
from kvmesh.rpc.internal_auth import TOKEN_ENV, TOKEN_FILE_ENV
from kvmesh.serve.config import ServingConfig
from kvmesh.serve.local import serve_local


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve gRPC (kvmesh.v1.LLM) and OpenAI-compatible HTTP on Ray Serve")
    s.add_argument("--config", default=None, help="serving config YAML (kvmesh.serve.config.ServingConfig)")
    s.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. auto, ray://head:10001); default: start a local Ray instance")
    s.add_argument("--detach", action="store_true",
                   help="deploy or update the app on --address and exit (e.g. to change replica counts)")
    s.add_argument("--redis-url", default=None, help="shared KV store redis://host:port/db (default: none, each "
                   "worker's own prefix cache; --kv-store memory adds a private in-process tier)")
    s.add_argument("--prefill-replicas", type=int, default=None,
                   help="prefill replicas; > 0 means disaggregated prefill/decode (default: from config, 0; "
                        "--local: 1)")
    s.add_argument("--decode-replicas", type=int, default=None, help="decode (or unified) replicas")
    s.add_argument("--local", action="store_true",
                   help="no Ray: router and worker replicas as processes on this machine (default: one prefill "
                        "and one decode worker)")
    s.add_argument("--host", default=None, help="listen address of the gRPC and HTTP endpoints (default 127.0.0.1, "
                   "this machine only; 0.0.0.0: every interface, vLLM's default)")
    s.add_argument("--port", type=int, default=None, help="gRPC port (default 50051); the OpenAI HTTP API is on "
                   "--http-port")
    s.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (default 8000; --local: "
                   "off unless set)")
    s.add_argument("--pd-threshold-tokens", type=int, default=None,
                   help="prompts with fewer uncached tokens skip prefill/decode disaggregation (default 256)")
    s.add_argument("--transfer-ttl", type=float, default=None, help="seconds prefilled KV waits for its decode")
    s.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry traces (OTLP/gRPC); default off")
    add_tls_args(s)
    s.add_argument("--internal-token-file", default=None,
                   help="file with the token every worker RPC must carry (default: KVMESH_INTERNAL_TOKEN; "
                        "--local makes one up per run)")
    add_serve_aliases(s)
    add_engine_args(s)
    add_chat_args(s)
    s.set_defaults(func=cmd_serve)


def serving_config_from_args(args: argparse.Namespace) -> ServingConfig:
    """`kvmesh serve` flags (+ --config FILE) -> ServingConfig."""
    cfg = ServingConfig.from_yaml(args.config) if args.config else ServingConfig()
    merged_model(args)
    data = cfg.model_dump()
    # The engine flags on top of the file's engine (speculative and LoRA merged, --enable-lora included).
    data["engine"] = engine_config(args, cfg.engine).model_dump()
    for flag, key in (("host", "host"), ("port", "grpc_port"), ("http_port", "http_port"),
                      ("transfer_ttl", "transfer_ttl_s")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    name = served_model_name(args)
    if name is not None:
        data["model_id"] = name
    if args.redis_url:
        data["kv_store"]["redis_url"] = args.redis_url
    prefill = args.prefill_replicas
    if prefill is None and args.local and not args.config:
        prefill = 1  # --local's default shape: one prefill and one decode worker
    if prefill is not None:
        data["prefill"] = None if prefill == 0 else {**(data["prefill"] or {}), "replicas": prefill}
    if args.decode_replicas is not None:
        data["decode"] = {**data["decode"], "replicas": args.decode_replicas, "autoscaling": None}
    if args.pd_threshold_tokens is not None:
        data["router"]["config"]["pd_threshold_tokens"] = args.pd_threshold_tokens
    if args.otlp_endpoint:
        data["tracing"]["otlp_endpoint"] = args.otlp_endpoint
    for flag, key in (("tls_cert", "tls_cert_file"), ("tls_key", "tls_key_file"),
                      ("tls_client_ca", "tls_client_ca_file"), ("internal_token_file", "internal_token_file")):
        if getattr(args, flag, None):
            data["security"][key] = getattr(args, flag)
    data["chat"].update(chat_overrides(args))
    return ServingConfig.model_validate(data)


def local_internal_token(cfg: ServingConfig) -> None:
    """--local: the worker processes inherit the internal token from this environment; with
    none configured, one made up for this run (worker ports then refuse every outsider)."""
    if cfg.security.internal_token_file and not os.environ.get(TOKEN_ENV):
        os.environ[TOKEN_FILE_ENV] = cfg.security.internal_token_file
    elif not os.environ.get(TOKEN_ENV) and not os.environ.get(TOKEN_FILE_ENV):
        os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)


def port_notes(args: argparse.Namespace) -> list[str]:
    """What a vLLM user would not expect of the ports (--port is gRPC here)."""
    http = "off: add --http-port PORT" if args.local else "8000"
    notes = []
    if args.port is not None and args.http_port is None:
        notes.append(f"--port {args.port} is kvmesh's gRPC port (kvmesh.v1.LLM); the OpenAI HTTP API is on "
                     f"--http-port ({http})")
    elif args.local and args.http_port is None:
        notes.append("--local serves the OpenAI HTTP API only with --http-port PORT")
    return notes


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serving_config_from_args(args)
    apply_api_key(args, remote=bool(args.address))
    for note in port_notes(args):
        print(f"kvmesh: note: {note}", file=sys.stderr, flush=True)
    if args.local:
        local_internal_token(cfg)
        return serve_local(cfg, http=args.http_port is not None)
    # Ray is the one heavy optional import of the CLI: `generate`, `worker` and `--local` never load it.
    from kvmesh.serve import app as ray_app

    started = ray_app.start_ray(args.address, cfg)
    mode = "disaggregated (prefill + decode)" if cfg.disaggregated else "unified"
    print(f"kvmesh: deploying {cfg.name!r} ({mode}) on Ray; first start loads the model...", flush=True)
    try:
        ray_app.deploy(cfg)
    except BaseException:
        if started:
            ray_app.shutdown(cfg, stop_ray=True)
        raise
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else cfg.host
    print(f"kvmesh: gRPC (kvmesh.v1.LLM) at {host}:{cfg.grpc_port}", flush=True)
    print(f"kvmesh: OpenAI-compatible HTTP at http://{host}:{cfg.http_port}/v1", flush=True)
    print(f"KVMESH_SERVE_READY grpc={host}:{cfg.grpc_port} http=http://{host}:{cfg.http_port}", flush=True)
    if args.detach:
        print("kvmesh: deployed; --detach leaves it running on the Ray cluster", flush=True)
        return 0
    # A plain list, not a threading.Event: Event.set() in a signal handler can deadlock
    # on the lock that Event.wait() holds in the same (main) thread.
    signals: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: signals.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    print("kvmesh: Ctrl-C to stop", flush=True)
    try:
        while not signals:
            time.sleep(0.2)
    finally:
        print("kvmesh: shutting down", flush=True)
        ray_app.shutdown(cfg, stop_ray=started)
        for s, h in previous.items():
            signal.signal(s, h)
    return 0
