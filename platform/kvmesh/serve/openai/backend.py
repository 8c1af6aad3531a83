"""The HTTP layer's client of the router: `GrpcBackend` holds a loopback gRPC channel to
the public `kvmesh.v1.LLM` service plus the tokenizer (for the chat template and for
rendering logprob tokens). The HTTP path therefore gets exactly the routing, P/D and
retries of the gRPC path. It sends the API key the router checks, and opens a
`kvmesh.http.generate` span whose context the router continues, so one trace runs from
HTTP to the workers when tracing is on. The channel is created lazily, on the event loop
that serves HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.rpc import CHANNEL_OPTIONS
from kvmesh.rpc.auth import api_key, bearer_metadata
from kvmesh.serve.openai.protocol import APIError, ChatMessage
from kvmesh.telemetry import tracing


class GrpcBackend:
    """The router's gRPC API plus the tokenizer's chat template."""

    def __init__(self, address: str, tokenizer, model_id: str, timeout_s: float = 600.0):
        self.address = address
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.timeout_s = timeout_s
        self._stub: llm_pb2_grpc.LLMStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self.metadata = bearer_metadata(api_key())  # the router checks the same key

    @property
    def stub(self) -> llm_pb2_grpc.LLMStub:
        if self._stub is None:  # created on the serving event loop
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = llm_pb2_grpc.LLMStub(self._channel)
        return self._stub

    def chat_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        conv = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in messages]
        ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def list_models(self) -> llm_pb2.ListModelsResponse:
        return await self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=10, metadata=self.metadata)

    def generate(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """Stream from the router, in a `kvmesh.http.generate` span whose context the
        router continues (one trace from HTTP to the workers, when tracing is on)."""
        return self._generate(request)

    async def _generate(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        with tracing.span("kvmesh.http.generate") as s:
            metadata = (*self.metadata, *(tracing.grpc_metadata(s) or ())) or None
            async for msg in self.stub.Generate(request, timeout=self.timeout_s, metadata=metadata):
                yield msg

    async def healthy(self) -> bool:
        try:
            models = await self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=5, metadata=self.metadata)
            return len(models.models) > 0
        except grpc.aio.AioRpcError:
            return False

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
