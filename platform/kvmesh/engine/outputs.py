"""Typed boundary objects between scheduler, model runner and API layer (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute `token_ids` at positions start_pos.. ."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    # The request's whole block table; append-only while the request runs.
    block_ids: list[int]
    # True when this chunk ends at the request's last known token, so the step
    # samples its next token. False for a prefill chunk that stops mid-prompt.
    sample: bool
    sampling_params: SamplingParams
    # Read-only views for penalties (prompt + output so far).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Draft tokens appended to token_ids for verification (the last len() of them).
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter the rows run under (None: the base model).
    lora_name: str | None = None
    # Token ids the sampled token must not be (EOS and stop_token_ids while the request has
    # fewer than min_tokens output tokens); empty for almost every row.
    banned_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    # Requests that left the engine since the previous step: the runner drops any
    # per-request state (e.g. seeded generators) it holds for them.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token plus the top-n alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens [start, start + len(items)) given their prefixes, from one
    prefill chunk (the logits at position j score prompt token j + 1, so start >= 1)."""

    start: int
    items: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    # Per sampling request: the new tokens (one, or with speculation the accepted
    # drafts plus one corrected / bonus token).
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Raw (V,) logits per sampled request; only when the runner is asked (tests, debug).
    logits: dict[str, object] | None = None
    # (V,) sampling distributions per sampled request (draft models; when asked).
    probs: dict[str, object] | None = None
    # Per request that asked for prompt_logprobs and computed prompt positions this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string hit
    logprobs: list[TokenLogprobs] | None = None
    # What this output adds to the previous one of the same request (streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # For requests added with hold_kv: the block table kept after finishing (the KV
    # of every token but the last), to be read and then `release_kv`-ed.
    held_block_ids: list[int] | None = None
    # Which choice of an n > 1 request this output belongs to (its outputs[0].index too);
    # every choice streams its own outputs and finishes on its own (`finished`).
    index: int = 0
    # With prompt_logprobs: one entry per prompt token (None for the first, which has no
    # prefix), on the first output of each choice only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
