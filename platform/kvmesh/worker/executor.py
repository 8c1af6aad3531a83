"""The engine's ModelExecutor (engine.interfaces) for one model on one device: a
ModelRunner plus an optional speculative proposer.

Draft distributions travel from `propose` to the next `execute` inside the executor:
the engine sees draft token ids only.
"""

from __future__ import annotations

import torch

from kvmesh.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmesh.engine.request import Request
from kvmesh.engine.structured_outputs import StructuredOutputsParams
from kvmesh.errors import InvalidRequestError
from kvmesh.worker.lora import LoRAManager
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.parallel import ParallelRunner
from kvmesh.worker.spec_decode import DraftModelProposer, NgramProposer

Proposer = NgramProposer | DraftModelProposer


class Executor:
    def __init__(self, runner: ModelRunner | ParallelRunner, proposer: Proposer | None = None):
        self.runner = runner
        self.proposer = proposer
        self.num_blocks = runner.num_blocks
        self.block_size = runner.block_size
        self.proposer_method = proposer.method if proposer is not None else None
        self._draft_probs: dict[str, torch.Tensor | None] = {}

    @property
    def lora(self) -> LoRAManager | None:
        """The engine's LoRAHost (engine/lora.py) when LoRA is on."""
        return self.runner.lora

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        probs, self._draft_probs = self._draft_probs, {}
        return self.runner.execute(sched, draft_probs=probs)

    def propose(self, requests: list[Request], block_tables: dict[str, list[int]], k: int) -> dict[str, list[int]]:
        if self.proposer is None:
            return {}
        out = {}
        for rid, prop in self.proposer.propose(requests, block_tables, k).items():
            out[rid] = prop.token_ids
            self._draft_probs[rid] = prop.probs
        return out

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile the spec now (cached for the steps): InvalidRequestError if it cannot be."""
        if self.runner.grammar is None:
            raise InvalidRequestError("structured_outputs", "this worker was built without a grammar engine")
        self.runner.grammar.compiler.compile(spec)

    def forget(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        self.runner.forget(request_id)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.runner.write_blocks(block_ids, data)

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): a tensor-parallel runner's group can be down (worker/parallel.py)."""
        check = getattr(self.runner, "health", None)
        return check() if check is not None else (True, "")

    def close(self) -> None:
        """Stop what runs beside this process (a tensor-parallel group's rank processes)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
