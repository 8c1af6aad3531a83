"""The protocols `kvmesh bench serve` speaks, one class each, by name in BACKENDS:

- `openai`: POST /v1/completions, token-id prompts, `stream: true` with
  `stream_options.include_usage` (so token counts are the server's own); every chunk
  with text, or without a finish_reason, counts as a streamed message;
- `openai-chat`: POST /v1/chat/completions, the prompt text as one user message;
- `grpc`: kvmesh's public `LLM.Generate` stream (router or worker), token-id prompts.

Every backend sends greedy-by-default requests with EOS ignored (`RequestOptions`), so
output lengths are the ones the workload asked for and two servers can be compared.
A failed request becomes a record with `ok=False` and the error; it never raises.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.bench.datasets import Sample
from kvmesh.bench.metrics import RequestRecord


@dataclass(frozen=True)
class RequestOptions:
    """Sampling settings every request of a run shares."""

    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    extra_body: dict[str, Any] | None = None  # merged into each OpenAI request body


class _Stream:
    """Clocks one streamed answer: TTFT at the first message with tokens, then ITLs."""

    def __init__(self, record: RequestRecord):
        self.rec = record
        self.t0 = time.perf_counter()
        self.last: float | None = None

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.rec.ttft_s = now - self.t0
        else:
            self.rec.itl_s.append(now - self.last)
        self.last = now

    def done(self) -> RequestRecord:
        self.rec.e2e_s = time.perf_counter() - self.t0
        return self.rec


class Backend:
    """One protocol: `open()` once, `send(sample)` per request, `close()` at the end."""

    name = ""

    def __init__(self, target: str, model: str | None, options: RequestOptions):
        self.target, self.model, self.options = target, model, options

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def served_models(self) -> list[str]:
        raise NotImplementedError

    async def send(self, sample: Sample) -> RequestRecord:
        raise NotImplementedError


class OpenAICompletions(Backend):
    """`target` is the server's base URL (http://host:port); requests go to `endpoint`."""

    name = "openai"
    endpoint = "/v1/completions"

    async def open(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.session.close()

    async def served_models(self) -> list[str]:
        async with self.session.get(self.target.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            return [m["id"] for m in (await resp.json())["data"]]

    def body(self, sample: Sample) -> dict[str, Any]:
        return {"prompt": sample.prompt_ids}

    def delta_text(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""

    async def send(self, sample: Sample) -> RequestRecord:
        rec = RequestRecord(prompt_tokens=sample.prompt_len, expected_output_tokens=sample.output_len)
        body = {"model": self.model, **self.body(sample), "max_tokens": sample.output_len,
                "temperature": self.options.temperature, "ignore_eos": self.options.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}, **(self.options.extra_body or {})}
        clock, parts, usage = _Stream(rec), [], None
        try:
            async with self.session.post(self.target.rstrip("/") + self.endpoint, json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return clock.done()
                async for raw in resp.content:  # SSE: one `data: {...}` line per event
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    msg = json.loads(line[5:])
                    usage = msg.get("usage") or usage
                    choices = msg.get("choices") or ()
                    text = "".join(self.delta_text(c) for c in choices)
                    # A step's chunk may decode to no text yet (a partial UTF-8 character): it still
                    # carried a token, unless it is only the closing finish_reason chunk.
                    if text or any(c.get("finish_reason") is None for c in choices):
                        clock.tokens_arrived()
                        parts.append(text)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return clock.done()
        clock.done()
        rec.text = "".join(parts)
        if usage:
            rec.prompt_tokens, rec.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        else:  # a server without include_usage: count the streamed messages
            rec.output_tokens = len(rec.itl_s) + (1 if parts else 0)
        rec.ok = rec.output_tokens > 0 and clock.last is not None
        if not rec.ok:
            rec.error = "the stream carried no tokens"
        return rec


class OpenAIChat(OpenAICompletions):
    name = "openai-chat"
    endpoint = "/v1/chat/completions"

    def body(self, sample: Sample) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": sample.prompt}]}

    def delta_text(self, choice: dict[str, Any]) -> str:
        return (choice.get("delta") or {}).get("content") or ""


class GrpcGenerate(Backend):
    """`target` is host:port of a kvmesh router (or a worker's Worker.Generate: same messages)."""

    name = "grpc"

    async def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = llm_pb2_grpc.LLMStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def served_models(self) -> list[str]:
        resp = await self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=30)
        return [m.id for m in resp.models]

    async def send(self, sample: Sample) -> RequestRecord:
        rec = RequestRecord(prompt_tokens=sample.prompt_len, expected_output_tokens=sample.output_len)
        params = llm_pb2.SamplingParams(max_tokens=sample.output_len, temperature=self.options.temperature,
                                        ignore_eos=self.options.ignore_eos)
        req = llm_pb2.GenerateRequest(prompt_token_ids=sample.prompt_ids, params=params, model=self.model or "")
        clock, ids, parts, usage = _Stream(rec), [], [], None
        try:
            async for msg in self.stub.Generate(req, timeout=self.options.timeout_s):
                if msg.token_ids:
                    clock.tokens_arrived()
                    ids.extend(msg.token_ids)
                    parts.append(msg.text)
                if msg.finish_reason and msg.HasField("usage"):
                    usage = msg.usage
        except grpc.aio.AioRpcError as exc:
            rec.error = f"{exc.code().name}: {exc.details()}"
            return clock.done()
        clock.done()
        rec.token_ids, rec.text, rec.output_tokens = ids, "".join(parts), len(ids)
        if usage is not None:
            rec.prompt_tokens, rec.output_tokens = usage.prompt_tokens, usage.completion_tokens
        rec.ok = bool(ids)
        if not rec.ok:
            rec.error = "the stream carried no tokens"
        return rec


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (OpenAICompletions, OpenAIChat, GrpcGenerate)}
