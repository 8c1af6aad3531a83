"""Typed router configuration (pydantic), shared by the CLI, `kvmesh serve --local` and
(later) the CRD's `spec.router`. Plugin names are checked against the registry when
the config is built, so a typo fails at startup with the list of valid names."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh.router.plugins import PLUGINS
from kvmesh.router.ratelimit import RateLimitConfig


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ScorerWeight(_Base):
    name: str = Field(description="Registered scorer name: prefix, precise_prefix, queue, kv_free, lora_affinity.")
    weight: float = Field(1.0, ge=0, description="Weight of this scorer's [0, 1] score in the sum.")


class RouterConfig(_Base):
    filters: list[str] = Field(
        default_factory=lambda: ["healthy", "role", "lora"],
        description="Filters applied in order to the candidate workers.",
    )
    scorers: list[ScorerWeight] = Field(
        default_factory=lambda: [ScorerWeight(name="prefix", weight=2.0), ScorerWeight(name="queue", weight=1.0),
                                 ScorerWeight(name="kv_free", weight=0.5),
                                 ScorerWeight(name="lora_affinity", weight=1.0)],
        description="Weighted scorers; a worker's score is the weighted sum. lora_affinity (weight 1) sends an "
        "adapter's requests to the workers holding it while load is even; once those are the busiest, the queue "
        "scorer ties with it and the adapter spreads to another worker (loaded there on first use).",
    )
    picker: str = Field("max_score", description="How to pick among scored workers: max_score, round_robin, random.")
    decider: str = Field(
        "pd_threshold", description="When to disaggregate: pd_threshold, always (when prefill workers exist), never."
    )
    pd_threshold_tokens: int = Field(
        256, ge=0,
        description="P/D is skipped (the decode worker prefills locally) when fewer prompt tokens than this are "
        "not already cached on the chosen decode worker.",
    )
    stats_interval_s: float = Field(0.5, gt=0, description="How often workers' Stats are polled.")
    stats_timeout_s: float = Field(2.0, gt=0, description="Stats call timeout; a late answer keeps the previous stats, an unreachable worker is skipped.")
    max_block_hashes: int = Field(4096, ge=0, description="Cached-block hashes asked from each worker per poll.")
    affinity_capacity: int = Field(
        65536, ge=0, description="Block hashes remembered per worker from the router's own routing decisions."
    )
    kv_events: bool = Field(
        True, description="Ask workers for KV events (stored / evicted block hashes) on each Stats poll, for the "
        "exact per-worker index the precise_prefix scorer reads.",
    )
    max_attempts: int = Field(3, ge=1, description="Workers tried per request phase before UNAVAILABLE.")
    max_prompt_chars: int = Field(
        1_000_000, ge=1,
        description="Longest text prompt accepted, in characters, checked before tokenizing (which runs off the "
        "event loop); longer ones get INVALID_ARGUMENT. The token limit (max_model_len) is checked after.",
    )
    unhealthy_cooldown_s: float = Field(2.0, ge=0, description="A failed worker is skipped this long.")
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig,
                                        description="Per-API-key requests / tokens per minute (token buckets).")

    @model_validator(mode="after")
    def _check_plugins(self) -> "RouterConfig":
        checks = [("filters", "filter", self.filters), ("picker", "picker", [self.picker]),
                  ("decider", "decider", [self.decider]),
                  ("scorers", "scorer", [s.name for s in self.scorers])]
        for field, kind, names in checks:
            for name in names:
                if name not in PLUGINS[kind]:
                    raise ValueError(f"{field}: unknown {kind} {name!r}; registered: {sorted(PLUGINS[kind])}")
        return self
