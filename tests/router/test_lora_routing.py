"""LoRA routing (router/lora.py, the lora filter and lora_affinity scorer): requests go to a
worker holding their adapter; an adapter no worker holds is loaded by one worker (the best by
the usual scores, with the path in the request: load-on-miss); LoadLoRAAdapter loads on one
worker and registers; UnloadLoRAAdapter unloads everywhere; sync_adapters makes the registry
equal to a list. The workers are fakes speaking the real Worker gRPC service on loopback, so
what crosses the wire (LoRARef name and path, LoadLoRA / UnloadLoRA calls) is asserted."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from tiny_models import build_tokenizer

from kvmesh._proto import llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.engine.hashing import block_hashes
from kvmesh.errors import InvalidRequestError, NotFoundError
from kvmesh.router import lora as router_lora
from kvmesh.router.api import Call
from kvmesh.router.config import RouterConfig
from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.router.registry import StaticRegistry, WorkerHandle
from kvmesh.router.server import RouterServer
from kvmesh.rpc import abort_with
from kvmesh.serve.loop import LoopThread

FP, BS = "fp", 4


# -- the plugins alone ----------------------------------------------------------------


def handle(addr, lora_enabled=True, loras=(), waiting=0):
    w = WorkerHandle(addr, affinity_capacity=1000)
    w.update(worker_pb2.StatsResponse(role="unified", address=addr, model_fingerprint=FP, block_size=BS,
                                      num_free_blocks=100, num_usable_blocks=100, num_waiting=waiting,
                                      lora_enabled=lora_enabled, max_loras=4, max_lora_rank=16, loras=list(loras)))
    return w


def lreq(lora, ids=(5, 6, 7, 8, 9, 10, 11, 12)):
    ids = list(ids)
    return RouteRequest("r", ids, block_hashes(ids, BS, FP), BS, lora=lora)


def test_lora_affinity_picks_the_worker_holding_the_adapter():
    sched = WorkerScheduler.from_config(RouterConfig())
    plain, holder = handle("a:1"), handle("b:1", loras=[worker_pb2.LoRAInfo(name="sql", path="/x", rank=8)])
    assert all(sched.pick(lreq("sql"), [plain, holder]) is holder for _ in range(4))
    # Resident on the device beats host memory only.
    resident = handle("c:1", loras=[worker_pb2.LoRAInfo(name="sql", path="/x", rank=8, resident=True)])
    assert all(sched.pick(lreq("sql"), [holder, resident]) is resident for _ in range(4))
    # Base-model requests ignore adapters: equal workers still share the load.
    assert {sched.pick(lreq(None), [plain, holder]).address for _ in range(2)} == {"a:1", "b:1"}


def test_lora_filter_skips_workers_without_lora_and_routing_notes_the_adapter():
    sched = WorkerScheduler.from_config(RouterConfig())
    off, on = handle("a:1", lora_enabled=False), handle("b:1")
    assert all(sched.pick(lreq("sql"), [off, on]) is on for _ in range(3))
    assert sched.pick(lreq("sql"), [off]) is off  # none serves adapters: the worker's refusal says why
    on.note_lora("sql")  # sent there: held (until Stats say otherwise, after the TTL)
    assert on.lora_level("sql") == 0.75 and off.lora_level("sql") == 0.0
    on.forget_lora("sql")
    assert on.lora_level("sql") == 0.0


# -- fake workers over real gRPC ------------------------------------------------------------


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Stats, Generate and LoadLoRA / UnloadLoRA as a LoRA worker answers them."""

    def __init__(self, lora_enabled: bool = True):
        self.lora_enabled = lora_enabled
        self.held: dict[str, str] = {}  # name -> path
        self.loads: list[tuple[str, str]] = []
        self.unloads: list[str] = []
        self.generates: list[tuple[str, str]] = []  # (lora name, path) of each Generate
        self.busy_unloads = 0  # refuse this many UnloadLoRA calls (requests still running)
        self.address = ""

    async def Stats(self, request, context):
        return worker_pb2.StatsResponse(
            role="unified", address=self.address, model_fingerprint=FP, block_size=BS, max_model_len=256,
            num_free_blocks=100, num_usable_blocks=100, lora_enabled=self.lora_enabled, max_loras=2,
            max_lora_rank=16,
            loras=[worker_pb2.LoRAInfo(name=n, path=p, rank=8, key=f"key-{n}") for n, p in self.held.items()])

    def _load(self, name, path):
        if path.startswith("/bad"):
            raise ValueError(path)
        self.loads.append((name, path))
        self.held[name] = path

    async def LoadLoRA(self, request, context):
        try:
            self._load(request.lora.name, request.lora.path)
        except ValueError:  # as the real worker refuses: the field as a BadRequest detail
            await abort_with(context, InvalidRequestError("lora_path", f"no adapter at {request.lora.path}"))
        return worker_pb2.LoRAInfo(name=request.lora.name, path=request.lora.path, rank=8,
                                   key=f"key-{request.lora.name}")

    async def UnloadLoRA(self, request, context):
        if self.busy_unloads > 0:
            self.busy_unloads -= 1
            await abort_with(context, InvalidRequestError("lora_name", "1 request(s) in flight"))
        self.unloads.append(request.name)
        return worker_pb2.UnloadLoRAResponse(unloaded=self.held.pop(request.name, None) is not None)

    async def Generate(self, request, context):
        ref = request.lora
        self.generates.append((ref.name, ref.path))
        if ref.name and ref.name not in self.held:
            if not ref.path:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"lora: {ref.name!r} is not loaded")
            self._load(ref.name, ref.path)  # load-on-miss
        for i in range(2):
            msg = llm_pb2.GenerateResponse(request_id=request.request_id, token_ids=[10 + i])
            if i == 1:
                msg.finish_reason = "length"
            yield msg


@pytest.fixture
def cluster():
    loop = LoopThread("lora-routing-test")
    fakes = [FakeWorker(), FakeWorker()]
    servers = []

    async def start():
        addresses = []
        for f in fakes:
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(f, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            f.address = f"127.0.0.1:{port}"
            addresses.append(f.address)
            servers.append(server)
        router = RouterServer(StaticRegistry(addresses), build_tokenizer(384), RouterConfig(stats_interval_s=0.05),
                              adapters=[("sql", "/adapters/sql")])
        await router.start(min_workers=2)
        return router

    router = loop.run(start(), timeout_s=60)
    try:
        yield loop, router, fakes
    finally:
        loop.run(router.stop(grace=0.2))
        for s in servers:
            loop.run(s.stop(0))
        loop.stop()


def _generate(loop, router, model, **kw):
    req = llm_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12], model=model,
                                  params=llm_pb2.SamplingParams(max_tokens=2, temperature=0), **kw)

    async def run():
        call = Call(timeout_s=30)
        msgs = [m async for m in router.api.generate(req, call)]
        return msgs, call.decision

    return loop.run(run(), timeout_s=60)


def _by_address(fakes):
    return {f.address: f for f in fakes}


def test_adapter_no_worker_holds_is_loaded_by_one_worker_on_first_use(cluster):
    loop, router, fakes = cluster
    decisions = []
    for _ in range(4):
        msgs, decision = _generate(loop, router, "sql")
        assert [t for m in msgs for t in m.token_ids] == [10, 11]
        decisions.append(decision.decode[0])
    assert len(set(decisions)) == 1, decisions  # the first pick holds it: every later request follows
    holder = _by_address(fakes)[decisions[0]]
    assert holder.loads == [("sql", "/adapters/sql")]  # loaded once, by the request (load-on-miss)
    assert all(g == ("sql", "/adapters/sql") for g in holder.generates)  # every request carries the path
    other = next(f for f in fakes if f is not holder)
    assert other.loads == [] and other.generates == []
    # Base-model requests carry no adapter.
    _generate(loop, router, "")
    assert ("", "") in [g for f in fakes for g in f.generates]


def test_unknown_model_is_not_found_naming_what_is_served(cluster):
    loop, router, _ = cluster
    with pytest.raises(NotFoundError) as err:
        _generate(loop, router, "nope")
    assert err.value.field == "model" and "'kvmesh'" in str(err.value) and "'sql'" in str(err.value)
    # A client path other than the registered one is refused (no reading arbitrary folders).
    with pytest.raises(InvalidRequestError) as err:
        _generate(loop, router, "", lora=llm_pb2.LoRARef(name="sql", path="/elsewhere"))
    assert err.value.field == "lora.path"


def test_load_lora_adapter_loads_on_one_worker_and_lists_it(cluster):
    loop, router, fakes = cluster
    call = Call(timeout_s=30)
    resp = loop.run(router.api.load_lora_adapter(
        llm_pb2.LoadLoRAAdapterRequest(lora_name="chat", lora_path="/adapters/chat"), call))
    assert resp.lora_name == "chat" and resp.rank == 8 and len(resp.workers) == 1
    assert sum(len(f.loads) for f in fakes) == 1
    assert _by_address(fakes)[resp.workers[0]].held == {"chat": "/adapters/chat"}
    # Idempotent: the same name and path loads nothing more.
    again = loop.run(router.api.load_lora_adapter(
        llm_pb2.LoadLoRAAdapterRequest(lora_name="chat", lora_path="/adapters/chat"), call))
    assert list(again.workers) == list(resp.workers) and sum(len(f.loads) for f in fakes) == 1
    models = {m.id: m for m in router.api.list_models().models}
    assert set(models) == {"kvmesh", "sql", "chat"}
    assert (models["chat"].parent, models["chat"].root) == ("kvmesh", "/adapters/chat")
    assert models["kvmesh"].parent == "" and models["chat"].max_model_len == 256
    # The request goes where the adapter is.
    _, decision = _generate(loop, router, "chat")
    assert decision.decode == list(resp.workers)
    # Refusals: another path under the name, a path no worker can load, the base model's name.
    with pytest.raises(InvalidRequestError, match="already loaded"):
        loop.run(router.api.load_lora_adapter(
            llm_pb2.LoadLoRAAdapterRequest(lora_name="chat", lora_path="/adapters/other"), call))
    with pytest.raises(InvalidRequestError) as err:
        loop.run(router.api.load_lora_adapter(
            llm_pb2.LoadLoRAAdapterRequest(lora_name="broken", lora_path="/bad/path"), call))
    assert err.value.field == "lora_path" and "broken" not in {m.id for m in router.api.list_models().models}
    for name, path, field in [("kvmesh", "/x", "lora_name"), ("", "/x", "lora_name"), ("x y", "/x", "lora_name"),
                              ("ok", "", "lora_path")]:
        with pytest.raises(InvalidRequestError) as err:
            loop.run(router.api.load_lora_adapter(
                llm_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path), call))
        assert err.value.field == field


def test_unload_removes_the_adapter_from_every_worker(cluster, monkeypatch):
    loop, router, fakes = cluster
    monkeypatch.setattr(router_lora, "_UNLOAD_RETRY_PERIOD_S", 0.05)
    call = Call(timeout_s=30)
    for f in fakes:  # both hold it (one loaded it directly, without the router)
        f.held["sql"] = "/adapters/sql"
    fakes[1].busy_unloads = 1  # still running a request under it: refuses once, retried
    loop.run(router.api.unload_lora_adapter("sql", call))
    assert fakes[0].unloads == ["sql"] and "sql" not in fakes[0].held
    with pytest.raises(NotFoundError):
        _generate(loop, router, "sql")  # gone at once, even while a worker still holds it

    async def wait_unloaded():
        while "sql" in fakes[1].held:
            await asyncio.sleep(0.02)

    loop.run(asyncio.wait_for(wait_unloaded(), 10))
    assert {m.id for m in router.api.list_models().models} == {"kvmesh"}
    with pytest.raises(NotFoundError) as err:
        loop.run(router.api.unload_lora_adapter("sql", call))
    assert err.value.field == "lora_name"


def test_sync_adapters_makes_the_registry_equal_to_the_list(cluster):
    loop, router, fakes = cluster
    call = Call(timeout_s=30)
    loop.run(router.api.load_lora_adapter(llm_pb2.LoadLoRAAdapterRequest(lora_name="a", lora_path="/p/a"), call))
    _generate(loop, router, "sql")  # loaded on one worker by use
    loads_before = sum(len(f.loads) for f in fakes)
    loop.run(router.api.sync_adapters([("sql", "/adapters/sql"), ("b", "/p/b")]))
    assert {m.id for m in router.api.list_models().models} == {"kvmesh", "sql", "b"}
    assert all("a" not in f.held for f in fakes) and any("a" in f.unloads for f in fakes)
    assert sum(len(f.loads) for f in fakes) == loads_before  # new ones load lazily, on first use
    assert all("sql" in f.held for f in fakes if f.loads and f.loads[-1][0] == "sql")  # kept: unchanged
    # A changed path unloads the old weights everywhere; the new ones load on first use.
    loop.run(router.api.sync_adapters([("sql", "/adapters/sql-v2")]))
    assert all("sql" not in f.held for f in fakes)
    models = {m.id: m.root for m in router.api.list_models().models}
    assert models == {"kvmesh": "", "sql": "/adapters/sql-v2"}
    _, decision = _generate(loop, router, "sql")
    assert _by_address(fakes)[decision.decode[0]].held == {"sql": "/adapters/sql-v2"}
    with pytest.raises(InvalidRequestError):
        loop.run(router.api.sync_adapters([("x", "/1"), ("x", "/2")]))


def test_grpc_lora_adapter_rpcs(cluster):
    loop, router, fakes = cluster

    async def run():
        async with grpc.aio.insecure_channel(router.address) as ch:
            stub = llm_pb2_grpc.LLMStub(ch)
            resp = await stub.LoadLoRAAdapter(llm_pb2.LoadLoRAAdapterRequest(lora_name="g", lora_path="/p/g"),
                                              timeout=30)
            listed = await stub.ListModels(llm_pb2.ListModelsRequest(), timeout=30)
            await stub.UnloadLoRAAdapter(llm_pb2.UnloadLoRAAdapterRequest(lora_name="g"), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UnloadLoRAAdapter(llm_pb2.UnloadLoRAAdapterRequest(lora_name="g"), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.LoadLoRAAdapter(llm_pb2.LoadLoRAAdapterRequest(lora_name="h", lora_path="/bad"),
                                           timeout=30)
            return resp, listed, err.value, bad.value

    resp, listed, err, bad = loop.run(run(), timeout_s=60)
    assert len(resp.workers) == 1 and "g" in {m.id for m in listed.models}
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'g'" in err.details()
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
