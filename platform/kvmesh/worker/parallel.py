"""Tensor and pipeline parallelism: a worker of tp x pp ranks, each with its shard of the
model (its slice of every layer of its stage's run of layers: worker/pipeline.py) and its
own paged KV cache, that the engine drives as one ModelRunner.

The engine's bookkeeping (scheduler, block tables, prefix hashes) runs once, in rank 0's
process; `ParallelRunner` stands where a ModelRunner stands (inside worker.executor.Executor,
under the KV store connector and the P/D loaders) and forwards each call to ranks
1..world-1 (worker/rank_process.py) before running it on rank 0's own runner, as vLLM's
executor broadcasts its SchedulerOutput. Within a stage every rank runs the same forward on
the same flat batch; the all-reduces inside the layers (layers/linear.py, layers/moe.py,
layers/embedding.py) keep their hidden states identical. Between stages, micro-batches of
hidden states travel point to point (worker/pipeline.py).

Sampling happens once, on rank 0, on the full logits (the LM head's slices all-gathered):
the sampler's state (generators of seeded requests, grammar matchers, penalties) lives with
the engine, so no RNG has to be kept in lockstep across processes, and the other ranks send
nothing back per step but stage outputs.

KV blocks leave and enter the worker in the one-rank wire layout (every layer, every KV
head; worker/groups.py read_group_blocks / write_group_blocks). So the shared KV store and
P/D transfer work between workers of any shapes (a TP=2 prefill worker to a PP=2 decode
worker and back), and block hashes do not depend on the sharding.

LoRA adapters (`ParallelLoRA`): rank 0 reads and checks an adapter against the whole model;
adding or removing one is a call like the others, the adapter's tensors sent as one
safetensors blob (no shared file system needed), each rank keeping its cut of it
(worker/lora.py).

Failure: a rank that dies closes its gloo connections, so the collective or receive rank 0
is in fails at once (a wedged rank: the collective timeout); a failed call marks the group
broken for good (its collectives may be out of step), `health()` reports it (the worker goes
NOT_SERVING) and every later call raises RankFailedError at once: no request waits on a
dead group, and its supervisor restarts the whole group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.engine.lora import LoRAInfo
from kvmesh.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmesh.errors import RankFailedError
from kvmesh.worker.groups import (ParallelGroups, connect, master_store, read_group_blocks, release, stage_ranges,
                                  whole_spec, write_group_blocks)
from kvmesh.worker.lora import LoadedAdapter, LoRAManager
from kvmesh.worker.model_runner import ModelRunner
from kvmesh.worker.rank_process import ProcessLauncher, RankGroup, RankLauncher

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # gloo's limit per collective (a rank wedged, not dead; a dead one fails at once)
START_TIMEOUT_S = 900.0  # a rank loading its shard of a large checkpoint
FAILURE_GRACE_S = 3.0  # after a failed call: how long to wait for the launcher to name the rank that failed


class ParallelRunner:
    """The ModelRunner of a parallel worker, as the engine's executor sees it: rank 0's
    runner (`local`) plus the rank processes. `spec` is the whole model's KV geometry (the
    wire layout of `read_blocks`); `local.spec` holds rank 0's part (its heads of its
    stage's layers); `stages` are the stages' layer ranges."""

    def __init__(self, local: ModelRunner, ranks: RankGroup, groups: ParallelGroups, store: Any = None):
        self.local, self.ranks, self.groups = local, ranks, groups
        self._store = store  # the group's TCPStore lives as long as the group
        self.kind = ranks.kind
        self.spec = whole_spec(local)
        self.stages = stage_ranges(groups, local.arch.num_layers)
        self.model, self.arch, self.device, self.dtype = local.model, local.arch, local.device, local.dtype
        self.block_size, self.num_blocks = local.block_size, local.num_blocks
        self.grammar, self.backend = local.grammar, local.backend
        self.lora = ParallelLoRA(self, local.lora) if local.lora is not None else None
        self.broken: str | None = None

    def execute(self, sched: SchedulerOutput, **kwargs) -> ModelRunnerOutput:
        return self._call("execute", (sched,), lambda: self.local.execute(sched, **kwargs))

    def forget(self, request_id: str) -> None:
        """Never raises: the engine forgets the requests of a failed step while failing them,
        and a group that is down has nothing left to forget on the other ranks."""
        if self.broken is not None:
            self.local.forget(request_id)
            return
        try:
            self._call("forget", (request_id,), lambda: self.local.forget(request_id))
        except RankFailedError:
            self.local.forget(request_id)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The KV of `block_ids` over every layer and KV head (gathered to rank 0)."""
        return self._call("read_blocks", (block_ids,), lambda: read_group_blocks(self.local, self.groups, block_ids))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: each rank gets its layers and heads of `data`."""
        self._call("write_blocks", (block_ids,), lambda: write_group_blocks(self.local, self.groups, block_ids, data))

    def _call(self, op: str, args: tuple, run: Callable[[], Any]) -> Any:
        """`op` on the other ranks, then `run` here. Any failure breaks the group for good:
        a call that failed on one rank leaves the others' collectives out of step."""
        if self.broken is not None:
            raise RankFailedError(f"{self.kind} parallel group is down: {self.broken}")
        try:
            self.ranks.send(op, *args)
            return run()
        except BaseException as exc:
            why = self._cause() or f"rank 0 failed in {op}: {exc!r}"
            self.broken = why
            logger.error("%s parallel group broken: %s", self.kind, why)
            self.ranks.close()
            release(self.groups)
            raise RankFailedError(f"{self.kind} parallel group is down: {why}") from exc

    def _cause(self) -> str | None:
        """Which rank took the group down, once the launcher knows: a collective fails the moment
        a peer's process is gone (the shared-memory wait checks every 10 ms), which can be
        before Ray reports its actor dead."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while True:
            why = self.ranks.failure()
            if why is not None or time.monotonic() >= deadline:
                return why
            time.sleep(0.05)

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): False once a call failed or a rank process is gone."""
        if self.broken is None:
            why = self.ranks.failure()
            if why is not None:
                self.broken = why
        return (self.broken is None), (f"{self.kind} parallel group is down: {self.broken}" if self.broken else "")

    def close(self) -> None:
        """Stop the rank processes (idempotent; garbage collection does it too)."""
        if self.broken is None:
            self.broken = "closed"
        self.ranks.close()
        release(self.groups)


class ParallelLoRA:
    """The engine's LoRAHost (engine/lora.py) for a parallel worker: rank 0's LoRAManager, with
    every change of the held adapters made on every rank in the same order. Rank 0 decides
    which adapters an add evicts; the ranks follow (worker/lora.py keeps their slots in step)."""

    def __init__(self, runner: ParallelRunner, local: LoRAManager):
        self.runner, self.local = runner, local
        self.max_loras = local.max_loras

    def read(self, name: str, path: str) -> LoadedAdapter:
        return self.local.read(name, path)

    def add(self, name: str, path: str, loaded: LoadedAdapter, busy: frozenset[str] = frozenset()) -> LoRAInfo:
        victims = self.local.plan_add(name, busy)  # (an InvalidRequestError here reaches no rank)
        return self.runner._call("lora_add", (name, loaded.to_bytes(), victims),
                                 lambda: self.local.add(name, path, loaded, evict=victims))

    def remove(self, name: str) -> bool:
        if self.local.get(name) is None:
            return False
        return self.runner._call("lora_remove", (name,), lambda: self.local.remove(name))

    def touch(self, name: str) -> None:
        self.local.touch(name)  # host LRU order matters on rank 0 only: it plans the evictions

    def get(self, name: str) -> LoRAInfo | None:
        return self.local.get(name)

    def adapters(self) -> list[LoRAInfo]:
        return self.local.adapters()

    def __getattr__(self, attr: str) -> Any:  # stats: loads, slot_bytes, ...
        return getattr(self.local, attr)


def start_group(tp: int, pp: int, threads: int, make_runner: Callable[[ParallelGroups], ModelRunner],
                timeout_s: float = COLLECTIVE_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S,
                launcher: RankLauncher | None = None) -> tuple[ParallelGroups, RankGroup, Any]:
    """Start ranks 1..tp*pp-1 with `launcher` (default: child processes on loopback; each
    calls `make_runner` with its ParallelGroups) and join rank 0 to their gloo groups;
    returns (rank 0's groups, the ranks, the store to keep alive). Rank 0 then builds its
    own runner while the others build theirs; call `ranks.wait_ready` after."""
    launcher = launcher or ProcessLauncher()
    store = master_store(tp * pp, start_timeout_s, launcher.host)
    ranks = launcher(tp, pp, store.port, timeout_s, threads, make_runner)
    try:
        groups = connect(0, tp, pp, store, timeout_s, launcher.host)
    except BaseException as exc:
        why = ranks.failure()
        ranks.close()
        raise RankFailedError(f"{ranks.kind} parallel group did not form: {why or exc!r}") from exc
    return groups, ranks, store
