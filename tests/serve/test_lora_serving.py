"""Multi-LoRA serving end to end on a tiny random Llama and a random PEFT adapter (written by
peft itself, lora_B random so the adapter changes the output):

- the worker over real gRPC: LoadLoRA / UnloadLoRA, Generate under a loaded adapter (greedy
  tokens equal transformers + peft), load-on-miss when the request carries the path, NOT_FOUND
  for an unknown adapter without one, LoRA in Stats;
- the router + OpenAI HTTP API on a prefill and a decode worker (P/D, so Prefill and Decode
  run under the adapter and its KV crosses workers): POST /v1/load_lora_adapter loads it on
  both, /v1/models lists it with parent and root, `model` selects it (greedy output equals
  peft's, differs from the base model's), unknown models are 404 model_not_found naming the
  served ones, /v1/unload_lora_adapter removes it (404 after), bad bodies are 400 naming the
  field, the admin routes need the API key when keys are set; idle workers are back at their
  full free-block count;
- the one-command server passes the adapters on (`--enable-lora`, router --lora-modules);
- a tensor-parallel (TP=2) worker loads and serves an adapter over gRPC.
"""

from __future__ import annotations

import argparse
import json
import time

import grpc
import httpx
import pytest
import torch
from helpers import hf_greedy

from kvmesh._proto import llm_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.build import build_worker
from kvmesh.config import EngineConfig, LoRAConfig
from kvmesh.router.api import Call
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry
from kvmesh.router.server import RouterServer
from kvmesh.rpc import free_port
from kvmesh.serve.loop import LoopThread
from kvmesh.serve.openai import InProcessBackend, create_app, start_http
from kvmesh.worker.server import WorkerServerConfig

PROMPT = [5, 17, 33, 61, 90, 121, 150, 199, 230, 250, 12, 40]
MAX_NEW = 6


def make_adapter(base, out, seed: int = 0):
    """A peft LoRA adapter of `base` (r=8 on q/v/o/down projections), lora_A and lora_B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16,
                                                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # peft starts lora_B at 0 (a no-op adapter): randomize it
                p.copy_(torch.empty(p.shape).normal_(0, 0.2, generator=g))
    peft_model.save_pretrained(out)
    return str(out)


def peft_greedy(base, adapter, prompt, n):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return hf_greedy(model, prompt, n)


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("lora-sql"))


@pytest.fixture(scope="module")
def adapter2(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("lora-chat"), seed=1)


@pytest.fixture(scope="module")
def reference(tiny_llama, adapter, adapter2):
    return {"base": peft_greedy(tiny_llama, None, PROMPT, MAX_NEW),
            "lora": peft_greedy(tiny_llama, adapter, PROMPT, MAX_NEW),
            "lora2": peft_greedy(tiny_llama, adapter2, PROMPT, MAX_NEW)}


@pytest.fixture(scope="module")
def stack(tiny_llama):
    """A prefill and a decode worker with LoRA on, the router (P/D for every prompt) and the
    OpenAI HTTP API on the router's loop."""
    loop = LoopThread("lora-serving-test")
    cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=4, num_blocks=128, max_model_len=128,
                                   num_threads=1, lora=LoRAConfig(max_loras=2, max_lora_rank=16))

    async def start():
        workers = []
        for role in ("prefill", "decode"):
            w = build_worker(cfg, WorkerServerConfig(role=role))
            await w.start()
            workers.append(w)
        r = RouterServer(StaticRegistry([w.address for w in workers]), workers[0].aengine.tokenizer,
                         RouterConfig(stats_interval_s=0.1, pd_threshold_tokens=0))
        await r.start(min_workers=2)
        backend = InProcessBackend(r.api, lambda: r.serving, workers[0].aengine.tokenizer, "kvmesh")
        port = free_port()
        http = await start_http(create_app(lambda: backend), "127.0.0.1", port)
        return workers, r, backend, http, f"http://127.0.0.1:{port}"

    workers, r, backend, http, url = loop.run(start(), timeout_s=300)
    try:
        yield loop, workers, r, backend, url
    finally:
        loop.run(http.stop())
        loop.run(r.stop(grace=0.5))
        for w in workers:
            loop.run(w.stop(grace=0.5))
        loop.stop()


def _greedy(**kw):
    return llm_pb2.SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, **kw)


def _assert_idle(loop, workers, timeout_s: float = 15.0):
    """Every worker back at its full free-block count (held transfers released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [loop.run(w.aengine.run_between_steps(lambda w=w: (w.aengine.engine.num_free_blocks,
                                                                     w.aengine.engine.num_usable_blocks)))
                  for w in workers]
        if all(free == usable for free, usable in counts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(free == usable for free, usable in counts), counts


def test_worker_lora_rpcs_and_load_on_miss(stack, adapter, reference):
    loop, workers, _, _, _ = stack
    w = workers[1]

    async def run():
        async with w.auth.channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            info = await stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora=llm_pb2.LoRARef(name="direct", path=adapter)),
                                       timeout=60)
            stats = await stub.Stats(worker_pb2.StatsRequest(), timeout=30)

            async def tokens(ref):
                req = llm_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_greedy(), lora=ref)
                return [t async for m in stub.Generate(req, timeout=60) for t in m.token_ids]

            loaded = await tokens(llm_pb2.LoRARef(name="direct"))
            base = await tokens(None)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await tokens(llm_pb2.LoRARef(name="never-loaded"))
            on_miss = await tokens(llm_pb2.LoRARef(name="on-miss", path=adapter))  # loaded by the request
            stats_after = await stub.Stats(worker_pb2.StatsRequest(), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora=llm_pb2.LoRARef(name="bad", path="/no/such")),
                                    timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as no_path:
                await stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora=llm_pb2.LoRARef(name="x")), timeout=60)
            unloads = [(await stub.UnloadLoRA(worker_pb2.UnloadLoRARequest(name=n), timeout=30)).unloaded
                       for n in ("direct", "on-miss", "direct")]
            return info, stats, loaded, base, unknown.value, on_miss, stats_after, bad.value, no_path.value, unloads

    info, stats, loaded, base, unknown, on_miss, stats_after, bad, no_path, unloads = loop.run(run(), timeout_s=300)
    assert info.name == "direct" and info.rank == 8 and info.key and info.path == adapter
    assert stats.lora_enabled and stats.max_loras == 2 and stats.max_lora_rank == 16
    assert [i.name for i in stats.loras] == ["direct"]
    assert loaded == reference["lora"] and base == reference["base"] and loaded != base
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "never-loaded" in unknown.details()
    assert on_miss == reference["lora"]
    assert {i.name for i in stats_after.loras} == {"direct", "on-miss"}
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert no_path.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora.path" in no_path.details()
    assert unloads == [True, True, False]
    _assert_idle(loop, workers)


def _models(url, expected_ids, timeout_s: float = 10.0):
    """/v1/models once the router's view has caught up (adapters loaded or unloaded on a
    worker directly reach it with the next Stats poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        if [m["id"] for m in models] == expected_ids or time.monotonic() > deadline:
            return models
        time.sleep(0.05)


def test_http_lora_lifecycle_through_the_router(stack, adapter, reference):
    loop, workers, r, _, url = stack
    models = _models(url, ["kvmesh"])
    assert [m["id"] for m in models] == ["kvmesh"] and models[0]["parent"] is None

    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": adapter}, timeout=120)
    assert loaded.status_code == 200, loaded.text
    body = loaded.json()
    assert body["lora_name"] == "sql" and body["rank"] == 8
    assert sorted(body["workers"]) == sorted(w.address for w in workers)  # P/D: prefill and decode both
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert models["sql"]["parent"] == "kvmesh" and models["sql"]["root"] == adapter
    assert models["sql"]["max_model_len"] == 128
    assert models["sql"]["workers"] == len(workers) and "workers" not in models["kvmesh"]

    # `model` selects the adapter: the router's P/D path runs Prefill and Decode under it.
    async def grpc_tokens(model):
        call = Call(timeout_s=60)
        req = llm_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_greedy(), model=model)
        msgs = [m async for m in r.api.generate(req, call)]
        return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), call.decision

    lora_ids, lora_text, decision = loop.run(grpc_tokens("sql"), timeout_s=120)
    base_ids, base_text, _ = loop.run(grpc_tokens(""), timeout_s=120)
    assert decision.path == "pd"
    assert lora_ids == reference["lora"] and base_ids == reference["base"] and lora_ids != base_ids
    comp = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": MAX_NEW,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)
    assert comp.status_code == 200, comp.text
    assert comp.json()["model"] == "sql" and comp.json()["choices"][0]["text"] == lora_text
    base = httpx.post(f"{url}/v1/completions", json={"model": "kvmesh", "prompt": PROMPT, "max_tokens": MAX_NEW,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)
    assert base.json()["choices"][0]["text"] == base_text

    unknown = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert unknown.status_code == 404
    err = unknown.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "`kvmesh`" in err["message"] and "`sql`" in err["message"]

    # Bad bodies name the field; a folder that is no adapter is the worker's 400.
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such"}, timeout=60)
    assert bad.status_code == 400, bad.text
    clash = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/other"}, timeout=60)
    assert clash.status_code == 400 and "already loaded" in clash.json()["error"]["message"]

    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert gone.status_code == 200, gone.text
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]] == ["kvmesh"]
    after = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=30)
    assert again.status_code == 404 and again.json()["error"]["type"] == "not_found_error"
    assert all(not w.aengine.list_loras() for w in workers)  # unloaded everywhere
    _assert_idle(loop, workers)


def test_lora_admin_routes_need_the_api_key(stack, adapter, monkeypatch):
    loop, _, _, backend, _ = stack
    monkeypatch.setenv("KVMESH_API_KEY", "secret-key")
    port = free_port()
    http = loop.run(start_http(create_app(lambda: backend), "127.0.0.1", port))
    try:
        url = f"http://127.0.0.1:{port}"
        body = {"lora_name": "keyed", "lora_path": adapter}
        for route, b in (("load_lora_adapter", body), ("unload_lora_adapter", {"lora_name": "keyed"})):
            refused = httpx.post(f"{url}/v1/{route}", json=b, timeout=30)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        headers = {"Authorization": "Bearer secret-key"}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120).status_code == 200
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "keyed"}, headers=headers,
                          timeout=60).status_code == 200
    finally:
        loop.run(http.stop())


def test_the_one_command_server_passes_the_lora_config_on(adapter):
    from kvmesh.cli.processes import add_router_parser
    from kvmesh.cli.serve import add_parser, serving_config_from_args
    from kvmesh.serve.local import router_args, worker_args

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_parser(sub)
    add_router_parser(sub)
    cfg = serving_config_from_args(parser.parse_args(["serve", "--local", "--lora-modules", f"sql={adapter}",
                                                      "--max-loras", "2"]))
    assert cfg.engine.lora.max_loras == 2 and [m.name for m in cfg.engine.lora.modules] == ["sql"]
    assert serving_config_from_args(parser.parse_args(["serve", "--enable-lora"])).engine.lora is not None
    assert serving_config_from_args(parser.parse_args(["serve"])).engine.lora is None
    worker = worker_args(cfg, "decode")
    assert EngineConfig.model_validate_json(worker[worker.index("--config-json") + 1]).lora == cfg.engine.lora
    args = router_args(cfg, ["127.0.0.1:1"], http=True)
    entries = args[args.index("--lora-modules") + 1 : args.index("--lora-modules") + 2]
    assert [json.loads(e) for e in entries] == [{"name": "sql", "path": adapter}]
    parsed = parser.parse_args(args[args.index("router") :])
    assert parsed.lora_modules == [{"name": "sql", "path": adapter}]


def test_requests_for_two_adapters_and_the_base_model_run_together(stack, adapter, adapter2, reference):
    """Concurrent requests under two adapters and the base model, through the router: each
    equals its own peft reference; a worker asked for other weights under a held name
    (the router's path changed) loads them instead of serving the old ones."""
    import asyncio

    loop, workers, r, _, _ = stack
    call = Call(timeout_s=120)
    for name, path in (("a1", adapter), ("a2", adapter2)):
        loop.run(r.api.load_lora_adapter(llm_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path), call),
                 timeout_s=120)

    async def tokens(model):
        req = llm_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_greedy(), model=model)
        return [t async for m in r.api.generate(req, Call(timeout_s=120)) for t in m.token_ids]

    async def together():
        return await asyncio.gather(*(tokens(m) for m in ("a1", "a2", "", "a1", "a2")))

    got = loop.run(together(), timeout_s=300)
    assert got == [reference["lora"], reference["lora2"], reference["base"], reference["lora"], reference["lora2"]]

    w = workers[1]

    async def replaced():
        async with w.auth.channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            req = llm_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_greedy(),
                                          lora=llm_pb2.LoRARef(name="a1", path=adapter2))
            return [t async for m in stub.Generate(req, timeout=60) for t in m.token_ids]

    assert loop.run(replaced(), timeout_s=120) == reference["lora2"]
    for name in ("a1", "a2"):
        loop.run(r.api.unload_lora_adapter(name, call), timeout_s=60)
    _assert_idle(loop, workers)


def test_a_tensor_parallel_worker_serves_adapters(tiny_llama, adapter, reference):
    """A TP=2 worker (rank 1 a child process) over real gRPC: LoadLoRA reaches both ranks,
    Generate under the adapter equals peft, a folder that is no adapter is INVALID_ARGUMENT
    and the group keeps serving, idle at its full free-block count."""
    loop = LoopThread("lora-tp-test")
    cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=4, num_blocks=64, max_model_len=128,
                                   num_threads=2, tensor_parallel_size=2,
                                   lora=LoRAConfig(max_loras=1, max_lora_rank=16))

    async def run():
        w = build_worker(cfg, WorkerServerConfig(role="unified"))
        await w.start()
        try:
            async with w.auth.channel(w.address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)

                async def tokens(ref):
                    req = llm_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_greedy(), lora=ref)
                    return [t async for m in stub.Generate(req, timeout=60) for t in m.token_ids]

                await stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora=llm_pb2.LoRARef(name="sql", path=adapter)),
                                    timeout=60)
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.LoadLoRA(worker_pb2.LoadLoRARequest(lora=llm_pb2.LoRARef(name="bad", path=str(tiny_llama))),
                                        timeout=60)
                got = await tokens(llm_pb2.LoRARef(name="sql")), await tokens(None)
                healthy = w.aengine.engine.executor.runner.health()
                return got, bad.value, healthy
        finally:
            await w.stop(grace=0.5)

    try:
        (lora_tokens, base_tokens), bad, healthy = loop.run(run(), timeout_s=300)
    finally:
        loop.stop()
    assert lora_tokens == reference["lora"] and base_tokens == reference["base"]
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json" in bad.details()
    assert healthy == (True, "")
