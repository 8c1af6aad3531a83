"""Routing policies the simulator compares, each a real `router.plugins.WorkerScheduler`
built from a real `RouterConfig` (so every name here is also a valid router config),
except the oracle, whose scorer reads the simulated workers' caches directly.
"""

from __future__ import annotations

from kvmesh.router.config import RouterConfig, ScorerWeight
from kvmesh.router.plugins import MaxScorePicker, WorkerScheduler, make


def _cfg(scorers: list[tuple[str, float]], picker: str = "max_score") -> RouterConfig:
    return RouterConfig(scorers=[ScorerWeight(name=n, weight=w) for n, w in scorers], picker=picker, decider="never")


class OracleScorer:
    """Fraction of the prompt's blocks the worker holds right now (reads its pool: only a
    simulator can). The upper bound for any index a router could keep."""

    def score(self, req, workers):
        n = len(req.block_hashes)
        out = []
        for w in workers:
            pool, hit = w.worker.kv.pool, 0
            for h in req.block_hashes:
                if pool.get_cached_block(h) is None:
                    break
                hit += 1
            out.append(hit / n if n else 0.0)
        return out


# name -> (what it is, its router config)
POLICY_CONFIGS: dict[str, tuple[str, RouterConfig]] = {
    "round_robin": ("every worker in turn", _cfg([], picker="round_robin")),
    "least_load": ("shortest queue (queue scorer)", _cfg([("queue", 1.0)])),
    "prefix": ("prefix affinity alone (approximate: routed + sampled hashes)", _cfg([("prefix", 1.0)])),
    "prefix_load": ("the router's default weights: prefix 2, queue 1, kv_free 0.5 (approximate index)",
                    _cfg([("prefix", 2.0), ("queue", 1.0), ("kv_free", 0.5)])),
    "precise_load": ("exact index from KV events: precise_prefix 2, queue 1, kv_free 0.5",
                     _cfg([("precise_prefix", 2.0), ("queue", 1.0), ("kv_free", 0.5)])),
}
ORACLE = "oracle_load"
POLICIES = [*POLICY_CONFIGS, ORACLE]


def build_policy(name: str, config: RouterConfig | None = None) -> WorkerScheduler:
    """The WorkerScheduler of a named policy; `config` overrides it with any RouterConfig
    (then `name` only labels the run)."""
    if config is not None:
        return WorkerScheduler.from_config(config)
    if name == ORACLE:
        base = POLICY_CONFIGS["precise_load"][1]
        return WorkerScheduler([make("filter", n) for n in base.filters],
                               [(OracleScorer(), 2.0), (make("scorer", "queue"), 1.0),
                                (make("scorer", "kv_free"), 0.5)], MaxScorePicker(), make("decider", "never"))
    if name not in POLICY_CONFIGS:
        raise ValueError(f"unknown policy {name!r}; choose one of {POLICIES}")
    return WorkerScheduler.from_config(POLICY_CONFIGS[name][1])


def build_replicas(name: str, num_routers: int) -> list[WorkerScheduler]:
    """One WorkerScheduler of a named policy per router replica (each keeps its own state)."""
    return [build_policy(name) for _ in range(num_routers)]


def describe(name: str) -> str:
    return "oracle: reads every worker's cache; oracle 2, queue 1, kv_free 0.5" if name == ORACLE \
        else POLICY_CONFIGS[name][0]

