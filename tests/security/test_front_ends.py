"""The public front ends, secured: TLS on gRPC and HTTP, tenants (cache salt by request
field and by API key), per-API-key rate limits. One unified worker (tiny random Llama)
on a background loop; each test starts the router it needs over it."""

from __future__ import annotations

import contextlib
import ssl

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.build import build_worker
from kvmesh.config import EngineConfig
from kvmesh.router.config import RouterConfig
from kvmesh.router.ratelimit import RateLimitConfig
from kvmesh.router.registry import StaticRegistry
from kvmesh.router.server import RouterServer
from kvmesh.rpc import free_port
from kvmesh.rpc.internal_auth import InternalAuth
from kvmesh.rpc.tls import TLSFiles
from kvmesh.serve.loop import LoopThread
from kvmesh.serve.openai import GrpcBackend, InProcessBackend, create_app, serve_http_in_thread, start_http
from kvmesh.worker.server import WorkerServerConfig

TOKEN = "front-end-test-token"
BS = 4
PROMPT = list(range(20, 60))  # 40 tokens: 9 full blocks are reusable


@pytest.fixture(scope="module")
def worker(tiny_llama):
    loop = LoopThread("security-test-loop")
    cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=BS, num_blocks=256, max_model_len=128,
                                   num_threads=1)

    async def start():
        w = build_worker(cfg, WorkerServerConfig(role="unified"), auth=InternalAuth(token=TOKEN))
        await w.start()
        return w

    w = loop.run(start(), timeout_s=120)
    try:
        yield loop, w
    finally:
        loop.run(w.stop(grace=0.5))
        loop.stop()


@contextlib.contextmanager
def router(worker, config: RouterConfig | None = None, tls: TLSFiles | None = None, loopback: bool = False):
    loop, w = worker

    async def start():
        r = RouterServer(StaticRegistry([w.address]), w.aengine.tokenizer,
                         config or RouterConfig(stats_interval_s=0.1), tls=tls, auth=InternalAuth(token=TOKEN),
                         loopback=loopback)
        await r.start(min_workers=1)
        return r

    r = loop.run(start())
    try:
        yield r
    finally:
        loop.run(r.stop(grace=0.5))


@contextlib.contextmanager
def http_front(worker, r: RouterServer, backend_kind: str, **tls):
    """The OpenAI HTTP app in front of router `r`; yields its port. 'inprocess': on the
    router's loop, calling its servicer directly (`kvmesh serve`, `kvmesh router`);
    'grpc': on a thread of its own over loopback gRPC (Ray Serve's proxy ingress)."""
    loop, w = worker
    port = free_port()
    if backend_kind == "inprocess":
        backend = InProcessBackend(r.api, lambda: r.serving, w.aengine.tokenizer, "kvmesh")
        http = loop.run(start_http(create_app(lambda: backend), "127.0.0.1", port, **tls))
        try:
            yield port
        finally:
            loop.run(http.stop())
    else:
        backend = GrpcBackend(r.loopback_address, w.aengine.tokenizer, "kvmesh")
        http = serve_http_in_thread(create_app(lambda: backend), "127.0.0.1", port, **tls)
        try:
            yield port
        finally:
            http.should_exit = True


def _request(ids=PROMPT, salt: str = "", max_tokens: int = 2) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(prompt_token_ids=ids, cache_salt=salt,
                                   params=llm_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))


async def _generate(channel: grpc.aio.Channel, req, key: str | None = None) -> llm_pb2.GenerateResponse:
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    msgs = [m async for m in llm_pb2_grpc.LLMStub(channel).Generate(req, metadata=metadata, timeout=60)]
    return msgs[-1]


def _cached(loop, address: str, req, key: str | None = None) -> int:
    async def run():
        async with grpc.aio.insecure_channel(address) as ch:
            return (await _generate(ch, req, key)).usage.cached_prompt_tokens

    return loop.run(run())


# -- TLS -------------------------------------------------------------------------------------


def test_grpc_front_end_over_tls(worker, certs):
    loop, _ = worker
    with router(worker, tls=TLSFiles(cert_file=str(certs.cert), key_file=str(certs.key))) as r:
        async def over_tls():
            creds = grpc.ssl_channel_credentials(certs.ca.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{r.port}", creds) as ch:
                models = await llm_pb2_grpc.LLMStub(ch).ListModels(llm_pb2.ListModelsRequest(), timeout=10)
                last = await _generate(ch, _request())
                return models, last

        async def plaintext():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") as ch:
                await llm_pb2_grpc.LLMStub(ch).ListModels(llm_pb2.ListModelsRequest(), timeout=5)

        models, last = loop.run(over_tls())
        assert models.models[0].id == "kvmesh" and last.finish_reason == "length"
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            loop.run(plaintext())
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_front_end_mutual_tls_refuses_foreign_client_certs(worker, certs):
    loop, _ = worker
    tls = TLSFiles(cert_file=str(certs.cert), key_file=str(certs.key), client_ca_file=str(certs.ca))
    with router(worker, tls=tls) as r:
        async def call(cert, key):
            creds = grpc.ssl_channel_credentials(certs.ca.read_bytes(), key.read_bytes() if key else None,
                                                 cert.read_bytes() if cert else None)
            async with grpc.aio.secure_channel(f"localhost:{r.port}", creds) as ch:
                return await llm_pb2_grpc.LLMStub(ch).ListModels(llm_pb2.ListModelsRequest(), timeout=10)

        assert loop.run(call(certs.cert, certs.key)).models
        for cert, key in ((None, None), (certs.other_cert, certs.other_key)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                loop.run(call(cert, key))
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("backend_kind", ["inprocess", "grpc"])
def test_http_front_end_over_tls(worker, certs, backend_kind):
    tls = TLSFiles(cert_file=str(certs.cert), key_file=str(certs.key))
    with router(worker, tls=tls, loopback=backend_kind == "grpc") as r, \
            http_front(worker, r, backend_kind, ssl_certfile=str(certs.cert), ssl_keyfile=str(certs.key)) as port:
        with httpx.Client(verify=ssl.create_default_context(cafile=str(certs.ca)), timeout=60) as client:
            models = client.get(f"https://localhost:{port}/v1/models")
            done = client.post(f"https://localhost:{port}/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
            health = client.get(f"https://localhost:{port}/health")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "kvmesh"
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 2
        assert health.status_code == 200
        if backend_kind == "inprocess":  # no plaintext loopback port is opened for it
            assert r.loopback_address is None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)  # plaintext to a TLS port


# -- tenants: cache salt -----------------------------------------------------------------------


def test_cache_salt_keeps_prefix_hits_inside_a_tenant(worker):
    loop, _ = worker
    prompt = list(range(100, 140))
    with router(worker) as r:
        assert _cached(loop, r.address, _request(prompt, "tenant-a")) == 0
        assert _cached(loop, r.address, _request(prompt, "tenant-b")) == 0  # same prompt, other salt: no hit
        assert _cached(loop, r.address, _request(prompt, "")) == 0  # unsalted is its own space too
        assert _cached(loop, r.address, _request(prompt, "tenant-a")) == 36  # same salt still shares
        assert _cached(loop, r.address, _request(prompt, "tenant-b")) == 36


def test_api_keys_are_tenants(worker, tmp_path, monkeypatch):
    loop, _ = worker
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\nkey-alice\nkey-bob\n")
    monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    monkeypatch.setenv("KVMESH_API_KEYS_FILE", str(keys))
    prompt = list(range(200, 240))
    with router(worker) as r:
        assert _cached(loop, r.address, _request(prompt), "key-alice") == 0
        assert _cached(loop, r.address, _request(prompt), "key-bob") == 0  # alice's KV is not bob's
        assert _cached(loop, r.address, _request(prompt, "x"), "key-alice") == 0  # a salt inside alice's space
        assert _cached(loop, r.address, _request(prompt), "key-alice") == 36
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            _cached(loop, r.address, _request(prompt), "key-mallory")
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- rate limits ---------------------------------------------------------------------------------


def test_grpc_rate_limit_answers_resource_exhausted_with_retry_info(worker):
    loop, _ = worker
    config = RouterConfig(stats_interval_s=0.1, rate_limit=RateLimitConfig(requests_per_minute=2))
    with router(worker, config) as r:
        for _ in range(2):
            _cached(loop, r.address, _request())
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            _cached(loop, r.address, _request())
    err = exc.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in err.details()
    trailers = dict(err.trailing_metadata())
    assert 1 <= int(trailers["retry-after"]) <= 30  # a request per 30 s refills the bucket
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and info.retry_delay.seconds == int(trailers["retry-after"])


def test_token_limit_refuses_a_request_that_can_never_fit(worker):
    loop, _ = worker
    config = RouterConfig(stats_interval_s=0.1, rate_limit=RateLimitConfig(tokens_per_minute=30))
    with router(worker, config) as r:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            _cached(loop, r.address, _request(max_tokens=2))  # 40 prompt + 2 > 30
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens per minute" in exc.value.details()


@pytest.mark.parametrize("backend_kind", ["inprocess", "grpc"])
def test_http_rate_limit_is_an_openai_429_with_retry_after(worker, monkeypatch, backend_kind):
    monkeypatch.setenv("KVMESH_API_KEY", "key-http")
    config = RouterConfig(stats_interval_s=0.1, rate_limit=RateLimitConfig(requests_per_minute=1))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with router(worker, config) as r, http_front(worker, r, backend_kind) as port:
        with httpx.Client(timeout=60, headers={"Authorization": "Bearer key-http"}) as client:
            ok = client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            limited = client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
    assert ok.status_code == 200
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_exceeded"
