"""`kvmesh worker` and `kvmesh router`: one gRPC worker or router as an OS process (what
`kvmesh serve --local` launches, and what tests and benchmarks start).

A worker takes its whole EngineConfig as JSON (`--config-json`, as the local launcher
passes it) and/or engine flags on top; the router takes its RouterConfig the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

from kvmesh.build import build_worker
from kvmesh.chat.config import ChatConfig
from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path
from kvmesh.cli.args import add_chat_args, add_engine_args, add_tls_args, chat_overrides, engine_config, lora_module_arg
from kvmesh.cli.vllm_args import apply_api_key
from kvmesh.config import EngineConfig, TracingConfig
from kvmesh.router.config import RouterConfig
from kvmesh.router.ext_proc import BUFFERED, FULL_DUPLEX, EndpointPickerServer
from kvmesh.router.picker import EndpointPicker
from kvmesh.router.registry import DnsRegistry, StaticRegistry, WorkerPool
from kvmesh.router.server import RouterServer
from kvmesh.rpc import run_until_signalled
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.rpc.tls import TLSFiles
from kvmesh.serve.openai import HTTPServer, InProcessBackend, create_app, start_http
from kvmesh.telemetry.metrics import exposition
from kvmesh.telemetry.tracing import configure_tracing
from kvmesh.worker.server import WorkerServerConfig


def _log_setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


# -- worker ---------------------------------------------------------------------------------


def add_worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run one gRPC worker (kvmesh.v1.Worker) in this process")
    p.add_argument("--role", default="unified", choices=["prefill", "decode", "unified"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    p.add_argument("--model-id", "--served-model-name", dest="model_id", default="kvmesh",
                   help="the served model's name (default kvmesh)")
    p.add_argument("--transfer-ttl", type=float, default=30.0, help="seconds prefilled KV waits for a pull")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0 = off)")
    p.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans here (OTLP/gRPC; default off)")
    p.add_argument("--config-json", default=None,
                   help="the whole EngineConfig as JSON (engine flags given too override it)")
    add_engine_args(p)
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    _log_setup()
    base = EngineConfig.model_validate_json(args.config_json) if args.config_json else None
    config = WorkerServerConfig(role=args.role, host=args.host, port=args.port, model_id=args.model_id,
                                transfer_ttl_s=args.transfer_ttl, metrics_port=args.metrics_port)
    if args.otlp_endpoint:
        configure_tracing(TracingConfig(otlp_endpoint=args.otlp_endpoint, service_name=f"kvmesh-{args.role}"))
    engine_cfg = engine_config(args, base)

    async def run() -> None:
        # gRPC aio servers belong to the loop they are created on: build inside it.
        server = build_worker(engine_cfg, config)

        async def start() -> None:
            await server.start()
            # One parseable line: launchers and tests wait for it.
            print(f"KVMESH_WORKER_READY role={config.role} address={server.address}", flush=True)

        await run_until_signalled(start, server.stop)

    asyncio.run(run())
    return 0


# -- router ---------------------------------------------------------------------------------


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="run the gRPC router (kvmesh.v1.LLM) over static worker addresses")
    p.add_argument("--worker", action="append", required=True, help="worker address HOST:PORT (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    p.add_argument("--model", default=None, help="checkpoint folder, for the tokenizer (default: embedded model)")
    p.add_argument("--model-id", "--served-model-name", dest="model_id", default="kvmesh",
                   help="the served model's name: /v1/models lists it, requests' `model` must match (default kvmesh)")
    p.add_argument("--config", default=None, help="RouterConfig as a JSON file")
    p.add_argument("--config-json", default=None, help="RouterConfig as JSON")
    p.add_argument("--pd-threshold-tokens", type=int, default=None, help="overrides the config's value")
    p.add_argument("--picker", default=None, help="overrides the config's picker (e.g. round_robin)")
    p.add_argument("--min-workers", type=int, default=None, help="workers to wait for (default: all)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics (router + every worker's stats) on this port (0 = off)")
    p.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans here (OTLP/gRPC; default off)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (default: off)")
    add_tls_args(p)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* and the gRPC API (sets KVMESH_API_KEY here)")
    p.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=[], metavar="NAME=PATH",
                   help="LoRA adapters served from start-up (the workers' --lora-modules), each as name=path or "
                        'JSON {"name": ..., "path": ...}; more load at run time (POST /v1/load_lora_adapter)')
    add_chat_args(p)
    p.set_defaults(func=cmd_router)


def router_tls(args: argparse.Namespace) -> TLSFiles | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        if args.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    return TLSFiles(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca)


async def serve_router_http(router: RouterServer, tokenizer, model_id: str, host: str, port: int,
                            chat: ChatConfig | None = None) -> HTTPServer:
    """The OpenAI-compatible HTTP API in this process, on the router's event loop and calling
    its API in-process (served over TLS with the router's certificate when it has one)."""
    backend = InProcessBackend(router.api, lambda: router.serving, tokenizer, model_id)
    tls = router.tls
    files = {} if tls is None else {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file,
                                    "ssl_ca_certs": tls.client_ca_file}
    return await start_http(create_app(lambda: backend, exposition, chat_config=chat), host, port, **files)


def cmd_router(args: argparse.Namespace) -> int:
    _log_setup()
    apply_api_key(args)
    raw = {}
    if args.config:
        with open(args.config) as f:
            raw = json.load(f)
    if args.config_json:
        raw = json.loads(args.config_json)
    if args.pd_threshold_tokens is not None:
        raw["pd_threshold_tokens"] = args.pd_threshold_tokens
    if args.picker is not None:
        raw["picker"] = args.picker
    config = RouterConfig(**raw)
    if args.otlp_endpoint:
        configure_tracing(TracingConfig(otlp_endpoint=args.otlp_endpoint, service_name="kvmesh-router"))
    tokenizer = load_tokenizer(resolve_model_path(args.model, progress=False))
    tls = router_tls(args)
    chat = ChatConfig(**chat_overrides(args))
    adapters = [(m["name"], m["path"]) for m in args.lora_modules]

    async def run() -> None:
        router = RouterServer(StaticRegistry(args.worker), tokenizer, config, args.model_id, args.host, args.port,
                              metrics_port=args.metrics_port, tls=tls, adapters=adapters)
        http = None

        async def start() -> None:
            nonlocal http
            await router.start(min_workers=args.min_workers or len(args.worker))
            if args.http_port is not None:
                http = await serve_router_http(router, tokenizer, args.model_id, args.host, args.http_port, chat)
                scheme = "https" if tls is not None else "http"
                print(f"KVMESH_ROUTER_HTTP url={scheme}://{args.host}:{http.port}", flush=True)
            print(f"KVMESH_ROUTER_READY address={router.address}", flush=True)

        async def stop() -> None:
            if http is not None:
                await http.stop()
            await router.stop()

        await run_until_signalled(start, stop)

    asyncio.run(run())
    return 0


# -- endpoint picker --------------------------------------------------------------------------


def add_epp_parser(sub) -> None:
    p = sub.add_parser("epp", help="run the router's placement as a Gateway API Inference Extension endpoint "
                                   "picker (Envoy ext_proc) for an InferencePool of kvmesh pods")
    p.add_argument("--worker", action="append", default=[], help="worker gRPC address HOST:PORT (repeatable)")
    p.add_argument("--worker-dns", default=None, metavar="NAME",
                   help="DNS name listing the workers (a headless Service), with --worker-port")
    p.add_argument("--worker-port", type=int, default=50061, help="the workers' gRPC port (with --worker-dns)")
    p.add_argument("--target-port", type=int, default=None,
                   help="the pool's targetPort: the OpenAI HTTP port on each worker's pod (default: the worker's "
                        "own port)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9002, help="ext_proc gRPC port (GIE's default 9002)")
    p.add_argument("--model", default=None, help="checkpoint folder, for the tokenizer (default: embedded model)")
    p.add_argument("--model-id", "--served-model-name", dest="model_id", default="kvmesh",
                   help="the served model's name (requests' `model` must be it or a served LoRA adapter)")
    p.add_argument("--config-json", default=None, help="RouterConfig as JSON (filters, scorers, picker)")
    p.add_argument("--body-mode", choices=["buffered", "full-duplex"], default="full-duplex",
                   help="ext_proc request body mode when Envoy does not say (protocol_config)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0 = off)")
    p.add_argument("--min-workers", type=int, default=1, help="workers to wait for before serving")
    p.add_argument("--lora-modules", nargs="+", type=lora_module_arg, default=[], metavar="NAME=PATH",
                   help="LoRA adapters requests may name (as the pods' routers serve them)")
    p.set_defaults(func=cmd_epp)


def cmd_epp(args: argparse.Namespace) -> int:
    _log_setup()
    if bool(args.worker) == bool(args.worker_dns):
        raise ValueError("give the workers with --worker HOST:PORT (repeatable) or --worker-dns NAME, one of them")
    registry = StaticRegistry(args.worker) if args.worker else DnsRegistry(args.worker_dns, args.worker_port)
    config = RouterConfig(**(json.loads(args.config_json) if args.config_json else {}))
    tokenizer = load_tokenizer(resolve_model_path(args.model, progress=False))
    adapters = [(m["name"], m["path"]) for m in args.lora_modules]

    async def run() -> None:
        pool = WorkerPool(registry, config.affinity_capacity, config.max_block_hashes, config.stats_timeout_s,
                          config.unhealthy_cooldown_s, kv_events=config.kv_events, auth=InternalAuth.load())
        picker = EndpointPicker(pool, config, tokenizer, args.model_id, args.target_port, adapters)
        server = EndpointPickerServer(pool, picker, args.host, args.port, args.metrics_port,
                                      FULL_DUPLEX if args.body_mode == "full-duplex" else BUFFERED,
                                      config.stats_interval_s)

        async def start() -> None:
            await server.start(wait_workers_s=600, min_workers=args.min_workers)
            print(f"KVMESH_EPP_READY address={server.address}", flush=True)

        await run_until_signalled(start, server.stop)

    asyncio.run(run())
    return 0
