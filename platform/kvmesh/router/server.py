"""Router process: `python -m kvmesh.router --worker HOST:PORT ... [--config FILE.json]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import grpc

from kvmesh._proto import llm_pb2_grpc
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry, WorkerPool, WorkerRegistry
from kvmesh.router.service import SERVICE_NAME, LLMServicer
from kvmesh.serve.protocol import CHANNEL_OPTIONS, add_health_and_reflection, run_until_signalled, set_serving

logger = logging.getLogger(__name__)


class RouterServer:
    """A started router: the LLM service, health, reflection and the Stats poller."""

    def __init__(self, registry: WorkerRegistry, tokenizer, config: RouterConfig | None = None,
                 model_id: str = "kvmesh", host: str = "127.0.0.1", port: int = 0):
        self.config = config = config or RouterConfig()
        self.pool = WorkerPool(registry, config.affinity_capacity, config.max_block_hashes,
                               config.stats_timeout_s, config.unhealthy_cooldown_s)
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not listen on {host}:{port}; pick another --port")
        self.address = f"{host}:{self.port}"
        self.servicer = LLMServicer(self.pool, config, tokenizer, model_id)
        llm_pb2_grpc.add_LLMServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self._poller: asyncio.Task | None = None

    async def start(self, wait_workers_s: float = 60.0, min_workers: int = 1) -> None:
        await self.pool.wait_ready(wait_workers_s, min_workers)
        self._poller = asyncio.create_task(self.pool.poll_forever(self.config.stats_interval_s))
        await self.server.start()
        await set_serving(self.health, [SERVICE_NAME], True)

    async def stop(self, grace: float = 2.0) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        if self._poller is not None:
            self._poller.cancel()
        await self.server.stop(grace)
        await self.pool.close()


def load_router_tokenizer(model: str | None):
    from kvmesh.models.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model, progress=False))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.router", description="kvmesh gRPC router")
    p.add_argument("--worker", action="append", required=True, help="worker address HOST:PORT (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    p.add_argument("--model", default=None, help="checkpoint folder, for the tokenizer (default: embedded model)")
    p.add_argument("--model-id", default="kvmesh")
    p.add_argument("--config", default=None, help="RouterConfig as a JSON file")
    p.add_argument("--pd-threshold-tokens", type=int, default=None, help="overrides the config's value")
    p.add_argument("--picker", default=None, help="overrides the config's picker (e.g. round_robin)")
    p.add_argument("--min-workers", type=int, default=None, help="workers to wait for (default: all)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raw = json.loads(open(args.config).read()) if args.config else {}
    if args.pd_threshold_tokens is not None:
        raw["pd_threshold_tokens"] = args.pd_threshold_tokens
    if args.picker is not None:
        raw["picker"] = args.picker
    config = RouterConfig(**raw)
    tokenizer = load_router_tokenizer(args.model)

    async def run() -> None:
        router = RouterServer(StaticRegistry(args.worker), tokenizer, config, args.model_id, args.host, args.port)

        async def start() -> None:
            await router.start(min_workers=args.min_workers or len(args.worker))
            print(f"KVMESH_ROUTER_READY address={router.address}", flush=True)

        await run_until_signalled(start, router.stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
