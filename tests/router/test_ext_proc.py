"""The endpoint picker (router/picker.py, router/ext_proc.py) over real gRPC on loopback:
Envoy ext_proc ProcessingRequests (request_headers, request_body) in, the picked endpoint
out as the `x-gateway-destination-endpoint` header and `envoy.lb` dynamic metadata. The
workers are real router WorkerHandles fed real StatsResponses (as the router tests do);
picks follow prefix affinity (reported hashes and the picker's own routing), load (its
in-flight requests) and LoRA; bad input gets an immediate 4xx and the stream ends."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from google.protobuf import struct_pb2
from tiny_models import build_tokenizer

from kvmesh._proto import ext_proc_pb2 as ep
from kvmesh._proto import worker_pb2
from kvmesh.engine.hashing import block_hashes
from kvmesh.router.config import RouterConfig
from kvmesh.router.ext_proc import BUFFERED, FULL_DUPLEX, ExternalProcessor, destination_of, process_call
from kvmesh.router.picker import EndpointPicker, endpoint_of
from kvmesh.router.registry import DnsRegistry, StaticRegistry, WorkerHandle, WorkerPool

pytestmark = pytest.mark.timeout(60)

FP, BS, TARGET = "fp", 4, 8000
A, B = "10.0.0.1:50061", "10.0.0.2:50061"
STEP_S = 5.0  # every answer must come well within this (a hang fails the test)
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer(300)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def handle(addr, waiting=0, cached=(), loras=(), lora_enabled=False):
    w = WorkerHandle(addr, affinity_capacity=1000)
    w.update(worker_pb2.StatsResponse(role="unified", address=addr, model_fingerprint=FP, block_size=BS,
                                      num_free_blocks=100, num_usable_blocks=100, num_waiting=waiting,
                                      cached_block_hashes=list(cached), lora_enabled=lora_enabled, max_loras=4,
                                      loras=list(loras)))
    return w


def make_pool(*handles) -> WorkerPool:
    pool = WorkerPool(StaticRegistry([h.address for h in handles]), 1000, 64, 1.0, 1.0)
    pool.workers = {h.address: h for h in handles}
    pool.fingerprint, pool.block_size = FP, BS
    return pool


def ep_of(addr: str) -> str:
    return endpoint_of(addr, TARGET)


def headers_msg(mode=BUFFERED, path="/v1/completions", end_of_stream=False, subset=None) -> ep.ProcessingRequest:
    hs = [ep.HeaderValue(key=k, raw_value=v.encode()) for k, v in
          ((":method", "POST"), (":path", path), ("content-type", "application/json"))]
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=ep.HeaderMap(headers=hs),
                                                              end_of_stream=end_of_stream),
                               protocol_config=ep.ProtocolConfiguration(request_body_mode=mode))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def body_msg(body: bytes, end_of_stream=True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))


def completion(prompt, model="kvmesh", **extra) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, **extra}).encode()


class Picker:
    """An ExternalProcessor on a loopback gRPC server, and a client stub for it."""

    def __init__(self, pool, tokenizer, config=None):
        self.picker = EndpointPicker(pool, config or RouterConfig(), tokenizer, "kvmesh", TARGET)
        self.pool = pool

    async def __aenter__(self):
        self.server = grpc.aio.server()
        ExternalProcessor(self.picker).add_to(self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.process = process_call(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.server.stop(0)

    async def route(self, body: bytes, mode=BUFFERED, subset=None, keep_open=False):
        """One buffered request: (endpoint header, metadata endpoint, the open call if kept)."""
        call = self.process()
        await call.write(headers_msg(mode, subset=subset))
        first = await asyncio.wait_for(call.read(), STEP_S)
        assert first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
        await call.write(body_msg(body))
        resp = await asyncio.wait_for(call.read(), STEP_S)
        assert resp.HasField("request_body"), resp
        assert not resp.request_body.response.HasField("body_mutation")  # the body passes through untouched
        header, meta = destination_of(resp)
        if keep_open:
            return header, meta, call
        await call.done_writing()
        assert await asyncio.wait_for(call.read(), STEP_S) is grpc.aio.EOF
        return header, meta, None

    async def refused(self, *msgs: ep.ProcessingRequest) -> ep.ImmediateResponse:
        """Send `msgs`; the last must be answered with an immediate response, then the stream ends."""
        call = self.process()
        for msg in msgs:
            await call.write(msg)
            duplex = msg.protocol_config.request_body_mode == FULL_DUPLEX  # headers wait for the body
            if msg.HasField("request_headers") and msg is not msgs[-1] and not duplex:
                assert (await asyncio.wait_for(call.read(), STEP_S)).HasField("request_headers")
        resp = await asyncio.wait_for(call.read(), STEP_S)
        assert resp.HasField("immediate_response"), resp
        assert await asyncio.wait_for(call.read(), STEP_S) is grpc.aio.EOF
        return resp.immediate_response


def test_pick_follows_reported_prefix_then_load(tokenizer):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert len(ids) >= 4 * BS
    hot = handle(A, waiting=2, cached=block_hashes(ids, BS, FP))  # holds the prompt, a little busier
    cold = handle(B)

    async def main():
        async with Picker(make_pool(hot, cold), tokenizer) as p:
            header, meta, _ = await p.route(completion(prompt))
            assert header == meta == ep_of(A)  # header and envoy.lb metadata agree
            # A prompt nobody holds goes by load: the idle worker.
            header, meta, _ = await p.route(completion("a completely different question about tea"))
            assert header == meta == ep_of(B)

    asyncio.run(main())


def test_routed_affinity_sticks_and_in_flight_load_spreads(tokenizer):
    a, b = handle(A), handle(B)
    first = "tell me a story about a lighthouse keeper and the sea"

    async def main():
        async with Picker(make_pool(a, b), tokenizer) as p:
            e1, _, open_call = await p.route(completion(first), keep_open=True)
            held = a if e1 == ep_of(A) else b
            assert held.in_flight == 1  # counted from the pick until the stream ends
            # While it runs, an unrelated request goes to the other worker (load).
            e2, _, _ = await p.route(completion("what is the boiling point of water at altitude"))
            assert e2 != e1
            await open_call.done_writing()
            assert await asyncio.wait_for(open_call.read(), STEP_S) is grpc.aio.EOF
            for _ in range(50):
                if held.in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert held.in_flight == 0
            # The same prompt again: the worker the picker sent it to (routed affinity), twice.
            for _ in range(2):
                e3, _, _ = await p.route(completion(first))
                assert e3 == e1

    asyncio.run(main())


def test_chat_messages_hash_like_the_chat_template(tokenizer):
    messages = [{"role": "system", "content": "you are terse"},
                {"role": "user", "content": [{"type": "text", "text": "name three rivers in europe please"}]}]
    conv = [{"role": "system", "content": "you are terse"},
            {"role": "user", "content": "name three rivers in europe please"}]
    ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    hot = handle(B, waiting=2, cached=block_hashes(ids, BS, FP))

    async def main():
        async with Picker(make_pool(handle(A), hot), tokenizer) as p:
            body = json.dumps({"model": "kvmesh", "messages": messages}).encode()
            header, meta, _ = await p.route(body)
            assert header == meta == ep_of(B)

    asyncio.run(main())


def test_lora_request_goes_to_the_worker_holding_the_adapter(tokenizer):
    plain = handle(A)
    holder = handle(B, waiting=1, lora_enabled=True,
                    loras=[worker_pb2.LoRAInfo(name="sql", path="/adapters/sql", rank=8, key="k1", resident=True)])

    async def main():
        async with Picker(make_pool(plain, holder), tokenizer) as p:
            for _ in range(2):
                header, _, _ = await p.route(completion("select the top customers", model="sql"))
                assert header == ep_of(B)
            header, _, _ = await p.route(completion("select the top customers"))  # the base model: by load
            assert header == ep_of(A)

    asyncio.run(main())


def test_full_duplex_answers_after_the_last_chunk_and_streams_the_body_back(tokenizer):
    body = completion("stream me the body back in two chunks please")

    async def main():
        async with Picker(make_pool(handle(A), handle(B, waiting=3)), tokenizer) as p:
            call = p.process()
            await call.write(headers_msg(FULL_DUPLEX))
            await call.write(body_msg(body[:10], end_of_stream=False))
            await call.write(body_msg(body[10:], end_of_stream=True))
            hdr = await asyncio.wait_for(call.read(), STEP_S)  # the first answer comes after the last chunk
            assert hdr.HasField("request_headers")
            assert hdr.request_headers.response.clear_route_cache
            assert destination_of(hdr) == (ep_of(A), ep_of(A))
            streamed = await asyncio.wait_for(call.read(), STEP_S)
            sr = streamed.request_body.response.body_mutation.streamed_response
            assert sr.body == body and sr.end_of_stream
            # The response passes back through, chunk by chunk.
            await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
            assert (await asyncio.wait_for(call.read(), STEP_S)).HasField("response_headers")
            await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: {}", end_of_stream=True)))
            out = await asyncio.wait_for(call.read(), STEP_S)
            assert out.response_body.response.body_mutation.streamed_response.body == b"data: {}"
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), STEP_S) is grpc.aio.EOF

    asyncio.run(main())


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "full_duplex"])
def test_bad_input_gets_an_immediate_4xx_never_a_hang(tokenizer, mode):
    async def main():
        async with Picker(make_pool(handle(A), handle(B)), tokenizer) as p:
            no_body = await p.refused(headers_msg(mode, end_of_stream=True))
            assert no_body.status.code == 400 and b"no body" in no_body.body
            cases = [(b"{not json", 400, "not JSON"), (b"[1, 2]", 400, "JSON object"),
                     (completion("hi", model="nope"), 404, "'nope' is not served"),
                     (json.dumps({"model": "kvmesh", "max_tokens": 3}).encode(), 400, "give `prompt`"),
                     (json.dumps({"model": 7, "prompt": "x"}).encode(), 400, "model must be a string"),
                     (b"", 400, "no body")]
            for body, status, words in cases:
                r = await p.refused(headers_msg(mode), body_msg(body))
                assert r.status.code == status, (body, r)
                err = json.loads(r.body)["error"]
                assert words in err["message"] and err["code"] == status
                assert r.headers.set_headers[0].header.key == "content-type"
            assert all(w.in_flight == 0 for w in p.pool.handles())

    asyncio.run(main())


def test_subset_hint_and_no_eligible_worker_is_503(tokenizer):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    hot = handle(A, cached=block_hashes(tokenizer.encode(prompt), BS, FP))

    async def main():
        async with Picker(make_pool(hot, handle(B)), tokenizer) as p:
            header, _, _ = await p.route(completion(prompt), subset=[ep_of(B)])
            assert header == ep_of(B)  # only the gateway's subset, affinity notwithstanding
            r = await p.refused(headers_msg(subset=["10.9.9.9:8000"]), body_msg(completion(prompt)))
            assert r.status.code == 503
        async with Picker(make_pool(), tokenizer) as p:
            p.pool.fingerprint = None  # no worker has answered Stats yet
            r = await p.refused(headers_msg(), body_msg(completion(prompt)))
            assert r.status.code == 503

    asyncio.run(main())


def test_dns_registry_lists_every_address_at_the_worker_port():
    assert "127.0.0.1:50061" in DnsRegistry("localhost", 50061).addresses()
    assert endpoint_of("[fd00::1]:50061", 8000) == "[fd00::1]:8000" and endpoint_of("h:1", None) == "h:1"


# Envoy's field numbers (api/envoy/service/ext_proc/v3/external_processor.proto, config/core/v3/base.proto),
# which kvmesh's copies (protos/kvmesh/v1/ext_proc.proto) must keep to stay wire-compatible.
ENVOY_FIELDS = {
    "ProcessingRequest": {"request_headers": 2, "response_headers": 3, "request_body": 4, "response_body": 5,
                          "request_trailers": 6, "response_trailers": 7, "metadata_context": 8, "attributes": 9,
                          "observability_mode": 10, "protocol_config": 11},
    "ProcessingResponse": {"request_headers": 1, "response_headers": 2, "request_body": 3, "response_body": 4,
                           "request_trailers": 5, "response_trailers": 6, "immediate_response": 7,
                           "dynamic_metadata": 8, "request_drain": 11},
    "HttpHeaders": {"headers": 1, "end_of_stream": 3}, "HttpBody": {"body": 1, "end_of_stream": 2},
    "CommonResponse": {"status": 1, "header_mutation": 2, "body_mutation": 3, "trailers": 4, "clear_route_cache": 5},
    "HeaderMutation": {"set_headers": 1, "remove_headers": 2},
    "BodyMutation": {"body": 1, "clear_body": 2, "streamed_response": 3},
    "StreamedBodyResponse": {"body": 1, "end_of_stream": 2},
    "ImmediateResponse": {"status": 1, "headers": 2, "body": 3, "grpc_status": 4, "details": 5},
    "ProtocolConfiguration": {"request_body_mode": 1, "response_body_mode": 2,
                              "send_body_without_waiting_for_header_response": 3},
    "HeaderValue": {"key": 1, "value": 2, "raw_value": 3},
    "HeaderValueOption": {"header": 1, "append_action": 3, "keep_empty_value": 4},
    "Metadata": {"filter_metadata": 1}, "HttpStatus": {"code": 1},
}


def test_ext_proc_messages_keep_envoys_field_numbers():
    for name, fields in ENVOY_FIELDS.items():
        desc = getattr(ep, name).DESCRIPTOR
        assert {f.name: f.number for f in desc.fields} == fields, name
