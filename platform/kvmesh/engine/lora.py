"""Which LoRA adapter a request runs under, as the torch-free engine sees it.

The engine only needs an adapter's identity: `name` groups rows of a step by adapter and
caps how many distinct adapters one step batches (`LoRAConfig.max_loras`); `key`, the
adapter's content fingerprint, is mixed into the request's block hashes (engine/hashing.py)
so the prefix cache never shares KV across adapters. Weights live in the worker
(worker/lora.py); a request reaches the engine only once its adapter is in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    name: str
    key: str
