"""The processes of a tensor- or pipeline-parallel group's ranks 1..size-1, and the loop
each one runs.

Rank 0 lives in the engine's process (worker/parallel.py TPRunner / PPRunner). Every other rank is a
process of the "spawn" context (a fresh interpreter: no forked OpenMP team, no copied
engine state) that joins the group's gloo process group, builds its shard of the model and
its own paged KV cache (`make_runner`, a picklable callable from the composition root),
says "ready", then serves rank 0's calls in order until "shutdown":

    ("execute", sched)          run the step's forward and logits (no sampling, no reply)
    ("forget", request_id)      drop per-request state
    ("read_blocks", ids)        join rank 0's gather of those blocks' KV (over gloo): its KV
                                heads (tensor parallel) or its layers' KV (pipeline parallel)
    ("write_blocks", ids)       join rank 0's scatter of those blocks' KV (over gloo)

Calls travel over one pipe per rank (pickled; a SchedulerOutput is a few KB); tensors travel
over gloo. A rank that fails sends ("error", traceback) and exits, which closes its gloo
connections: rank 0's pending collective fails at once instead of waiting out the timeout.
A rank whose pipe closes (rank 0's process died) exits too: no orphans.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import signal
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.errors import RankFailedError
from kvmesh.layers.op import TPGroup
from kvmesh.worker.pipeline import KV_TAG, PipelineGroup

logger = logging.getLogger(__name__)

_STORE_PREFIX = "kvmesh-tp"


def connect(rank: int, size: int, store: Any, timeout_s: float, kind: str = "tensor") -> TPGroup | PipelineGroup:
    """This rank's TPGroup (`kind` "tensor") or PipelineGroup ("pipeline"): a gloo process
    group of its own over `store` (a TCPStore on loopback), so several engines in one Python
    process (tests) never share a default group."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)  # every collective's limit: a wedged rank
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = ProcessGroupGloo(PrefixStore(_STORE_PREFIX, store), rank, size, opts)
    return PipelineGroup(rank, size, group) if kind == "pipeline" else TPGroup(rank, size, group)


def master_store(size: int, timeout_s: float):
    """Rank 0's TCPStore on a free loopback port (read `.port` for the other ranks)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


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


def rank_main(rank: int, size: int, port: int, timeout_s: float, threads: int,
              make_runner: Callable[[TPGroup | PipelineGroup], Any], conn, kind: str = "tensor") -> None:
    """A rank process's whole life (the spawn target)."""
    from torch.distributed import TCPStore

    torch.set_num_threads(threads)
    try:
        store = TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=timeout_s))
        tp = connect(rank, size, store, timeout_s, kind)
        runner = make_runner(tp)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    serve(runner, tp, conn)


def serve(runner, tp: TPGroup, conn) -> None:
    """Rank r's loop: rank 0's calls, in order, until shutdown or until rank 0 is gone."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return  # rank 0's process is gone
        if op == "shutdown":
            return
        try:
            _HANDLERS[op](runner, tp, *args)
        except BaseException:
            try:
                conn.send(("error", f"rank {tp.rank} failed in {op}:\n{traceback.format_exc()}"))
            except OSError:
                pass
            return  # exiting closes this rank's gloo connections: rank 0 fails at once


def _read_blocks(runner, group: TPGroup | PipelineGroup, block_ids: list[int]) -> None:
    data = runner.read_blocks(block_ids)
    if isinstance(group, PipelineGroup):
        group.send(data, 0, KV_TAG).wait()  # this stage's layers; rank 0 stacks the stages
    else:
        gather_to_root(group, data)  # this rank's KV heads; rank 0 joins them


def _write_blocks(runner, group: TPGroup | PipelineGroup, block_ids: list[int]) -> None:
    spec = runner.spec
    out = torch.empty((spec.num_layers, 2, len(block_ids), *spec.block_shape), dtype=spec.wire_dtype)
    if isinstance(group, PipelineGroup):
        group.recv(out, 0, KV_TAG).wait()
    else:
        scatter_from_root(group, out)
    runner.write_blocks(block_ids, out)


_HANDLERS: dict[str, Callable[..., None]] = {
    "execute": lambda runner, tp, sched: runner.execute(sched),
    "forget": lambda runner, tp, request_id: runner.forget(request_id),
    "read_blocks": _read_blocks,
    "write_blocks": _write_blocks,
}


class RankProcesses:
    """Ranks 1..size-1 of a group, seen from rank 0: start, call, check, stop."""

    def __init__(self, size: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[TPGroup | PipelineGroup], Any], kind: str = "tensor"):
        ctx = multiprocessing.get_context("spawn")
        self.size, self.timeout_s, self.kind = size, timeout_s, kind
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=rank_main, name=f"kvmesh-{kind[0]}p-rank{rank}", daemon=True,
                               args=(rank, size, port, timeout_s, threads, make_runner, theirs, kind))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        # Garbage collection and interpreter exit stop the ranks too (an LLM dropped without close()).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every rank has built its runner; RankFailedError with its traceback if one failed."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout_s):
                raise RankFailedError(f"{self.kind} parallel rank {rank} did not start within {timeout_s:g}s")
            status, detail = self._recv(rank, conn)
            if status != "ready":
                raise RankFailedError(f"{self.kind} parallel rank {rank} failed to start:\n{detail}")

    def send(self, op: str, *args) -> None:
        """Call `op` on every rank (no reply; collectives carry any data)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((op, args))
            except OSError as exc:
                raise RankFailedError(self.failure() or f"{self.kind} parallel rank {rank}: {exc!r}") from exc

    def failure(self) -> str | None:
        """Why the group cannot run (a rank exited, or reported an error), or None."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            detail = None
            try:
                if conn.poll():
                    detail = self._recv(rank, conn)[1]
            except RankFailedError as exc:
                detail = str(exc)
            if detail is not None or not proc.is_alive():
                code = proc.exitcode
                how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
                state = "running" if code is None else how
                return f"{self.kind} parallel rank {rank} (pid {proc.pid}) failed ({state})" + (
                    f":\n{detail}" if detail else "")
        return None

    def _recv(self, rank: int, conn) -> tuple[str, Any]:
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailedError(f"{self.kind} parallel rank {rank} closed its pipe ({exc!r})") from None

    def close(self) -> None:
        self._finalizer()


def _stop(procs: list, conns: list, grace_s: float = 5.0) -> None:
    """Ask every rank to exit, then make sure it did (terminate, then kill)."""
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except OSError:
            pass
    for proc in procs:
        proc.join(grace_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(grace_s)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
    for conn in conns:
        conn.close()
