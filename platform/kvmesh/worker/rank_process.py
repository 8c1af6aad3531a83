"""The processes of a parallel worker's ranks 1..world-1, and the loop each one runs.

Rank 0 lives in the engine's process (worker/parallel.py ParallelRunner). Every other rank is a
process of the "spawn" context (a fresh interpreter: no forked OpenMP team, no copied
engine state) that joins the worker's gloo process groups (worker/groups.py), builds its
shard of the model and its own paged KV cache (`make_runner`, a picklable callable from the
composition root), says "ready", then serves rank 0's calls in order until "shutdown":

    ("execute", sched)          run the step's forward (and logits, on stage 0; no sampling, no reply)
    ("forget", request_id)      drop per-request state
    ("read_blocks", ids)        join rank 0's gather of those blocks' KV (its heads, its layers)
    ("write_blocks", ids)       join rank 0's scatter of those blocks' KV

Calls travel over one pipe per rank (pickled; a SchedulerOutput is a few KB); tensors travel
over gloo. A rank that fails sends ("error", traceback) and exits, which closes its gloo
connections: rank 0's pending collective fails at once instead of waiting out the timeout.
A rank whose pipe closes (rank 0's process died) exits too: no orphans.
"""

from __future__ import annotations

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
from kvmesh.worker.groups import ParallelGroups, connect, join_store, read_group_blocks, write_group_blocks

logger = logging.getLogger(__name__)


def rank_main(rank: int, tp: int, pp: int, port: int, timeout_s: float, threads: int,
              make_runner: Callable[[ParallelGroups], Any], conn) -> None:
    """A rank process's whole life (the spawn target)."""
    torch.set_num_threads(threads)
    try:
        store = join_store(port, tp * pp, timeout_s)
        groups = connect(rank, tp, pp, store, timeout_s)
        runner = make_runner(groups)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    serve(runner, groups, conn)


def serve(runner, groups: ParallelGroups, conn) -> None:
    """Rank r's loop: rank 0's calls, in order, until shutdown or until rank 0 is gone."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return  # rank 0's process is gone
        if op == "shutdown":
            return
        try:
            _HANDLERS[op](runner, groups, *args)
        except BaseException:
            try:
                conn.send(("error", f"rank {groups.rank} failed in {op}:\n{traceback.format_exc()}"))
            except OSError:
                pass
            return  # exiting closes this rank's gloo connections: rank 0 fails at once


_HANDLERS: dict[str, Callable[..., None]] = {
    "execute": lambda runner, groups, sched: runner.execute(sched),
    "forget": lambda runner, groups, request_id: runner.forget(request_id),
    "read_blocks": read_group_blocks,
    "write_blocks": write_group_blocks,
}


class RankProcesses:
    """Ranks 1..size-1 of a group, seen from rank 0: start, call, check, stop."""

    def __init__(self, tp: int, pp: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[ParallelGroups], Any]):
        ctx = multiprocessing.get_context("spawn")
        size = tp * pp
        self.size, self.timeout_s = size, timeout_s
        self.kind = "tensor" if pp == 1 else "pipeline" if tp == 1 else "tensor x pipeline"
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=rank_main, name=f"kvmesh-rank{rank}", daemon=True,
                               args=(rank, tp, pp, port, timeout_s, threads, make_runner, theirs))
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
