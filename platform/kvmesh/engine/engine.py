"""LLMEngine: the synchronous core. step() = schedule -> execute -> update -> outputs.

Requests enter with `add_request` (validated and tokenized here, so bad input fails
before it touches the scheduler), progress one step at a time, and leave when they
stop, hit a limit or are aborted; their KV blocks go back to the pool either way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler, StepResult
from kvmesh.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from kvmesh.compress.options import CompressionOptions

logger = logging.getLogger(__name__)

# Adaptive speculation: below this recent acceptance a request only probes.
SPEC_MIN_ACCEPTANCE = 0.3
SPEC_PROBE_EVERY = 8


@dataclass
class _OutputState:
    """Per-request state of the output side (text, logprobs)."""

    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    token_ids: list[int] = field(default_factory=list)
    original_prompt_tokens: int | None = None  # before compression; None: not compressed


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True):
        import torch

        from kvmesh.models.loader import load_model, load_tokenizer, model_fingerprint, resolve_model_path
        from kvmesh.quant.loader import quantization_id
        from kvmesh.worker.model_runner import _DTYPES, KVCacheSpec, ModelRunner

        self.config = config = config or EngineConfig()
        mc, cc, sc = config.model, config.cache, config.scheduler
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = torch.device(mc.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("model.device: CUDA requested but torch sees no GPU; use --device cpu")
        self.model_path = resolve_model_path(mc.model, progress=progress)
        self.tokenizer = load_tokenizer(self.model_path if mc.tokenizer is None else resolve_model_path(mc.tokenizer))
        dtype = _DTYPES[mc.dtype]

        from kvmesh.models.loader import load_arch_config

        arch = load_arch_config(self.model_path)
        limit = arch.max_position_embeddings
        if arch.sliding_window:
            # The reference backend has no sliding-window attention: stay inside it.
            limit = min(limit, arch.sliding_window)
        if mc.max_model_len is not None and mc.max_model_len > arch.max_position_embeddings:
            raise ConfigError(
                f"model.max_model_len: {mc.max_model_len} exceeds the model's "
                f"max_position_embeddings ({arch.max_position_embeddings})"
            )
        max_model_len = mc.max_model_len or limit

        self.model, self.arch = load_model(self.model_path, dtype, device, max_model_len + 1,
                                           mc.quantization, mc.quantization_group_size)
        spec = KVCacheSpec(arch.num_layers, cc.block_size, arch.num_kv_heads, arch.head_dim, dtype)
        num_blocks = cc.num_blocks or self._auto_num_blocks(spec, device)
        capacity = (num_blocks - 1) * cc.block_size
        if capacity < max_model_len:
            if mc.max_model_len is not None:
                raise ConfigError(
                    f"cache: {num_blocks} blocks of {cc.block_size} tokens hold {capacity} tokens, "
                    f"less than max_model_len={max_model_len}; raise cache.num_blocks / "
                    "kv_cache_memory_gb or lower max_model_len"
                )
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.fingerprint = model_fingerprint(
            self.model_path, {"dtype": mc.dtype, "block_size": cc.block_size,
                              "quantization": quantization_id(self.model_path, mc.quantization,
                                                              mc.quantization_group_size)}
        )
        self.kv_manager = KVCacheManager(num_blocks, cc.block_size, self.fingerprint, cc.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, sc.max_num_seqs, sc.max_num_batched_tokens, max_model_len)
        self.runner = ModelRunner(self.model, arch, cc.block_size, num_blocks, device, seed=mc.seed,
                                  attention_backend=config.attention_backend)
        self.eos_token_id = self._eos_token_id()
        self._states: dict[str, _OutputState] = {}
        # Outputs of other requests produced while cache_prompt drove the engine.
        self._buffered: list[RequestOutput] = []
        # name -> (hold id, store keys of its full blocks, expiry or None)
        self._pinned: dict[str, tuple[str, list[bytes], float | None]] = {}
        self.kv_connector = None
        if config.kv_store:
            from kvmesh.kvstore import BlockCodec, create_store
            from kvmesh.kvstore.connector import StoreConnector

            codec = BlockCodec(self.fingerprint, mc.dtype, cc.block_size, arch.num_layers,
                               arch.num_kv_heads, arch.head_dim)
            self.kv_connector = StoreConnector(create_store(config.kv_store), codec, self.kv_manager,
                                               self.runner, config.kv_store_ttl_s)
            self.scheduler.kv_loader = self.kv_connector
        self.proposer = None
        self._draft_probs: dict = {}
        self.spec_counters = {"proposed": 0, "accepted": 0, "verify_steps": 0}
        if config.speculative is not None:
            self.proposer = self._build_proposer(config.speculative, dtype, device, max_model_len, num_blocks)
        for entry in config.prompt_cache:
            self.cache_prompt(entry.name, entry.text if entry.text is not None else entry.token_ids, entry.ttl_s)
        logger.info("kvmesh engine: %s, %d KV blocks x %d tokens, max_model_len %d",
                    self.model_path, num_blocks, cc.block_size, max_model_len)

    def _build_proposer(self, spec, dtype, device, max_model_len: int, num_blocks: int):
        from kvmesh.worker.spec_decode import DraftModelProposer, NgramProposer

        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
        from kvmesh.models.loader import load_model, resolve_model_path
        from kvmesh.worker.model_runner import ModelRunner

        if spec.model == "self" and spec.quantization is None:
            draft, arch = self.model, self.arch  # shares weights; only the KV cache is separate
        else:
            # A quantized copy of the target ("self" + quantization) is a cheap, well
            # aligned draft; any other folder must share the target's tokenizer.
            path = self.model_path if spec.model == "self" else resolve_model_path(spec.model)
            draft, arch = load_model(path, dtype, device, max_model_len + spec.num_speculative_tokens + 1,
                                     quantization=spec.quantization)
            if arch.vocab_size != self.arch.vocab_size:
                raise ConfigError(
                    f"speculative.model: draft vocab {arch.vocab_size} != target vocab "
                    f"{self.arch.vocab_size}; a draft must share the target's tokenizer")
        runner = ModelRunner(draft, arch, self.kv_manager.block_size, num_blocks, device,
                             seed=self.config.model.seed + 1, attention_backend=self.config.attention_backend)
        return DraftModelProposer(runner, spec.num_speculative_tokens)

    def _propose(self) -> None:
        """Draft tokens for the next step of every request that is decoding."""
        spec = self.config.speculative
        running = self.scheduler.running
        if self.proposer is None or not running or len(running) > spec.max_batch_size:
            return
        k = spec.num_speculative_tokens
        # Adaptive: a request whose recent drafts were mostly rejected stops paying for
        # verification, except for a probe every SPEC_PROBE_EVERY tokens to notice
        # when its text turns predictable again (e.g. starts quoting its input).
        cands = [r for r in running
                 if r.num_computed_tokens == r.num_tokens - 1 and r.sampling_params.can_speculate
                 and r.num_output_tokens < r.sampling_params.max_tokens - 1
                 and (r.spec_acceptance_ema >= SPEC_MIN_ACCEPTANCE or r.num_output_tokens % SPEC_PROBE_EVERY == 0)]
        if self.proposer.method == "draft":
            # The draft writes KV at the k draft positions: reserve the target's slots
            # now (the next schedule needs exactly these for 1 + k tokens anyway).
            cands = [r for r in cands if self.kv_manager.allocate_slots(r, 1 + k) is not None]
        if not cands:
            return
        tables = {r.request_id: self.kv_manager.get_block_ids(r.request_id) for r in cands}
        for rid, prop in self.proposer.propose(cands, tables, k).items():
            self.scheduler.requests[rid].spec_token_ids = prop.token_ids
            self._draft_probs[rid] = prop.probs

    @classmethod
    def from_kwargs(cls, progress: bool = True, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs), progress=progress)

    def _auto_num_blocks(self, spec, device) -> int:
        import torch

        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * self.config.cache.kv_cache_memory_fraction)
        else:
            budget = int(self.config.cache.kv_cache_memory_gb * (1 << 30))
        return max(budget // spec.bytes_per_block, 2)

    def _eos_token_id(self) -> int | None:
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.arch.eos_token_ids[0] if self.arch.eos_token_ids else None

    # -- input ------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation under the checkpoint's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        hold_kv: bool = False,
        compression: CompressionOptions | dict | None = None,
    ) -> str:
        """Validate, tokenize and queue a request; returns its id.

        `prompt` is text or token ids; `prompt_text` labels a pre-tokenized prompt
        with its text in the outputs. With `hold_kv` the request's KV blocks outlive it
        (see RequestOutput.held_block_ids) until `release_kv(request_id)`.
        `compression` (kvmesh.compress.CompressionOptions or a dict) compresses the
        `<context>...</context>` spans of a text prompt first (synchronously: TTFT
        includes it; outputs' metrics then carry `original_prompt_tokens`). None leaves
        the prompt exactly as given.
        """
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._states:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        original_prompt_tokens = None
        if compression is not None:
            from kvmesh.compress import compress_prompt, parse_options

            arrival_time = time.monotonic() if arrival_time is None else arrival_time
            opts = parse_options(compression)
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("compression", "needs a text prompt with <context>...</context> spans")
            original_prompt_tokens = len(self.encode(prompt))
            prompt = compress_prompt(prompt, opts, tokenizer=self.tokenizer).text
        text = prompt if isinstance(prompt, str) else prompt_text
        if prompt is None or (isinstance(prompt, str) and not prompt):
            raise InvalidRequestError("prompt", "must not be empty")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt_ids(ids)
        req = Request(request_id, ids, params, self.eos_token_id, prompt=text, arrival_time=arrival_time)
        req.hold_kv = hold_kv
        self.scheduler.add_request(req)
        self._states[request_id] = _OutputState(
            req, IncrementalDetokenizer(self.tokenizer, ids, params),
            [] if params.logprobs is not None else None, original_prompt_tokens=original_prompt_tokens,
        )
        return request_id

    def validate_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.arch.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"every token id must be an integer in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {len(ids)} tokens but max_model_len is {self.max_model_len}; the prompt must "
                "leave room for at least one output token: shorten it or raise max_model_len",
            )

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._states.pop(rid, None)
            if self.kv_connector is not None:
                self.kv_connector.forget(rid)
            if self.proposer is not None:
                self.proposer.forget(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._buffered)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a hold_kv request kept; False if none are held under the id."""
        return self.kv_manager.release(request_id)

    # -- the step ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that produced tokens."""
        if self._buffered:
            outputs, self._buffered = self._buffered, []
            return outputs
        return self._step_once()

    def _step_once(self) -> list[RequestOutput]:
        self._expire_pins()
        sched = self.scheduler.schedule()
        runner_out = self.runner.execute(sched, draft_probs=self._draft_probs)
        self._draft_probs = {}
        results = self.scheduler.update_from_output(sched, runner_out)
        for seq in sched.seqs:
            if seq.spec_token_ids and seq.request_id in runner_out.sampled_token_ids:
                self.spec_counters["proposed"] += len(seq.spec_token_ids)
                self.spec_counters["accepted"] += len(runner_out.sampled_token_ids[seq.request_id]) - 1
                self.spec_counters["verify_steps"] += 1
        if self.proposer is not None:
            for res in results:
                if res.finished:
                    self.proposer.forget(res.request.request_id)
            self._propose()
        if self.kv_connector is not None and sched.seqs:
            live = dict(self.scheduler.requests)
            live.update((r.request.request_id, r.request) for r in results)
            self.kv_connector.save_after_step(sched, live)
        now = time.monotonic()
        outputs = []
        for res in results:
            state = self._states.get(res.request.request_id)
            if state is None:
                continue
            lp = runner_out.logprobs.get(res.request.request_id)
            if state.logprobs is not None and lp is not None:
                state.logprobs.append(lp)
            outputs.append(self._make_output(state, res, now))
        return outputs

    def _make_output(self, state: _OutputState, res: StepResult, now: float) -> RequestOutput:
        req = state.request
        if req.first_token_time is None:
            req.first_token_time = now
        finished = res.finished
        delta, stop_hit = state.detok.update(res.new_token_ids, finished)
        if stop_hit and not finished:
            self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = state.detok.stop_string
            finished = True
        state.token_ids.extend(res.new_token_ids)
        metrics = {"ttft_s": req.first_token_time - req.arrival_time}
        if state.original_prompt_tokens is not None:
            metrics["original_prompt_tokens"] = state.original_prompt_tokens
        if finished:
            self._states.pop(req.request_id, None)
            metrics["e2e_s"] = now - req.arrival_time
        completion = CompletionOutput(
            index=0,
            text=state.detok.text,
            token_ids=list(state.token_ids),
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            delta_text=delta,
            delta_token_ids=list(res.new_token_ids),
        )
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
            num_cached_tokens=max(req.num_cached_tokens, 0), metrics=metrics,
            held_block_ids=req.held_block_ids if finished else None,
        )

    # -- prompt cache -------------------------------------------------------

    def cache_prompt(self, name: str, prompt: str | list[int], ttl_s: float | None = None) -> int:
        """Compute a prompt's KV once and pin it: its blocks stay referenced locally (never
        evicted; every request starting with this prompt hits them) and its full blocks
        are written to the KV store without TTL. Returns the number of pinned tokens.

        Drives the engine until the prompt is computed; other requests progress too and
        their outputs are returned by the next `step()` calls.
        """
        if not name:
            raise InvalidRequestError("name", "prompt cache entries need a non-empty name")
        self.uncache_prompt(name)
        rid = f"__prompt_cache__:{name}"
        self.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
        final = None
        while final is None:
            for out in self._step_once():
                if out.request_id == rid:
                    final = out if out.finished else None
                else:
                    self._buffered.append(out)
        ids = final.prompt_token_ids
        keys: list[bytes] = []
        if self.kv_connector is not None:
            from kvmesh.engine.hashing import block_hashes
            from kvmesh.kvstore.codec import block_key

            hashes = block_hashes(ids, self.kv_manager.block_size, self.fingerprint)
            keys = [block_key(self.fingerprint, h) for h in hashes]
            self.kv_connector.flush()
            data = self.runner.read_blocks(final.held_block_ids[: len(hashes)])
            from kvmesh.kvstore.connector import block_to_bytes

            items = [(k, self.kv_connector.codec.encode(block_to_bytes(data[:, :, i]))) for i, k in enumerate(keys)]
            self.kv_connector.store.put_many(items, None)
            self.kv_connector.store.pin(keys)
        expires = None if ttl_s is None else time.monotonic() + ttl_s
        self._pinned[name] = (rid, keys, expires)
        return len(ids) // self.kv_manager.block_size * self.kv_manager.block_size

    def uncache_prompt(self, name: str) -> bool:
        """Release a pinned prompt: local blocks become evictable, store keys get a TTL."""
        entry = self._pinned.pop(name, None)
        if entry is None:
            return False
        rid, keys, _ = entry
        self.kv_manager.release(rid)
        if self.kv_connector is not None and keys:
            self.kv_connector.store.unpin(keys, self.config.kv_store_ttl_s)
        return True

    def _expire_pins(self) -> None:
        now = time.monotonic()
        for name, (_, _, expires) in list(self._pinned.items()):
            if expires is not None and now >= expires:
                self.uncache_prompt(name)

    @property
    def pinned_prompts(self) -> list[str]:
        return list(self._pinned)

    # -- introspection ----------------------------------------------------

    def _spec_stats(self) -> dict[str, float]:
        if self.proposer is None:
            return {}
        c = self.spec_counters
        return {
            "spec_method": self.proposer.method,
            "spec_proposed_tokens": c["proposed"],
            "spec_accepted_tokens": c["accepted"],
            "spec_acceptance_rate": c["accepted"] / c["proposed"] if c["proposed"] else 0.0,
            # tokens emitted per verification step (accepted drafts + 1)
            "spec_mean_accepted_length": (c["accepted"] + c["verify_steps"]) / c["verify_steps"]
            if c["verify_steps"] else 0.0,
        }

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.kv_manager.num_usable_blocks

    def stats(self) -> dict[str, float]:
        kv = self.kv_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": kv.num_free_blocks,
            "num_usable_blocks": kv.num_usable_blocks,
            "kv_usage": kv.usage(),
            "prefix_query_tokens": kv.query_tokens,
            "prefix_hit_tokens": kv.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_pinned_prompts": len(self._pinned),
            **self._spec_stats(),
            **(self.kv_connector.stats() if self.kv_connector is not None else {}),
        }
