"""A real kvmesh server in this process for `bench serve`: one unified worker on the tiny
random model (plus a chat template) behind a router (gRPC) and the OpenAI HTTP API, on
one event loop, as `kvmesh router --http-port` runs them (the stack of
tests/serve/test_openai_fields.py)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmesh.build import build_worker
from kvmesh.cli.processes import serve_router_http
from kvmesh.config import EngineConfig
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry
from kvmesh.router.server import RouterServer
from kvmesh.serve.loop import LoopThread
from kvmesh.worker.server import WorkerServerConfig


@dataclass
class Stack:
    http: str  # base URL of the OpenAI API
    grpc: str  # host:port of the router's LLM service
    tokenizer: object
    worker: object
    model: Path


TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="session")
def bench_model(tiny_llama, tmp_path_factory) -> Path:
    """The tiny model with a chat template (its tokenizer has none), for openai-chat."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-bench")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def server(bench_model):
    loop = LoopThread("bench-test")
    started = []

    async def start() -> Stack:
        worker = build_worker(EngineConfig.from_kwargs(model=str(bench_model), block_size=4, num_blocks=512,
                                                       max_model_len=256, num_threads=1), WorkerServerConfig())
        await worker.start()
        started.append(worker)
        tok = worker.aengine.tokenizer
        router = RouterServer(StaticRegistry([worker.address]), tok, RouterConfig(stats_interval_s=0.2))
        await router.start(min_workers=1)
        started.append(router)
        http = await serve_router_http(router, tok, "kvmesh", "127.0.0.1", 0)
        started.append(http)
        return Stack(f"http://127.0.0.1:{http.port}", router.address, tok, worker, bench_model)

    try:
        yield loop.run(start(), timeout_s=120)
    finally:
        async def stop():
            for s in reversed(started):
                await (s.stop() if hasattr(s, "should_exit") else s.stop(grace=0.5))

        try:
            loop.run(stop(), timeout_s=60)
        finally:
            loop.stop()
