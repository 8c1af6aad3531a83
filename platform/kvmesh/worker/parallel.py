"""Tensor and pipeline parallelism: a group of ranks, each with its shard of the model (its
slice of every layer, or its run of layers: worker/pipeline.py) and its own paged KV cache,
that the engine drives as one ModelRunner.

The engine's bookkeeping (scheduler, block tables, prefix hashes) runs once, in rank 0's
process; `TPRunner` stands where a ModelRunner stands (inside worker.executor.Executor,
under the KV store connector and the P/D loaders) and forwards each call to ranks
1..tp-1 (worker/rank_process.py) before running it on rank 0's own runner, as vLLM's
executor broadcasts its SchedulerOutput. Every rank runs the same forward on the same
flat batch; the all-reduces inside the layers (layers/linear.py, layers/moe.py,
layers/embedding.py) keep their hidden states identical.

Sampling happens once, on rank 0, on the full logits (the LM head's slices all-gathered):
the sampler's state (generators of seeded requests, grammar matchers, penalties) lives with
the engine, so no RNG has to be kept in lockstep across processes, and the other ranks send
nothing back per step.

KV blocks leave and enter the group in the unsharded wire layout (all KV heads, see
KVCacheSpec): `read_blocks` gathers each rank's heads over gloo and joins them,
`write_blocks` splits and scatters them. So the shared KV store and P/D transfer work
between groups of any sizes (TP=1 prefill to a TP=2 decode worker and back), and block
hashes do not depend on the sharding.

Failure: a rank that dies closes its gloo connections, so the collective rank 0 is in fails
at once (a wedged rank: the collective timeout); a failed call marks the group broken for
good (its collectives may be out of step), `health()` reports it (the worker goes
NOT_SERVING) and every later call raises RankFailedError at once: no request waits on a
dead group, and its supervisor restarts the whole group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvmesh.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmesh.errors import RankFailedError
from kvmesh.layers import kv_cache as kvq
from kvmesh.layers.op import TPGroup
from kvmesh.worker.model_runner import KVCacheSpec, ModelRunner
from kvmesh.worker.pipeline import KV_TAG, PipelineGroup
from kvmesh.worker.rank_process import RankProcesses, connect, gather_to_root, master_store, scatter_from_root

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # gloo's limit per collective (a rank wedged, not dead; a dead one fails at once)
START_TIMEOUT_S = 900.0  # a rank loading its shard of a large checkpoint


@dataclass(frozen=True)
class KVHeadLayout:
    """Which of the model's `num_kv_heads` KV heads each of `tp` ranks holds: heads
    [h0, h0 + local) with h0 = (r // replicas) * local; with fewer KV heads than ranks each
    head sits on `replicas` consecutive ranks (models/llama.py local_kv_heads)."""

    num_kv_heads: int
    tp: int

    @property
    def local(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    @property
    def replicas(self) -> int:
        return self.tp * self.local // self.num_kv_heads

    @property
    def owners(self) -> list[int]:
        """One rank per distinct head slice, in head order."""
        return list(range(0, self.tp, self.replicas))

    def first_head(self, rank: int) -> int:
        return (rank // self.replicas) * self.local


def join_heads(parts: list[torch.Tensor], full: KVCacheSpec, local: KVCacheSpec) -> torch.Tensor:
    """The distinct head slices' blocks (L, 2, n, *local.block_shape), in head order ->
    (L, 2, n, *full.block_shape). An 8-bit cache's packed bytes are unpacked per part into
    values (block_size, heads, head_dim) and scales (block_size, heads, 4) and joined on heads."""
    if full.quant is None:
        return torch.cat(parts, dim=4)
    values, scales = zip(*(_unpack(p, local) for p in parts))
    l, two, n = parts[0].shape[:3]
    return torch.cat((torch.cat(values, dim=4).reshape(l, two, n, -1),
                      torch.cat(scales, dim=4).reshape(l, two, n, -1)), dim=3)


def split_heads(data: torch.Tensor, layout: KVHeadLayout, full: KVCacheSpec, local: KVCacheSpec,
                rank: int) -> torch.Tensor:
    """Rank `rank`'s heads of unsharded blocks (L, 2, n, *full.block_shape)."""
    h0, h = layout.first_head(rank), layout.local
    if full.quant is None:
        return data.narrow(4, h0, h).contiguous()
    values, scales = _unpack(data, full)
    l, two, n = data.shape[:3]
    return torch.cat((values.narrow(4, h0, h).reshape(l, two, n, -1),
                      scales.narrow(4, h0, h).reshape(l, two, n, -1)), dim=3)


def _unpack(data: torch.Tensor, spec: KVCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    l, two, n = data.shape[:3]
    split = spec.block_size * spec.num_kv_heads * spec.head_dim
    values = data[..., :split].reshape(l, two, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
    scales = data[..., split:].reshape(l, two, n, spec.block_size, spec.num_kv_heads, kvq.SCALE_BYTES)
    return values, scales


class GroupRunner:
    """The ModelRunner of a group of ranks, as the engine's executor sees it: rank 0's runner
    (`local`) plus the rank processes. `spec` is the whole model's KV geometry (the wire
    layout of `read_blocks`); `local.spec` holds this rank's part. Subclasses move KV blocks."""

    kind = "tensor"

    def __init__(self, local: ModelRunner, ranks: RankProcesses, spec: KVCacheSpec, store: Any = None):
        self.local, self.ranks, self.spec = local, ranks, spec
        self._store = store  # the group's TCPStore lives as long as the group
        self.model, self.arch, self.device, self.dtype = local.model, local.arch, local.device, local.dtype
        self.block_size, self.num_blocks = local.block_size, local.num_blocks
        self.lora, self.grammar, self.backend = local.lora, local.grammar, local.backend
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

    def _call(self, op: str, args: tuple, run: Callable[[], Any]) -> Any:
        """`op` on the other ranks, then `run` here. Any failure breaks the group for good:
        a call that failed on one rank leaves the others' collectives out of step."""
        if self.broken is not None:
            raise RankFailedError(f"{self.kind} parallel group is down: {self.broken}")
        try:
            self.ranks.send(op, *args)
            return run()
        except BaseException as exc:
            why = self.ranks.failure() or f"rank 0 failed in {op}: {exc!r}"
            self.broken = why
            logger.error("%s parallel group broken: %s", self.kind, why)
            self.ranks.close()
            raise RankFailedError(f"{self.kind} parallel group is down: {why}") from exc

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


class TPRunner(GroupRunner):
    """A tensor-parallel group: every rank holds a slice of every layer and its share of
    the KV heads (`layout`); blocks leave and enter it with all heads."""

    def __init__(self, local: ModelRunner, ranks: RankProcesses, num_kv_heads: int, tp: TPGroup, store: Any = None):
        super().__init__(local, ranks, replace(local.spec, num_kv_heads=num_kv_heads), store)
        self.tp = tp
        self.layout = KVHeadLayout(num_kv_heads, self.tp.size)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The unsharded KV of `block_ids` (every rank's heads, gathered to rank 0)."""
        def run() -> torch.Tensor:
            parts = gather_to_root(self.tp, self.local.read_blocks(block_ids))
            return join_heads([parts[r] for r in self.layout.owners], self.spec, self.local.spec)

        return self._call("read_blocks", (block_ids,), run)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: each rank gets its heads of `data`."""
        def run() -> None:
            full = data.to(dtype=self.spec.wire_dtype)
            parts = [split_heads(full, self.layout, self.spec, self.local.spec, r) for r in range(self.tp.size)]
            out = torch.empty_like(parts[0])
            self.local.write_blocks(block_ids, scatter_from_root(self.tp, out, parts))

        self._call("write_blocks", (block_ids,), run)


class PPRunner(GroupRunner):
    """A pipeline-parallel group: stage r holds layers `stages[r]` and their KV caches;
    blocks leave and enter it with every layer (stage 0 stacks and splits them)."""

    kind = "pipeline"

    def __init__(self, local: ModelRunner, ranks: RankProcesses, stages: list[range], group: PipelineGroup,
                 store: Any = None):
        super().__init__(local, ranks, replace(local.spec, num_layers=stages[-1].stop), store)
        self.group, self.stages = group, stages

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The KV of `block_ids` over every layer: stage 0's, then each later stage's."""
        def run() -> torch.Tensor:
            parts = [self.local.read_blocks(block_ids)]
            for rank in range(1, self.group.size):
                buf = self._blocks(rank, len(block_ids))
                self.group.recv(buf, rank, KV_TAG).wait()
                parts.append(buf)
            return torch.cat(parts)

        return self._call("read_blocks", (block_ids,), run)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: each stage gets its layers of `data`."""
        def run() -> None:
            full = data.to(dtype=self.spec.wire_dtype)
            sending = []
            for rank in range(1, self.group.size):
                part = full[self.stages[rank].start:self.stages[rank].stop].contiguous()
                sending.append((self.group.send(part, rank, KV_TAG), part))
            self.local.write_blocks(block_ids, full[:self.stages[0].stop])
            for work, _ in sending:
                work.wait()

        self._call("write_blocks", (block_ids,), run)

    def _blocks(self, rank: int, n: int) -> torch.Tensor:
        spec = self.spec
        return torch.empty((len(self.stages[rank]), 2, n, *spec.block_shape), dtype=spec.wire_dtype)


def start_group(size: int, threads: int, make_runner: Callable[[Any], ModelRunner],
                timeout_s: float = COLLECTIVE_TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S,
                kind: str = "tensor") -> tuple[TPGroup | PipelineGroup, RankProcesses, Any]:
    """Spawn ranks 1..size-1 (each calls `make_runner` with its TPGroup, or PipelineGroup for
    `kind` "pipeline") and join rank 0 to their gloo group; returns (rank 0's group, the
    processes, the store to keep alive). Rank 0 then builds its own runner while the others
    build theirs; call `ranks.wait_ready` after."""
    store = master_store(size, start_timeout_s)
    ranks = RankProcesses(size, store.port, timeout_s, threads, make_runner, kind)
    try:
        group = connect(0, size, store, timeout_s, kind)
    except BaseException as exc:
        why = ranks.failure()
        ranks.close()
        raise RankFailedError(f"{kind} parallel group did not form: {why or exc!r}") from exc
    return group, ranks, store
