"""The router's public gRPC service `kvmesh.v1.LLM`: a thin adapter over `RouterAPI`.

Each RPC turns the gRPC context into a `Call` (metadata, deadline), awaits the typed
API and renders its `KVMeshError`s as gRPC statuses with google.rpc details
(rpc/status.py: a BadRequest field violation, a RetryInfo). The route a Generate took
goes back as trailing metadata (`kvmesh-route`, `kvmesh-prefill`, `kvmesh-decode`).
"""

from __future__ import annotations

import grpc

from kvmesh._proto import llm_pb2, llm_pb2_grpc
from kvmesh.router.api import Call, RouterAPI
from kvmesh.rpc import abort_with

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLM"].full_name


def call_of(context: grpc.aio.ServicerContext) -> Call:
    metadata = tuple((m.key, m.value) for m in context.invocation_metadata() or ())
    return Call(metadata, context.time_remaining())


class LLMServicer(llm_pb2_grpc.LLMServicer):
    def __init__(self, api: RouterAPI):
        self.api = api

    async def Generate(self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        call = call_of(context)
        try:
            async for msg in self.api.generate(request, call):
                yield msg
        except Exception as exc:
            await abort_with(context, exc, call.decision.metadata() if call.decision is not None else ())
        if call.decision is not None:
            context.set_trailing_metadata(call.decision.metadata())

    async def Tokenize(self, request: llm_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            return llm_pb2.TokenizeResponse(token_ids=await self.api.tokenize(request.text, request.model))
        except Exception as exc:
            await abort_with(context, exc)

    async def ListModels(self, request: llm_pb2.ListModelsRequest, context: grpc.aio.ServicerContext):
        return self.api.list_models()

    async def CachePrompt(self, request: llm_pb2.CachePromptRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.api.cache_prompt(request, call_of(context))
        except Exception as exc:
            await abort_with(context, exc)

    async def UncachePrompt(self, request: llm_pb2.UncachePromptRequest, context: grpc.aio.ServicerContext):
        try:
            await self.api.uncache_prompt(request.cache_id, call_of(context))
        except Exception as exc:
            await abort_with(context, exc)
        return llm_pb2.UncachePromptResponse()

    async def LoadLoRAAdapter(self, request: llm_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.api.load_lora_adapter(request, call_of(context))
        except Exception as exc:
            await abort_with(context, exc)

    async def UnloadLoRAAdapter(self, request: llm_pb2.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext):
        try:
            await self.api.unload_lora_adapter(request.lora_name, call_of(context))
        except Exception as exc:
            await abort_with(context, exc)
        return llm_pb2.UnloadLoRAAdapterResponse()
