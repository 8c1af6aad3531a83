"""The router: public `kvmesh.v1.LLM` service in front of kvmesh workers.

It tokenizes, hashes the prompt's blocks (the same chained hashes the workers' prefix
caches use), scores workers with pluggable filters / scorers / pickers, decides
between the disaggregated prefill -> decode path and a direct call, and streams the
result back. No torch import: a router is a small process.
"""

from kvmesh.router.config import RouterConfig, ScorerWeight

__all__ = ["RouterConfig", "ScorerWeight"]
