"""gRPC glue: the `compression` field of `kvmesh.v1.GenerateRequest` <-> CompressionOptions,
and compressing a request's prompt off the event loop (router and worker Generate)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvmesh._proto import llm_pb2
from kvmesh.compress.api import CompressedPrompt, compress_prompt
from kvmesh.compress.options import FIELD, CompressionOptions, parse_options
from kvmesh.errors import InvalidRequestError


def options_from_proto(msg: llm_pb2.Compression) -> CompressionOptions:
    """Validated options; unset fields take the defaults. Raises InvalidRequestError."""
    raw: dict = {}
    if msg.method:
        raw["method"] = msg.method
    if msg.HasField("target_ratio"):
        raw["target_ratio"] = msg.target_ratio
    if msg.HasField("question"):
        raw["question"] = msg.question
    if msg.granularity:
        raw["granularity"] = msg.granularity
    return parse_options(raw)


def options_to_proto(opts: CompressionOptions) -> llm_pb2.Compression:
    msg = llm_pb2.Compression(method=opts.method, target_ratio=opts.target_ratio, granularity=opts.granularity)
    if opts.question is not None:
        msg.question = opts.question
    return msg


@dataclass
class RequestCompression:
    """What compressing one request did (for usage accounting)."""

    result: CompressedPrompt
    original_prompt_tokens: int  # the uncompressed prompt under the server's tokenizer, special tokens included


async def compress_request(request: llm_pb2.GenerateRequest, tokenizer
                           ) -> tuple[llm_pb2.GenerateRequest, RequestCompression | None]:
    """`request` with its prompt compressed when it asks for it, else `request` itself.

    Validation happens before any model loads; the compression (a model forward) runs
    in a thread so the server's event loop keeps serving other calls.
    """
    if not request.HasField(FIELD):
        return request, None
    opts = options_from_proto(request.compression)
    if request.prompt_token_ids or not request.prompt:
        raise InvalidRequestError(FIELD, "needs a text prompt with <context>...</context> spans, "
                                         "not prompt_token_ids")
    result = await asyncio.to_thread(compress_prompt, request.prompt, opts, tokenizer=tokenizer)
    out = llm_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.prompt = result.text
    out.ClearField(FIELD)
    original = len(tokenizer.encode(request.prompt, add_special_tokens=True))
    return out, RequestCompression(result, original)
