"""kvmesh: a paged-KV, continuously batched LLM engine and serving platform.

The heavy entry points are imported lazily so that `import kvmesh.engine.scheduler`
(pure bookkeeping) never pulls in torch.
"""

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError, KVMeshError

__all__ = [
    "SamplingParams",
    "InvalidRequestError",
    "KVMeshError",
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "EngineConfig",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from kvmesh.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvmesh.engine.engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from kvmesh.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    if name == "EngineConfig":
        from kvmesh.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
