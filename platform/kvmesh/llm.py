"""Offline batch API: `LLM(...).generate(prompts, params)`, like vLLM's."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tqdm import tqdm

from kvmesh.build import build_engine
from kvmesh.compress import CompressionOptions, compress_prompt, parse_options
from kvmesh.config import EngineConfig
from kvmesh.engine.lora import LoRAInfo
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError


class LLM:
    """Loads a model once and generates for whole lists of prompts with continuous batching.

    `LLM()` serves the embedded model; keyword arguments are EngineConfig fields
    (model, dtype, device, max_model_len, block_size, num_blocks, max_num_seqs, ...), or
    `config=` a whole EngineConfig (what the CLI's engine flags build).
    """

    def __init__(self, model: str | None = None, progress: bool = True, config: EngineConfig | None = None, **kwargs):
        if config is not None and (model is not None or kwargs):
            raise ValueError("LLM: pass either config=EngineConfig(...) or model and EngineConfig keyword arguments")
        if config is None:
            # An offline batch runs at full speed from its first step: the KV cache is mapped
            # before it starts, as vLLM's zeroed cache (served workers map it in the background).
            kwargs.setdefault("kv_cache_populate", "startup")
            config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = build_engine(config, progress=progress)
        self._counter = 0

    def close(self) -> None:
        """Stop the engine's rank processes (tensor parallel); garbage collection does it too."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Load a PEFT adapter folder under `name` (LoRA on: `LLM(..., lora=LoRAConfig(...))`);
        requests then select it with `generate(..., lora_request=name)`."""
        return self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> bool:
        return self.engine.unload_lora(name)

    def list_loras(self) -> list[LoRAInfo]:
        return self.engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt prefixes (as vLLM's `LLM.reset_prefix_cache`); True if done."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        compression: CompressionOptions | dict | Sequence[CompressionOptions | dict | None] | None = None,
        lora_request: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in input order, one
        RequestOutput per prompt with `n` completions in `outputs` (by index, as vLLM).

        `compression` (kvmesh.compress.CompressionOptions or a dict, applied to every
        prompt, or a list with one entry or None per prompt) compresses the
        `<context>...</context>` spans of text prompts first. `lora_request`: the LoRA
        adapter to run under, by name, for every prompt or one (or None: the base model) per
        prompt, as vLLM's `lora_request`.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        if not isinstance(compression, (list, tuple)):
            compression = [compression] * len(prompts)
        if len(compression) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(compression)} compression options")
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, str) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora_request entries")
        ids = []
        try:
            for prompt, p, c, lora in zip(prompts, params, compression, loras):
                self._counter += 1
                ids.append(self._add(f"llm-{self._counter}", prompt, p or SamplingParams(), c, lora))
        except Exception:
            self.engine.abort(ids)
            raise
        return self._run(ids, [(p or SamplingParams()).n for p in params], use_tqdm)

    def _add(self, request_id: str, prompt, params: SamplingParams,
             compression: CompressionOptions | dict | None, lora: str | None = None) -> str:
        if compression is None:
            return self.engine.add_request(request_id, prompt, params, lora=lora)
        # Compression runs before the request is queued: its time counts in TTFT.
        arrival = time.monotonic()
        opts = parse_options(compression)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("compression", "needs a text prompt with <context>...</context> spans")
        original = len(self.engine.encode(prompt))
        text = compress_prompt(prompt, opts, tokenizer=self.engine.tokenizer).text
        return self.engine.add_request(request_id, text, params, arrival_time=arrival, original_prompt_tokens=original,
                                       lora=lora)

    def _run(self, ids: list[str], ns: list[int], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        prompt_lps: dict[str, list] = {}
        left = dict(zip(ids, ns))
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_lps.setdefault(out.request_id, out.prompt_logprobs)
                if out.finished:
                    done[out.request_id].append(out)
                    left[out.request_id] -= 1
                    bar.update(left[out.request_id] == 0)
        bar.close()
        return [_merge_choices(done[i], prompt_lps.get(i)) for i in ids]


def _merge_choices(finals: list[RequestOutput], prompt_logprobs: list | None) -> RequestOutput:
    """One RequestOutput of a prompt: its choices' completions in index order, the prompt
    logprobs (delivered on a choice's first output) attached."""
    finals = sorted(finals, key=lambda o: o.index)
    first = finals[0]
    first.outputs = [o.outputs[0] for o in finals]
    first.prompt_logprobs = prompt_logprobs
    return first
