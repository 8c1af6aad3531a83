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
from contextvars import ContextVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.rpc import CHANNEL_OPTIONS
from kvmesh.rpc.auth import ApiKeys, bearer_metadata
from kvmesh.serve.openai.protocol import APIError, ChatMessage
from kvmesh.telemetry import tracing

# The HTTP caller's `Authorization` value, set by the app's API-key middleware: the router
# checks it again and derives the tenant (cache salt, rate-limit bucket) from it.
CLIENT_AUTHORIZATION: ContextVar[str | None] = ContextVar("kvmesh_client_authorization", default=None)


class GrpcBackend:
    """The router's gRPC API plus the tokenizer's chat template."""

    def __init__(self, address: str, tokenizer, model_id: str, timeout_s: float = 600.0):
        self.address = address
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.timeout_s = timeout_s
        self._stub: llm_pb2_grpc.LLMStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self._max_model_len = 0
        self.metadata = bearer_metadata(ApiKeys.from_env().service_key)  # the router checks the same keys

    @property
    def stub(self) -> llm_pb2_grpc.LLMStub:
        if self._stub is None:  # created on the serving event loop
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = llm_pb2_grpc.LLMStub(self._channel)
        return self._stub

    def chat_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of the chat under the template (blocking: call it off the event loop)."""
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
            client = CLIENT_AUTHORIZATION.get()
            auth = (("authorization", client),) if client else self.metadata
            metadata = (*auth, *(tracing.grpc_metadata(s) or ())) or None
            async for msg in self.stub.Generate(request, timeout=self.timeout_s, metadata=metadata):
                yield msg

    async def healthy(self) -> bool:
        """The router's gRPC health: SERVING only while at least one worker is healthy."""
        self.stub  # noqa: B018 - creates the channel on this loop
        try:
            resp = await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def max_model_len(self) -> int:
        """The served model's context length (0 while no worker has reported it)."""
        if not self._max_model_len:
            try:
                models = (await self.list_models()).models
            except grpc.aio.AioRpcError:
                return 0
            self._max_model_len = min((m.max_model_len for m in models), default=0)
        return self._max_model_len

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
