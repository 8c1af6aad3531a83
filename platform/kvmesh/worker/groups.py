"""The process groups of a tensor x pipeline parallel worker, and how KV blocks leave and enter it.

`tp * pp` ranks; rank g is stage s = g // tp, tensor rank t = g % tp. Each stage's tp ranks
form a tensor-parallel group (their layers' all-reduces); the ranks with the same t across
the stages form a pipeline (their hidden states go point to point, stage to stage, over
the world group). Rank 0 (stage 0, t 0) runs the engine and samples.

KV blocks leave and enter the worker in the one-rank wire layout (every layer, every KV head:
KVCacheSpec with the model's num_layers and num_kv_heads), so the shared KV store and P/D
transfer work between workers of any shapes and block hashes do not depend on the
sharding. `read_group_blocks` gathers each stage's heads to its t=0 rank, joins them, and
stacks the stages on rank 0; `write_group_blocks` is its inverse. Every rank of the worker
calls them with the same block ids, in the same order (rank 0 from the engine, the others
from their call loop, worker/rank_process.py).
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvmesh.layers import kv_cache as kvq
from kvmesh.layers import shm_allreduce
from kvmesh.layers.op import PipelineStage, TPGroup
from kvmesh.worker.pipeline import KV_TAG, PipelineGroup

_STORE_PREFIX = "kvmesh-group"
_names = itertools.count()


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's groups: its tensor-parallel group (size 1 without TP) and its pipeline
    (None without PP)."""

    rank: int  # in the world of tp * pp ranks
    tp: TPGroup
    pp: PipelineGroup | None = None

    @property
    def stage(self) -> PipelineStage | None:
        return PipelineStage(self.pp.rank, self.pp.size) if self.pp is not None else None

    @property
    def world_size(self) -> int:
        return self.tp.size * (self.pp.size if self.pp is not None else 1)


def connect(rank: int, tp: int, pp: int, store: Any, timeout_s: float, host: str = "127.0.0.1") -> ParallelGroups:
    """Rank `rank`'s groups: gloo process groups of their own over `store` (a TCPStore,
    under prefixes of their own), so several workers in one Python process (tests) never
    share a default group. `host`: the address this rank's gloo connections bind to
    (loopback for ranks on one machine; the node's address for rank actors on several)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)  # every collective's limit: a wedged rank
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]

    def group(name: str, member: int, size: int):
        return ProcessGroupGloo(PrefixStore(f"{_STORE_PREFIX}-{name}", store), member, size, opts)

    def tp_group(name: str, member: int, size: int) -> TPGroup:
        backend = group(name, member, size)
        return TPGroup(member, size, backend, *register_native(backend, member, size, store))

    stage, t = divmod(rank, tp)
    if pp == 1:
        return ParallelGroups(rank, tp_group("tp0", t, tp))
    world = group("world", rank, tp * pp)
    tp_grp = TPGroup(t, tp, world) if tp == 1 else tp_group(f"tp{stage}", t, tp)
    peers = tuple(s * tp + t for s in range(pp))
    return ParallelGroups(rank, tp_grp, PipelineGroup(stage, pp, world, peers))


def register_native(backend: Any, rank: int, size: int, store: Any) -> tuple[str, Any]:
    """Register the gloo `backend` under a name of this process's own, so C++ can all-reduce
    over it (csrc/decode_stack.cpp calls torch's functional all_reduce_ by group name):
    (the name, the registered group), or ("", None) at size 1 or where this torch has no
    registry (the decode stack then stays off at TP > 1). The registry takes a ProcessGroup,
    so the backend is wrapped in one: the same gloo connections, so its collectives and the
    Python ones run in one order. The registry holds it weakly: the caller keeps it (TPGroup
    .native); `release` unregisters it."""
    from torch.distributed import PrefixStore, ProcessGroup

    register = getattr(torch._C._distributed_c10d, "_register_process_group", None)
    if register is None or size == 1:
        return "", None
    wrapper = ProcessGroup(PrefixStore(f"{_STORE_PREFIX}-native", store), rank, size)
    wrapper._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    wrapper._set_default_backend(ProcessGroup.BackendType.GLOO)
    name = f"kvmesh-tp-{os.getpid()}-{next(_names)}"
    register(name, wrapper)
    return name, wrapper


PATH_BYTES = 256  # the segment's path, broadcast from rank 0


def attach_shm(tp: TPGroup, usable: bool, timeout_s: float) -> TPGroup:
    """`tp` with a shared-memory segment for its sums (layers/shm_allreduce.py), or `tp` as it
    is where any rank cannot map it (`usable` False on that rank: no native kernels; ranks on
    different machines; no /dev/shm). A collective over the group: every rank calls it at the
    same point (the model runner's build). Rank 0 creates the segment and broadcasts its path;
    every rank maps it; a MIN all-reduce of their verdicts decides for all; the file is
    unlinked then, so the mapping outlives it and nothing is left in /dev/shm. A second verdict:
    every rank sees its peers' processes (what its waits check to fail, not hang, when a peer
    dies)."""
    from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp

    made = shm_allreduce.create_segment(tp.size) if usable and tp.rank == 0 else None
    try:
        return _agree_on_shm(tp, usable, timeout_s, made)
    finally:
        if made is not None:  # every rank mapped it, or the group failed: either way the file goes
            os.unlink(made[0])


def _agree_on_shm(tp: TPGroup, usable: bool, timeout_s: float, made: tuple[str, torch.Tensor] | None) -> TPGroup:
    from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp

    path = torch.zeros(PATH_BYTES, dtype=torch.uint8)
    if made is not None:
        raw = made[0].encode()
        path[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    opts = BroadcastOptions()
    opts.rootRank = 0
    tp.group.broadcast([path], opts).wait()
    name = bytes(path.tolist()).rstrip(b"\0").decode()
    seg = made[1] if made is not None else (shm_allreduce.open_segment(name, tp.rank, tp.size)
                                            if usable and name else None)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MIN

    def everyone(ok: bool) -> bool:
        verdict = torch.tensor([1 if ok else 0], dtype=torch.int32)
        tp.group.allreduce([verdict], opts).wait()
        return bool(verdict.item())

    mapped = everyone(seg is not None)  # (then every rank has written its pid into it)
    if not mapped or not everyone(shm_allreduce.peers_visible(seg)):
        return tp
    return replace(tp, shm=shm_allreduce.ShmAllReduce(seg, tp.rank, timeout_s))


def release(groups: ParallelGroups) -> None:
    """Drop the native registration of `groups` (idempotent): the registry would keep the
    group's connections open after its worker closed."""
    unregister = getattr(torch._C._distributed_c10d, "_unregister_process_group", None)
    if groups.tp.name and unregister is not None:
        try:
            unregister(groups.tp.name)
        except (RuntimeError, KeyError, ValueError):
            pass  # released already


def master_store(size: int, timeout_s: float, host: str = "127.0.0.1"):
    """Rank 0's TCPStore on a free port of `host` (read `.port` for the other ranks)."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def join_store(port: int, size: int, timeout_s: float, host: str = "127.0.0.1"):
    """The other ranks' client of rank 0's store at `host`:`port`."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=timeout_s))


def gather_to_root(tp: TPGroup, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape and dtype everywhere), on rank 0; [] elsewhere."""
    from torch.distributed import GatherOptions

    opts = GatherOptions()
    opts.rootRank = 0
    outs = [[torch.empty_like(tensor) for _ in range(tp.size)]] if tp.rank == 0 else []
    tp.group.gather(outs, [tensor.contiguous()], opts).wait()
    return outs[0] if outs else []


def scatter_from_root(tp: TPGroup, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Rank r receives parts[r] (given on rank 0 only) into `out`."""
    from torch.distributed import ScatterOptions

    opts = ScatterOptions()
    opts.rootRank = 0
    tp.group.scatter([out], [[p.contiguous() for p in parts]] if tp.rank == 0 else [], opts).wait()
    return out


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


def join_heads(parts: list[torch.Tensor], full, local) -> torch.Tensor:
    """The distinct head slices' blocks (L, 2, n, *local.block_shape), in head order ->
    (L, 2, n, *full.block_shape). An 8-bit cache's packed bytes are unpacked per part into
    values (block_size, heads, head_dim) and scales (block_size, heads, 4) and joined on heads."""
    if full.quant is None:
        return torch.cat(parts, dim=4)
    values, scales = zip(*(_unpack(p, local) for p in parts))
    l, two, n = parts[0].shape[:3]
    return torch.cat((torch.cat(values, dim=4).reshape(l, two, n, -1),
                      torch.cat(scales, dim=4).reshape(l, two, n, -1)), dim=3)


def split_heads(data: torch.Tensor, layout: KVHeadLayout, full, local, rank: int) -> torch.Tensor:
    """Rank `rank`'s heads of unsharded blocks (L, 2, n, *full.block_shape)."""
    h0, h = layout.first_head(rank), layout.local
    if full.quant is None:
        return data.narrow(4, h0, h).contiguous()
    values, scales = _unpack(data, full)
    l, two, n = data.shape[:3]
    return torch.cat((values.narrow(4, h0, h).reshape(l, two, n, -1),
                      scales.narrow(4, h0, h).reshape(l, two, n, -1)), dim=3)


def _unpack(data: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
    l, two, n = data.shape[:3]
    split = spec.block_size * spec.num_kv_heads * spec.head_dim
    values = data[..., :split].reshape(l, two, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
    scales = data[..., split:].reshape(l, two, n, spec.block_size, spec.num_kv_heads, kvq.SCALE_BYTES)
    return values, scales


def whole_spec(runner):
    """The one-rank wire geometry of `runner`'s model: every layer, every KV head."""
    return replace(runner.spec, num_layers=runner.arch.num_layers, num_kv_heads=runner.arch.num_kv_heads)


def stage_ranges(groups: ParallelGroups, num_layers: int) -> list[range]:
    if groups.pp is None:
        return [range(num_layers)]
    return [PipelineStage(s, groups.pp.size).layer_range(num_layers) for s in range(groups.pp.size)]


def read_group_blocks(runner, groups: ParallelGroups, block_ids: list[int]) -> torch.Tensor | None:
    """The KV of `block_ids` in the one-rank wire layout, on rank 0 (None on the others)."""
    full, local = whole_spec(runner), runner.spec
    data = runner.read_blocks(block_ids)
    tp = groups.tp
    if tp.size > 1:
        parts = gather_to_root(tp, data)
        if tp.rank != 0:
            return None
        layout = KVHeadLayout(full.num_kv_heads, tp.size)
        data = join_heads([parts[r] for r in layout.owners], full, local)
    pp = groups.pp
    if pp is None:
        return data
    if not pp.first:
        pp.send(data, 0, KV_TAG).wait()
        return None
    stages, out = stage_ranges(groups, full.num_layers), [data]
    for s in range(1, pp.size):
        buf = torch.empty((len(stages[s]), 2, len(block_ids), *full.block_shape), dtype=full.wire_dtype)
        pp.recv(buf, s, KV_TAG).wait()
        out.append(buf)
    return torch.cat(out)


def write_group_blocks(runner, groups: ParallelGroups, block_ids: list[int], data: torch.Tensor | None = None) -> None:
    """Inverse of read_group_blocks: `data` (one-rank layout, given on rank 0) lands in every
    rank's cache, each its layers and heads."""
    full, local = whole_spec(runner), runner.spec
    tp, pp, n = groups.tp, groups.pp, len(block_ids)
    sending = []
    mine = data.to(dtype=full.wire_dtype) if data is not None else None
    if pp is not None and tp.rank == 0:  # stage level: rank 0 sends each stage its layers
        stages = stage_ranges(groups, full.num_layers)
        if pp.first:
            for s in range(1, pp.size):
                part = mine[stages[s].start:stages[s].stop].contiguous()
                sending.append((pp.send(part, s, KV_TAG), part))
            mine = mine[:stages[0].stop]
        else:
            mine = torch.empty((local.num_layers, 2, n, *full.block_shape), dtype=full.wire_dtype)
            pp.recv(mine, 0, KV_TAG).wait()
    if tp.size > 1:  # head level: the stage's t=0 rank splits the heads over its group
        layout = KVHeadLayout(full.num_kv_heads, tp.size)
        parts = [split_heads(mine, layout, full, local, r) for r in range(tp.size)] if tp.rank == 0 else None
        out = torch.empty((local.num_layers, 2, n, *local.block_shape), dtype=local.wire_dtype)
        mine = scatter_from_root(tp, out, parts)
    runner.write_blocks(block_ids, mine)
    for work, _ in sending:
        work.wait()
