"""`POST /tokenize` and `POST /detokenize`, as vLLM's server spells them.

`/tokenize` takes a `prompt` (text, encoded as /v1/completions would encode it) or chat
`messages` (rendered with the chat template as /v1/chat/completions renders them) and
returns `{count, max_model_len, tokens}` (plus `token_strs` when asked); `/detokenize`
takes `tokens` and returns `{prompt}`. Both use the served model's tokenizer, off the
event loop, under the same prompt-size limit as generation; ids outside the vocabulary
are a 400 naming `tokens`.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh.serve.openai.generation import BackendSource, check_model
from kvmesh.serve.openai.limits import check_prompt_chars, limits_of
from kvmesh.serve.openai.protocol import APIError, ChatMessage, TokenId


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="For `prompt`: as /v1/completions encodes it.")
    add_generation_prompt: bool = Field(True, description="For `messages`: end with the assistant's turn.")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (chat)", param="prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


# POST /tokenize and /detokenize, registered by create_app (no docstrings: FastAPI would publish them).
async def tokenize(body: TokenizeRequest, request: Request):
    b = BackendSource.of(request).require()
    await check_model(b, body.model)
    limits = limits_of(request)
    if body.messages is not None:
        check_prompt_chars(limits, sum(len(m.text()) for m in body.messages), "messages")
        ids = await asyncio.to_thread(b.chat_prompt_ids, body.messages, add_generation_prompt=body.add_generation_prompt)
    else:
        check_prompt_chars(limits, len(body.prompt), "prompt")
        ids = await asyncio.to_thread(b.encode, body.prompt, body.add_special_tokens)
    out = {"count": len(ids), "max_model_len": await b.max_model_len(), "tokens": list(ids)}
    if body.return_token_strs:
        out["token_strs"] = b.token_strs(list(ids))
    return out


async def detokenize(body: DetokenizeRequest, request: Request):
    b = BackendSource.of(request).require()
    await check_model(b, body.model)
    vocab = b.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: id {bad} is outside the vocabulary (size {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(b.decode, body.tokens)}
