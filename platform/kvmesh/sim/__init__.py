"""Trace-driven fleet simulator: N workers, each running kvmesh's real scheduler, KV cache
manager and prefix cache on a step-time model, routed by the real router plugins on a
simulated clock. Torch-free (import-linter enforces it); `kvmesh sim` is its command.
"""
