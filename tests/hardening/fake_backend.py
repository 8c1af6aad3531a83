"""A stand-in for the HTTP app's GrpcBackend that validates like the router does.

It runs kvmesh's own gRPC-side validation (`params_from_proto`, `prompt_from_request`,
token ids against a 384-token vocabulary, max_model_len 256) and raises the same typed
`InvalidRequestError` the router's API would, then streams a few tokens. The HTTP layer under
test is the real one; only the router and workers behind it are replaced, so the
fuzzers run in milliseconds per request.
"""

from __future__ import annotations

import asyncio

from kvmesh._proto import llm_pb2
from kvmesh.errors import InvalidRequestError, NotFoundError
from kvmesh.router.lora import check_adapter
from kvmesh.rpc import params_from_proto, prompt_from_request

VOCAB = 384
MAX_MODEL_LEN = 256


class FakeBackend:
    model_id = "kvmesh"
    tokenizer = None

    def __init__(self, tokens_per_request: int = 3, token_delay_s: float = 0.0):
        self.tokens_per_request = tokens_per_request
        self.token_delay_s = token_delay_s
        self.requests: list[llm_pb2.GenerateRequest] = []
        self.cancelled = 0  # streams closed before their last token

    def chat_prompt_ids(self, messages, tools=None, add_generation_prompt: bool = True, options=None) -> list[int]:
        text = "".join(m.text() for m in messages)
        return [3 + ord(c) % (VOCAB - 3) for c in text[:64]] or [3]

    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ord(c) % (VOCAB - 3) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [self.token_str(t) for t in token_ids]

    def token_str(self, token_id: int) -> str:
        return f"<{token_id}>"

    async def list_models(self) -> llm_pb2.ListModelsResponse:
        return llm_pb2.ListModelsResponse(models=[llm_pb2.ModelInfo(id=self.model_id, max_model_len=MAX_MODEL_LEN)])

    async def load_lora_adapter(self, name: str, path: str) -> llm_pb2.LoadLoRAAdapterResponse:
        check_adapter(name, path, self.model_id)  # the router's own checks of the name and path
        return llm_pb2.LoadLoRAAdapterResponse(lora_name=name, rank=8, workers=["fake:1"])

    async def unload_lora_adapter(self, name: str) -> None:
        raise NotFoundError("lora_name", f"LoRA adapter {name!r} is not loaded")

    async def model_ids(self) -> list[str]:
        return [m.id for m in (await self.list_models()).models]

    async def max_model_len(self) -> int:
        return MAX_MODEL_LEN

    async def healthy(self) -> bool:
        return True

    def generate(self, request: llm_pb2.GenerateRequest):
        self.requests.append(request)
        return self._generate(request)

    async def _generate(self, request: llm_pb2.GenerateRequest):
        params = params_from_proto(request.params)
        prompt = prompt_from_request(request)
        ids = [3 + ord(c) % (VOCAB - 3) for c in prompt] if isinstance(prompt, str) else prompt
        if any(t >= VOCAB for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"every token id must be an integer in [0, {VOCAB})")
        if len(ids) >= MAX_MODEL_LEN:
            raise InvalidRequestError("prompt", f"has {len(ids)} tokens but max_model_len is {MAX_MODEL_LEN}")
        n = min(params.max_tokens, self.tokens_per_request)
        finished = False
        try:
            for i in range(n):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                last = i == n - 1
                msg = llm_pb2.GenerateResponse(request_id=request.request_id, text="a", token_ids=[5])
                if last:
                    msg.finish_reason = "length"
                    msg.usage.CopyFrom(llm_pb2.Usage(prompt_tokens=len(ids), completion_tokens=n))
                    finished = True
                yield msg
        finally:
            if not finished:
                self.cancelled += 1
