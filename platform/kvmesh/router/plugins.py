"""Routing plugins, after llm-d's scheduling framework: Filters narrow the candidate
workers, Scorers rate each in [0, 1] (weighted by config), a Picker chooses, and a
Decider says whether a request goes prefill -> decode or straight to one worker.

Plugins register by name in PLUGINS; RouterConfig refers to them by name. Adding
one is a class plus a decorator, never an if/elif in the router.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # plugins are pure: RouterConfig (and the operator) validate names without grpc
    from kvmesh.router.registry import WorkerHandle

# prefill: the P/D prefill phase; decode: the P/D decode phase or a direct request.
Stage = Literal["prefill", "decode"]


@dataclass
class RouteRequest:
    """What plugins see of a request."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes]  # chained hashes of the prompt's full blocks
    block_size: int
    stage: Stage = "decode"
    exclude: set[str] = field(default_factory=set)  # addresses that already failed it
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)


class Filter(Protocol):
    def filter(self, req: RouteRequest, workers: list[WorkerHandle]) -> list[WorkerHandle]: ...


class Scorer(Protocol):
    def score(self, req: RouteRequest, workers: list[WorkerHandle]) -> list[float]:
        """One score in [0, 1] per worker (1 = best), in the order given."""
        ...


class Picker(Protocol):
    def pick(self, req: RouteRequest, scored: list[tuple[WorkerHandle, float]]) -> WorkerHandle: ...


class Decider(Protocol):
    def use_pd(self, req: RouteRequest, prefill: list[WorkerHandle], decode: list[WorkerHandle]) -> bool:
        """True: prefill on one of `prefill`, decode on one of `decode`."""
        ...


PLUGINS: dict[str, dict[str, Callable[..., object]]] = {"filter": {}, "scorer": {}, "picker": {}, "decider": {}}


def register(kind: str, name: str):
    def deco(cls):
        PLUGINS[kind][name] = cls
        return cls

    return deco


def make(kind: str, name: str, **kwargs) -> object:
    return PLUGINS[kind][name](**kwargs)


# -- filters ---------------------------------------------------------------------


@register("filter", "healthy")
class HealthyFilter:
    """Workers that answered Stats, serve the router's model, are not in cooldown and
    have not already failed this request."""

    def filter(self, req, workers):
        return [w for w in workers if w.healthy() and w.address not in req.exclude]


_STAGE_ROLES: dict[str, tuple[str, ...]] = {"prefill": ("prefill",), "decode": ("decode", "unified")}


@register("filter", "role")
class RoleFilter:
    """Workers whose role fits the stage. When none fits, every worker stays: any
    worker can serve any RPC, and a slower answer beats UNAVAILABLE."""

    def filter(self, req, workers):
        fit = [w for w in workers if w.role in _STAGE_ROLES[req.stage]]
        return fit or workers


@register("filter", "lora")
class LoRAFilter:
    """For a LoRA request, the workers that serve adapters at all (`--enable-lora`). When
    none does, every worker stays: the worker's refusal then says what to change."""

    def filter(self, req, workers):
        if req.lora is None:
            return workers
        fit = [w for w in workers if w.lora_enabled]
        return fit or workers


# -- scorers ---------------------------------------------------------------------


@register("scorer", "prefix")
class PrefixScorer:
    """Fraction of the prompt's full blocks the worker likely holds (what this router
    sent there, plus the cached hashes it reported)."""

    def score(self, req, workers):
        n = len(req.block_hashes)
        return [w.prefix_blocks(req.block_hashes) / n if n else 0.0 for w in workers]


@register("scorer", "precise_prefix")
class PrecisePrefixScorer:
    """Fraction of the prompt's full blocks the worker holds, from its KV events (the
    exact index, router.kv_index): no guessing from past routing, no stale evictions."""

    def score(self, req, workers):
        n = len(req.block_hashes)
        return [w.kv_index.prefix_blocks(req.block_hashes) / n if n else 0.0 for w in workers]


@register("scorer", "lora_affinity")
class LoRAAffinityScorer:
    """For a LoRA request: 1 where the adapter is resident on the device, 0.75 where it is
    in host memory (or this router just sent it there), 0 where the worker would first read
    it from disk (load-on-miss). Every worker serves the base model: 1 for all."""

    def score(self, req, workers):
        if req.lora is None:
            return [1.0] * len(workers)
        return [w.lora_level(req.lora) for w in workers]


@register("scorer", "queue")
class QueueScorer:
    """Shorter queue scores higher: min-max normalized over the candidates."""

    def score(self, req, workers):
        loads = [w.load for w in workers]
        lo, hi = min(loads, default=0), max(loads, default=0)
        if hi == lo:
            return [1.0] * len(workers)
        return [(hi - x) / (hi - lo) for x in loads]


@register("scorer", "kv_free")
class KVFreeScorer:
    """Fraction of free KV blocks (free includes evictable cached blocks)."""

    def score(self, req, workers):
        return [w.stats.num_free_blocks / max(w.stats.num_usable_blocks, 1) for w in workers]


# -- pickers ---------------------------------------------------------------------


@register("picker", "max_score")
class MaxScorePicker:
    """Highest score; ties rotate so equal workers share the load."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, req, scored):
        best = max(s for _, s in scored)
        tied = sorted((w for w, s in scored if s >= best - 1e-9), key=lambda w: w.address)
        self._turn += 1
        return tied[self._turn % len(tied)]


@register("picker", "round_robin")
class RoundRobinPicker:
    """Ignores scores (the baseline prefix-aware routing is compared against)."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, req, scored):
        ordered = sorted((w for w, _ in scored), key=lambda w: w.address)
        self._turn += 1
        return ordered[self._turn % len(ordered)]


@register("picker", "random")
class RandomPicker:
    def pick(self, req, scored):
        return random.choice([w for w, _ in scored])


# -- P/D deciders ----------------------------------------------------------------


@register("decider", "pd_threshold")
class ThresholdDecider:
    """Disaggregate only when enough of the prompt is uncached on the best decode
    candidate: a short uncached tail is cheaper to prefill in place than to move."""

    def __init__(self, threshold_tokens: int = 256) -> None:
        self.threshold_tokens = threshold_tokens

    def use_pd(self, req, prefill, decode):
        if not prefill:
            return False
        cached = max((w.prefix_blocks(req.block_hashes) for w in decode), default=0) * req.block_size
        return len(req.prompt_token_ids) - cached >= self.threshold_tokens


@register("decider", "always")
class AlwaysDecider:
    def __init__(self, threshold_tokens: int = 0) -> None:
        pass

    def use_pd(self, req, prefill, decode):
        return bool(prefill)


@register("decider", "never")
class NeverDecider:
    def __init__(self, threshold_tokens: int = 0) -> None:
        pass

    def use_pd(self, req, prefill, decode):
        return False


def clamp01(x: float) -> float:
    return 0.0 if x < 0 else 1.0 if x > 1 else x


class WorkerScheduler:
    """Runs filters -> scorers -> picker for one stage of one request."""

    def __init__(self, filters: Sequence[Filter], scorers: Sequence[tuple[Scorer, float]], picker: Picker,
                 decider: Decider):
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.decider = decider

    @classmethod
    def from_config(cls, cfg) -> "WorkerScheduler":
        return cls(
            [make("filter", n) for n in cfg.filters],
            [(make("scorer", s.name), s.weight) for s in cfg.scorers],
            make("picker", cfg.picker),
            make("decider", cfg.decider, threshold_tokens=cfg.pd_threshold_tokens),
        )

    def candidates(self, req: RouteRequest, workers: list[WorkerHandle]) -> list[WorkerHandle]:
        for f in self.filters:
            workers = f.filter(req, workers)
        return workers

    def pick(self, req: RouteRequest, workers: list[WorkerHandle]) -> WorkerHandle | None:
        cands = self.candidates(req, workers)
        if not cands:
            return None
        totals = [0.0] * len(cands)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(req, cands)):
                totals[i] += weight * clamp01(s)
        return self.picker.pick(req, list(zip(cands, totals)))

    def use_pd(self, req: RouteRequest, workers: list[WorkerHandle]) -> bool:
        healthy = [w for w in workers if w.healthy()]
        prefill = [w for w in healthy if w.role == "prefill"]
        decode = [w for w in healthy if w.role in _STAGE_ROLES["decode"]]
        return self.decider.use_pd(req, prefill, decode)
