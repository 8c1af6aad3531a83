"""Conversion between the gRPC messages (kvmesh._proto) and engine types, shared by the
router and the workers: proto <-> SamplingParams, RequestOutput -> GenerateResponse.

No torch here: the router imports this module.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

from kvmesh._proto import llm_pb2
from kvmesh.engine.outputs import RequestOutput, TokenLogprobs
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured_outputs import StructuredOutputsParams
from kvmesh.errors import InvalidRequestError


def prompt_cache_id(token_ids: list[int]) -> str:
    """Default CachePrompt id: the same prompt gets the same id on every worker."""
    return "pc-" + hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()[:16]


# proto field -> SamplingParams field, for the optional scalars (unset = engine default).
_OPTIONAL_SCALARS = (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens",
    "n", "prompt_logprobs", "min_tokens",
)


def params_from_proto(msg: llm_pb2.SamplingParams) -> SamplingParams:
    """Build validated SamplingParams; raises InvalidRequestError naming the field."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}
    kwargs.update(
        stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output, ignore_eos=msg.ignore_eos,
    )
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    return SamplingParams(**kwargs)


def structured_from_proto(msg: llm_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Validated StructuredOutputsParams (InvalidRequestError naming structured_outputs.*)."""
    kind = msg.WhichOneof("kind")
    kwargs: dict = {"disable_any_whitespace": msg.disable_any_whitespace}
    if kind == "json_schema":
        kwargs["json"] = msg.json_schema
    elif kind == "choice":
        kwargs["choice"] = list(msg.choice.choices)
    elif kind is not None:
        kwargs[kind] = getattr(msg, kind)
    return StructuredOutputsParams(**kwargs)


def structured_to_proto(so: StructuredOutputsParams) -> llm_pb2.StructuredOutputs:
    """The wire form (prefilled_output_ids stay in-process: a decode worker sets them)."""
    msg = llm_pb2.StructuredOutputs(disable_any_whitespace=so.disable_any_whitespace)
    kind = so.kind
    if kind == "json":
        msg.json_schema = so.spec_text
    elif kind == "choice":
        msg.choice.choices.extend(so.choice)
    else:
        setattr(msg, kind, getattr(so, kind))
    return msg


def params_to_proto(p: SamplingParams) -> llm_pb2.SamplingParams:
    msg = llm_pb2.SamplingParams(
        stop=p.stop, stop_token_ids=p.stop_token_ids,
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
    )
    for name in _OPTIONAL_SCALARS:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    if p.logit_bias:
        msg.logit_bias.update(p.logit_bias)
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    return msg


def logprobs_to_proto(items: Iterable[TokenLogprobs]) -> list[llm_pb2.TokenLogprob]:
    return [
        llm_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[llm_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in items
    ]


def logprobs_from_proto(items: Iterable[llm_pb2.TokenLogprob]) -> list[TokenLogprobs]:
    """Inverse of logprobs_to_proto (e.g. a GenerateResponse's prompt_logprobs)."""
    return [TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in items]


def output_to_proto(out: RequestOutput, request_id: str, num_new_logprobs: int = 0) -> llm_pb2.GenerateResponse:
    """One streamed message: the delta of `out` (one choice of it: `index`), plus finish
    reason and usage when that choice is done, and prompt logprobs on its first message.

    `num_new_logprobs` is how many entries at the end of the cumulative logprobs
    list belong to this delta (the engine keeps them cumulative).
    """
    c = out.outputs[0]
    msg = llm_pb2.GenerateResponse(request_id=request_id, text=c.delta_text, token_ids=c.delta_token_ids,
                                   index=out.index)
    if c.logprobs and num_new_logprobs:
        msg.logprobs.extend(logprobs_to_proto(c.logprobs[-num_new_logprobs:]))
    if out.prompt_logprobs is not None:  # the first prompt token has none: not sent
        msg.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs[1:]))
    if out.finished:
        msg.finish_reason = c.finish_reason or ""
        msg.stop_reason = "" if c.stop_reason is None else str(c.stop_reason)
        msg.usage.CopyFrom(llm_pb2.Usage(
            prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(c.token_ids),
            cached_prompt_tokens=out.num_cached_tokens,
        ))
    return msg


def check_token_ids(ids: list[int], field: str = "prompt_token_ids") -> list[int]:
    """Token ids must be non-negative (the worker also checks them against its vocabulary):
    hashing and prompt cache ids pack them as unsigned 32-bit integers."""
    if any(t < 0 for t in ids):
        raise InvalidRequestError(field, "token ids must be >= 0 (and below the model's vocabulary size)")
    return ids


def prompt_from_request(req: llm_pb2.GenerateRequest) -> str | list[int]:
    """The request's prompt: text or token ids, exactly one of them."""
    if req.prompt and req.prompt_token_ids:
        raise InvalidRequestError("prompt", "set either prompt or prompt_token_ids, not both")
    if req.prompt_token_ids:
        return check_token_ids(list(req.prompt_token_ids))
    if not req.prompt:
        raise InvalidRequestError("prompt", "must not be empty: set prompt or prompt_token_ids")
    return req.prompt
