"""What the engine needs from the world, as protocols: a model executor, KV loaders and a
KV store connector. The engine holds only these; `kvmesh.build` constructs the real
ones (worker.executor.Executor, worker.kv_connector.StoreConnector, ...) and passes them
in, so the engine stays torch-free at import and at construction, and tests can drive it
with fakes.

Invariants every implementation keeps:
- methods are called from one thread at a time (the engine's step thread);
- block ids are the engine's (kv_cache_manager) ids; the executor never allocates;
- KV payloads returned by `read_blocks` are opaque to the engine: it only hands them
  back to `write_blocks` or to a connector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmesh.engine.request import Request
from kvmesh.engine.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that the bookkeeping needs (no tensors)."""

    path: str  # checkpoint folder
    fingerprint: str  # roots every KV block hash (see checkpoint.files.model_fingerprint)
    vocab_size: int
    max_model_len: int  # prompt + output tokens per request, already fitted to the cache
    eos_token_id: int | None
    # Every id that ends a generation (eos_token_id first): chat models list more than one in
    # config.json / generation_config.json (Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>).
    eos_token_ids: tuple[int, ...] = ()
    # The window when every layer slides (ArchConfig.kv_window): KV blocks wholly before a
    # request's window are freed while it runs (engine/kv_cache_manager.py). None: kept.
    kv_window: int | None = None


class ModelExecutor(Protocol):
    """Runs scheduled steps on a model with a paged KV cache of `num_blocks` blocks."""

    num_blocks: int
    block_size: int
    #: "ngram" / "draft" when the executor can propose draft tokens, else None.
    proposer_method: str | None

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: write the scheduled tokens' KV, sample (or verify drafts)."""
        ...

    def propose(self, requests: list[Request], block_tables: dict[str, list[int]], k: int) -> dict[str, list[int]]:
        """Up to `k` draft tokens per decoding request; the next `execute` verifies them."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop per-request state (draft state, generators, grammar matchers) of a finished request."""
        ...

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError when `spec` cannot be compiled (called at admission, so
        the steps only ever meet compiled specs). Optional: an executor without it refuses specs."""
        ...

    def read_blocks(self, block_ids: list[int]) -> Any:
        """A copy of those blocks' KV, shape (layers, 2, n, block_size, kv_heads, head_dim)."""
        ...

    def write_blocks(self, block_ids: list[int], data: Any) -> None:
        """Inverse of read_blocks."""
        ...

    def health(self) -> tuple[bool, str]:
        """(healthy, why not). Optional: an executor without it is always healthy (a
        tensor-parallel one is not once a rank died)."""
        ...

    def close(self) -> None:
        """Release what lives outside this process (rank processes). Optional."""
        ...


class KVLoader(Protocol):
    """Source of KV computed elsewhere (a shared store, a prefill worker).

    At admission the scheduler asks how many tokens past the local prefix-cache hit
    the loader can supply, allocates blocks for them, and has the loader write them
    before the step runs; those tokens then count as computed. Injected by the
    builder, so the scheduler stays free of tensors and I/O.
    """

    def lookup(self, request: Request, num_local_tokens: int) -> int:
        """Tokens after the first `num_local_tokens` that can be loaded (may be 0)."""
        ...

    def load(self, request: Request, block_ids: list[int], start: int, num_tokens: int) -> int:
        """Write KV of tokens [start, start + num_tokens) into the request's blocks
        (`block_ids` is its whole table); returns how many tokens were really loaded
        (a prefix of the promised ones; fewer on a fault)."""
        ...


class KVConnector(KVLoader, Protocol):
    """A shared KV block store seen from the engine: loads at admission (KVLoader),
    saves new full prompt blocks after each step, pins prompts."""

    def save_after_step(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Queue this step's newly completed full prompt blocks for the store (never blocks)."""
        ...

    def pin_prompt(self, token_ids: list[int], block_ids: list[int]) -> list[bytes]:
        """Write a prompt's full blocks to the store without TTL and pin them; returns their keys."""
        ...

    def unpin(self, keys: list[bytes]) -> None:
        """Give pinned keys back their TTL."""
        ...

    def forget(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float]: ...
