"""A request as the scheduler sees it: token ids and how many of them have KV computed.

Progress is counted in tokens, not phases: a request needs compute while
`num_computed_tokens < num_tokens`. Prefill, chunked prefill, decode and recompute
after preemption are all that one rule.
"""

from __future__ import annotations

import enum
import time

from kvmesh.engine.lora import LoRARequest
from kvmesh.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # A choice of an n > 1 request waiting for its first choice's prompt KV to fork from.
    WAITING_FOR_FORK = "waiting_for_fork"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
        lora: LoRARequest | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # Every id that ends the generation unless ignore_eos: eos_token_id and the model's others.
        self.eos_ids = frozenset(t for t in (eos_token_id, *eos_token_ids) if t is not None)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        # Invariant: all_token_ids == prompt_token_ids + output_token_ids.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Chained hashes of the full blocks of all_token_ids (grown lazily), rooted at the
        # request's cache salt: prefix hits never cross salts (tenants).
        self.block_hashes: list[bytes] = []
        self.cache_salt = sampling_params.cache_salt
        # The LoRA adapter the request runs under (None: the base model); its content key
        # roots the block hashes too, so prefix hits never cross adapters.
        self.lora = lora
        # Tokens served from the prefix cache when first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        # Draft tokens proposed for the next step (verified by the target, then cleared).
        self.spec_token_ids: list[int] = []
        self.num_spec_proposed = 0
        self.num_spec_accepted = 0
        # Recent draft acceptance (EMA), starting optimistic; drives adaptive speculation.
        self.spec_acceptance_ema = 1.0
        # Keep the KV blocks after finishing (until released) instead of freeing them.
        self.hold_kv = False
        self.held_block_ids: list[int] | None = None
        # Choices 1.. of an n > 1 request fork choice 0's (`parent_id`'s) prompt blocks.
        self.parent_id: str | None = None

    @property
    def lora_key(self) -> str:
        return self.lora.key if self.lora is not None else ""

    @property
    def lora_name(self) -> str | None:
        return self.lora.name if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
