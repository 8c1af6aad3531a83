"""The router's typed boundary (router/api.py, rpc/status.py): one Python API that the gRPC
servicer and the HTTP layer both call, whose errors carry the offending field as data.

- `RouterAPI.generate` raises typed kvmesh errors (the field as `.field`), never aborts
  a transport context;
- over gRPC the same error is INVALID_ARGUMENT with a google.rpc.BadRequest field
  violation, and `error_of_rpc` turns it back into the typed error (the HTTP layer's
  loopback path and the router reading a worker);
- a worker's own refusal (a token id outside its vocabulary) crosses the router as the
  same typed error, field included;
- the HTTP app names the field in `param` whichever backend it uses.
"""

from __future__ import annotations

import contextlib

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.build import build_worker
from kvmesh.config import EngineConfig
from kvmesh.errors import InvalidRequestError, RateLimitedError, UnavailableError
from kvmesh.router.api import Call
from kvmesh.router.config import RouterConfig
from kvmesh.router.registry import StaticRegistry
from kvmesh.router.server import RouterServer
from kvmesh.rpc import free_port
from kvmesh.rpc.retry_info import DETAILS_KEY
from kvmesh.rpc.status import error_of_rpc
from kvmesh.serve.loop import LoopThread
from kvmesh.serve.openai import GrpcBackend, InProcessBackend, create_app, serve_http_in_thread, start_http
from kvmesh.worker.server import WorkerServerConfig

VOCAB_OVER = 10**6  # beyond any tiny model's vocabulary


@pytest.fixture(scope="module")
def stack(tiny_llama):
    loop = LoopThread("router-api-test-loop")
    cfg = EngineConfig.from_kwargs(model=str(tiny_llama), block_size=4, num_blocks=128, max_model_len=128,
                                   num_threads=1)

    async def start():
        w = build_worker(cfg, WorkerServerConfig(role="unified"))
        await w.start()
        r = RouterServer(StaticRegistry([w.address]), w.aengine.tokenizer, RouterConfig(stats_interval_s=0.1))
        await r.start(min_workers=1)
        return w, r

    w, r = loop.run(start(), timeout_s=120)
    try:
        yield loop, w, r
    finally:
        loop.run(r.stop(grace=0.5))
        loop.run(w.stop(grace=0.5))
        loop.stop()


def _request(**params) -> llm_pb2.GenerateRequest:
    prompt_ids = params.pop("prompt_token_ids", [5, 6, 7, 8, 9])
    return llm_pb2.GenerateRequest(prompt_token_ids=prompt_ids,
                                   params=llm_pb2.SamplingParams(max_tokens=3, temperature=0, **params))


async def _drain(api, req) -> list[llm_pb2.GenerateResponse]:
    return [m async for m in api.generate(req, Call(timeout_s=30))]


def test_api_streams_and_records_the_route(stack):
    loop, _, r = stack
    call = Call(timeout_s=30)

    async def run():
        return [m async for m in r.api.generate(_request(), call)]

    msgs = loop.run(run())
    assert sum(len(m.token_ids) for m in msgs) == 3 and msgs[-1].finish_reason == "length"
    assert call.decision is not None and call.decision.path == "direct" and call.decision.decode


@pytest.mark.parametrize("params,field", [({"top_p": 2.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                          ({"prompt_token_ids": [5, VOCAB_OVER]}, "prompt_token_ids")])
def test_api_errors_are_typed_with_the_field(stack, params, field):
    """Router-side validation and the worker's own (the token id over its vocabulary)
    both reach the caller as InvalidRequestError naming the field."""
    loop, _, r = stack
    kwargs = dict(params)
    max_tokens = kwargs.pop("max_tokens", None)
    req = _request(**kwargs)
    if max_tokens is not None:
        req.params.max_tokens = max_tokens
    with pytest.raises(InvalidRequestError) as err:
        loop.run(_drain(r.api, req))
    assert err.value.field == field


def test_grpc_carries_the_field_as_a_bad_request_detail(stack):
    loop, _, r = stack

    async def run():
        async with grpc.aio.insecure_channel(r.address) as ch:
            stub = llm_pb2_grpc.LLMStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(_request(prompt_token_ids=[5, VOCAB_OVER]), timeout=30):
                    pass
            return err.value

    exc = loop.run(run())
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = status_pb2.Status()
    status.ParseFromString(dict(exc.trailing_metadata())[DETAILS_KEY])
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "prompt_token_ids"
    typed = error_of_rpc(exc)
    assert isinstance(typed, InvalidRequestError) and typed.field == "prompt_token_ids"


def test_error_of_rpc_rate_limit_and_unavailable():
    from kvmesh.rpc.retry_info import retry_after_metadata

    limited = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(*retry_after_metadata(7, "slow down")), details="slow down")
    typed = error_of_rpc(limited)
    assert isinstance(typed, RateLimitedError) and typed.retry_after_s == 7 and str(typed) == "slow down"
    down = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="no worker")
    assert isinstance(error_of_rpc(down), UnavailableError)


@contextlib.contextmanager
def _http(stack, kind: str):
    loop, w, r = stack
    port = free_port()
    if kind == "inprocess":
        backend = InProcessBackend(r.api, lambda: r.serving, w.aengine.tokenizer, "kvmesh")
        server = loop.run(start_http(create_app(lambda: backend), "127.0.0.1", port))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            loop.run(server.stop())
    else:
        backend = GrpcBackend(r.address, w.aengine.tokenizer, "kvmesh")
        server = serve_http_in_thread(create_app(lambda: backend), "127.0.0.1", port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


@pytest.mark.parametrize("kind", ["inprocess", "grpc"])
def test_http_names_the_field_from_the_worker_either_way(stack, kind):
    with _http(stack, kind) as url:
        body = {"prompt": [5, VOCAB_OVER], "max_tokens": 2}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "prompt_token_ids" and "token id" in err["message"]
        stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert stream.status_code == 400 and stream.json()["error"]["param"] == "prompt_token_ids"


@pytest.mark.parametrize("kind", ["inprocess", "grpc"])
def test_tokenize_and_detokenize_round_trip(stack, kind):
    """/tokenize encodes as generation does (prompt text; chat messages under the
    template), /detokenize inverts it; bad input is a 400 naming the field."""
    _, w, _ = stack
    tok = w.aengine.tokenizer
    with _http(stack, kind) as url:
        got = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}, timeout=30).json()
        assert got["tokens"] == tok.encode("hello world", add_special_tokens=True)
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 128
        back = httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}, timeout=30).json()
        assert back["prompt"] == tok.decode(got["tokens"])
        both = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                          timeout=30)
        assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
        over = httpx.post(f"{url}/detokenize", json={"tokens": [len(tok) + 5]}, timeout=30)
        assert over.status_code == 400 and over.json()["error"]["param"] == "tokens"
