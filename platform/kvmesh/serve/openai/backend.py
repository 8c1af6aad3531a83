"""The HTTP layer's client of the router: the public `kvmesh.v1.LLM` service plus the
tokenizer (for the chat template and for rendering logprob tokens). The HTTP path
therefore gets exactly the routing, P/D and retries of the gRPC path. A backend sends the
API key the router checks, and opens a `kvmesh.http.generate` span (under the HTTP
request's span, request_span.py) whose context the router continues, so one trace runs
from the caller's `traceparent` through HTTP to the workers when tracing is on.

Two ways to reach the router, one interface (`Backend`), one error contract: a call
fails with a typed `KVMeshError` (the field as data), whichever way it went.
- `InProcessBackend` awaits the router's Python API (router/api.py `RouterAPI`) on the
  router's event loop: the HTTP server of `kvmesh serve` and `kvmesh router`, which runs
  on that loop. No loopback socket, no (de)serialisation per streamed message.
- `GrpcBackend` holds a loopback gRPC channel to the router (created lazily, on the event
  loop that serves HTTP): for an HTTP server on another loop, such as Ray Serve's proxy
  (http_ingress 'ray_proxy'). A failed call's status and google.rpc details become the
  same typed error (rpc/status.py `error_of_rpc`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from typing import Any

import grpc
import jinja2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.chat import ToolSet, takes_tools, template_messages, template_source
from kvmesh.errors import KVMeshError
from kvmesh.router.api import Call
from kvmesh.rpc import CHANNEL_OPTIONS
from kvmesh.rpc.auth import ApiKeys, bearer_metadata
from kvmesh.rpc.status import error_of_rpc
from kvmesh.serve.openai import request_span
from kvmesh.serve.openai.protocol import APIError, ChatMessage
from kvmesh.telemetry import tracing

# The HTTP caller's `Authorization` value, set by the app's API-key middleware: the router
# checks it again and derives the tenant (cache salt, rate-limit bucket) from it.
CLIENT_AUTHORIZATION: ContextVar[str | None] = ContextVar("kvmesh_client_authorization", default=None)

# How long a backend reuses the router's model list (base model + LoRA adapters) to check
# a request's `model`; a load or unload through this backend refreshes it at once.
MODELS_TTL_S = 1.0


class Backend:
    """What the HTTP routes need of the router (subclasses say how they reach it): the
    tokenizer's chat template, generation, the model list and health."""

    def __init__(self, tokenizer, model_id: str, timeout_s: float = 600.0):
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.timeout_s = timeout_s
        self._max_model_len = 0
        self._models: tuple[float, list[str]] | None = None  # (monotonic time, ids) of the last ListModels
        self.metadata = bearer_metadata(ApiKeys.from_env().service_key)  # the router checks the same keys

    def chat_prompt_ids(self, messages: list[ChatMessage], tools: ToolSet | None = None,
                        add_generation_prompt: bool = True, options: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the chat under the template (blocking: call it off the event loop).
        `tools` go to a template that reads them, else into a system prompt (kvmesh.chat.tools);
        `options` are apply_chat_template's keyword arguments from the body
        (ChatRequest.template_options: add_generation_prompt, continue_final_message,
        documents, the template's variables)."""
        source = template_source(self.tokenizer)
        if not source:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        conv, extra = template_messages([m.template_dict() for m in messages], tools, takes_tools(source))
        kwargs = {"add_generation_prompt": add_generation_prompt, **(options or {}), **extra}
        try:
            ids = self.tokenizer.apply_chat_template(conv, tokenize=True, **kwargs)
        except jinja2.TemplateError as e:  # e.g. a template's raise_exception on roles it does not take
            raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
        except ValueError as e:  # continue_final_message whose last message the template does not end with
            raise APIError(400, f"the chat template cannot render this request: {e}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, as the router encodes a text prompt (blocking)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _call_metadata(self, span) -> tuple[tuple[str, str], ...]:
        """The HTTP caller's API key (else the service key) and the trace context of `span`."""
        client = CLIENT_AUTHORIZATION.get()
        auth = (("authorization", client),) if client else self.metadata
        return (*auth, *(tracing.grpc_metadata(span) or ()))

    def generate(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """Stream from the router, in a `kvmesh.http.generate` span whose context the
        router continues (one trace from HTTP to the workers, when tracing is on). Errors
        arrive as typed `KVMeshError`s, whichever way the router is reached."""
        return self._generate(request)

    async def _generate(self, request: llm_pb2.GenerateRequest) -> AsyncIterator[llm_pb2.GenerateResponse]:
        http = request_span.CURRENT.get()
        cm = (tracing.client_span("kvmesh.http.generate", http.span) if http is not None
              else tracing.span("kvmesh.http.generate"))
        with cm as s:
            async for msg in self._stream(request, self._call_metadata(s)):
                if msg.finish_reason:
                    request_span.record_final(request.request_id, msg)
                yield msg

    def _stream(self, request: llm_pb2.GenerateRequest,
                metadata: tuple[tuple[str, str], ...]) -> AsyncIterator[llm_pb2.GenerateResponse]:
        raise NotImplementedError

    async def list_models(self) -> llm_pb2.ListModelsResponse:
        raise NotImplementedError

    async def model_ids(self) -> list[str]:
        """What a request's `model` may name: the base model and every LoRA adapter
        (the router's list, reused for MODELS_TTL_S)."""
        now = time.monotonic()
        if self._models is None or now - self._models[0] > MODELS_TTL_S:
            self._models = (now, [m.id for m in (await self.list_models()).models])
        return self._models[1]

    def _admin_call(self) -> tuple[tuple[str, str], ...]:
        """Metadata of an admin call: the HTTP caller's API key, else the service key."""
        self._models = None  # the adapters change: the next request reads the list again
        client = CLIENT_AUTHORIZATION.get()
        return (("authorization", client),) if client else self.metadata

    async def load_lora_adapter(self, name: str, path: str) -> llm_pb2.LoadLoRAAdapterResponse:
        """Load a LoRA adapter on the workers and serve it under `name`."""
        raise NotImplementedError

    async def unload_lora_adapter(self, name: str) -> None:
        raise NotImplementedError

    async def tokenize(self, text: str) -> list[int]:
        """The router's tokenization of `text` (its tokenizer, its prompt-size limit)."""
        raise NotImplementedError

    async def healthy(self) -> bool:
        """SERVING only while at least one worker is healthy (the router's gRPC health)."""
        raise NotImplementedError

    async def max_model_len(self) -> int:
        """The served model's context length (0 while no worker has reported it)."""
        if not self._max_model_len:
            try:
                models = (await self.list_models()).models
            except KVMeshError:
                return 0
            self._max_model_len = min((m.max_model_len for m in models), default=0)
        return self._max_model_len

    async def close(self) -> None:
        pass


class InProcessBackend(Backend):
    """The router's Python API (`RouterAPI`), awaited on the router's own event loop: the
    HTTP server must run on that loop. `serving()` is the router's health."""

    def __init__(self, api, serving: Callable[[], bool], tokenizer, model_id: str, timeout_s: float = 600.0):
        super().__init__(tokenizer, model_id, timeout_s)
        self.api = api
        self.serving = serving

    def _stream(self, request, metadata):
        return self.api.generate(request, Call(metadata, self.timeout_s))

    async def list_models(self) -> llm_pb2.ListModelsResponse:
        return self.api.list_models()

    async def model_ids(self) -> list[str]:
        return [m.id for m in self.api.list_models().models]  # in-process: always current

    async def load_lora_adapter(self, name: str, path: str) -> llm_pb2.LoadLoRAAdapterResponse:
        request = llm_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        return await self.api.load_lora_adapter(request, Call(self._admin_call(), self.timeout_s))

    async def unload_lora_adapter(self, name: str) -> None:
        await self.api.unload_lora_adapter(name, Call(self._admin_call(), self.timeout_s))

    async def tokenize(self, text: str) -> list[int]:
        return await self.api.tokenize(text)

    async def healthy(self) -> bool:
        return self.serving()


class GrpcBackend(Backend):
    """The router over a loopback gRPC channel (for an HTTP server on another event loop)."""

    def __init__(self, address: str, tokenizer, model_id: str, timeout_s: float = 600.0):
        super().__init__(tokenizer, model_id, timeout_s)
        self.address = address
        self._stub: llm_pb2_grpc.LLMStub | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def stub(self) -> llm_pb2_grpc.LLMStub:
        if self._stub is None:  # created on the serving event loop
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = llm_pb2_grpc.LLMStub(self._channel)
        return self._stub

    async def list_models(self) -> llm_pb2.ListModelsResponse:
        try:
            return await self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=10, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc) from None

    async def load_lora_adapter(self, name: str, path: str) -> llm_pb2.LoadLoRAAdapterResponse:
        request = llm_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
        try:
            return await self.stub.LoadLoRAAdapter(request, timeout=self.timeout_s, metadata=self._admin_call())
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc) from None

    async def unload_lora_adapter(self, name: str) -> None:
        request = llm_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        try:
            await self.stub.UnloadLoRAAdapter(request, timeout=self.timeout_s, metadata=self._admin_call())
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc) from None

    async def tokenize(self, text: str) -> list[int]:
        try:
            resp = await self.stub.Tokenize(llm_pb2.TokenizeRequest(text=text), timeout=30, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc) from None
        return list(resp.token_ids)

    async def _stream(self, request, metadata):
        try:
            async for msg in self.stub.Generate(request, timeout=self.timeout_s, metadata=metadata or None):
                yield msg
        except grpc.aio.AioRpcError as exc:
            raise error_of_rpc(exc) from None

    async def healthy(self) -> bool:
        self.stub  # noqa: B018 - creates the channel on this loop
        try:
            resp = await health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
