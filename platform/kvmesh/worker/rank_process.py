"""The processes of a parallel worker's ranks 1..world-1, and the loop each one runs.

Rank 0 lives in the engine's process (worker/parallel.py ParallelRunner). Every other rank is a
process forked from a fork server (multiprocessing's "forkserver" context: no forked
OpenMP team, no copied engine state) that joins the worker's gloo process groups
(worker/groups.py), builds its shard of the model and its own paged KV cache (`make_runner`,
a picklable callable from the composition root), says "ready", then serves rank 0's calls
in order until "shutdown":

    ("execute", sched)          run the step's forward (and logits, on stage 0; no sampling, no reply)
    ("forget", request_id)      drop per-request state
    ("read_blocks", ids)        join rank 0's gather of those blocks' KV (its heads, its layers)
    ("write_blocks", ids)       join rank 0's scatter of those blocks' KV
    ("lora_add", name, blob, evict)   hold an adapter (its cut of it), evicting `evict` first
    ("lora_remove", name)       drop an adapter

The fork server is started by a process's first group (which pays one interpreter start,
as under spawn) and has imported torch and the rank's code (this module, the one
`make_runner` comes from, with what they import) but run nothing. Every later rank is a
fork of it: a TP=2 group of a tiny model starts in 0.07 s instead of 2.4 s of a fresh
interpreter importing them, and stops in 0.02 s instead of 0.7 s (2 vCPUs). A fork takes
the server's environment, so each rank is handed the starting process's environment of the
moment (rank_main `env`); its sys.path and folder come with the process object, as under
spawn.

Calls travel over one connection per rank (pickled; a SchedulerOutput is a few KB): a pipe
to a child process here, a socket to a Ray actor (kvmesh.serve.rank_actors); tensors travel
over gloo. A rank that fails sends ("error", traceback) and exits, which closes its gloo
connections: rank 0's pending collective fails at once instead of waiting out the timeout.
A rank whose pipe closes (rank 0's process died) exits too: no orphans.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvmesh.errors import RankFailedError
from kvmesh.worker.groups import ParallelGroups, connect, join_store, read_group_blocks, write_group_blocks
from kvmesh.worker.lora import LoadedAdapter

logger = logging.getLogger(__name__)


def rank_main(rank: int, tp: int, pp: int, port: int, timeout_s: float, threads: int,
              make_runner: Callable[[ParallelGroups], Any], conn, store_host: str = "127.0.0.1",
              host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
    """A rank's whole life (a forked rank process's target; a rank actor's `run`): join rank
    0's store at `store_host`:`port` and the gloo groups (bound to `host`), build the runner,
    serve. `env`: the environment to run in (a fork server's is its first group's)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        store = join_store(port, tp * pp, timeout_s, store_host)
        groups = connect(rank, tp, pp, store, timeout_s, host)
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
    "lora_add": lambda runner, groups, name, blob, evict: _lora_add(runner, name, blob, evict),
    "lora_remove": lambda runner, groups, name: runner.lora.remove(name),
}


def _lora_add(runner, name: str, blob: bytes, evict: list[str]) -> None:
    adapter = LoadedAdapter.from_bytes(blob)
    runner.lora.add(name, adapter.path, adapter, evict=evict)


def group_kind(tp: int, pp: int) -> str:
    return "tensor" if pp == 1 else "pipeline" if tp == 1 else "tensor x pipeline"


class RankGroup:
    """Ranks 1..size-1 of a group, seen from rank 0: one call connection per rank (a pipe to
    a process, or a socket to a Ray actor: kvmesh.serve.rank_actors), the calls, the checks,
    the stop. Subclasses say how a rank is started, whether it is alive, and how it is stopped."""

    def __init__(self, tp: int, pp: int, timeout_s: float):
        self.size, self.timeout_s = tp * pp, timeout_s
        self.kind = group_kind(tp, pp)
        self.conns: list[Any] = []  # conns[r - 1]: rank r's (None until it connects)

    # -- what a launcher provides ----------------------------------------------------------
    def _alive(self, rank: int) -> bool:
        raise NotImplementedError

    def _describe(self, rank: int) -> str:
        """Where rank `rank` runs and its state, for error messages."""
        raise NotImplementedError

    def _connected(self, timeout_s: float) -> None:
        """Block until every rank's call connection exists (processes: at once)."""

    def close(self) -> None:
        raise NotImplementedError

    # -- the calls --------------------------------------------------------------------------
    def wait_ready(self, timeout_s: float) -> None:
        """Block until every rank has built its runner; RankFailedError with its traceback if one failed."""
        deadline = time.monotonic() + timeout_s
        self._connected(timeout_s)
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                if not self._alive(rank):
                    raise RankFailedError(f"{self.kind} parallel rank {rank} ({self._describe(rank)}) "
                                          "exited while starting")
                if time.monotonic() >= deadline:
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
        for rank in range(1, self.size):
            conn = self.conns[rank - 1] if rank <= len(self.conns) else None
            detail = None
            try:
                if conn is not None and conn.poll():
                    detail = self._recv(rank, conn)[1]
            except RankFailedError as exc:
                detail = str(exc)
            if detail is not None or not self._alive(rank):
                return f"{self.kind} parallel rank {rank} ({self._describe(rank)}) failed" + (
                    f":\n{detail}" if detail else "")
        return None

    def _recv(self, rank: int, conn) -> tuple[str, Any]:
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailedError(f"{self.kind} parallel rank {rank} closed its connection ({exc!r})") from None


def _fork_server(make_runner: Callable[[ParallelGroups], Any]) -> multiprocessing.context.BaseContext:
    """The forkserver context; the server it starts on first use preloads this module, the
    one `make_runner` is defined in (and __main__, as spawn would run it), and what a rank's
    build imports on first use: torch's Python references behind `to_empty` on meta import
    symbolic_shapes (sympy, 0.45 s); the native kernels' build folder comes from
    cpp_extension (setuptools); the checkpoint reader."""
    ctx = multiprocessing.get_context("forkserver")
    factory = getattr(make_runner, "func", make_runner)  # functools.partial: its function
    ctx.set_forkserver_preload(list(dict.fromkeys(["__main__", __name__, getattr(factory, "__module__", __name__),
                                                   "torch.fx.experimental.symbolic_shapes", "torch.utils.cpp_extension",
                                                   "safetensors"])))
    return ctx


class RankProcesses(RankGroup):
    """Ranks 1..size-1 as processes forked from the fork server, each with a pipe."""

    def __init__(self, tp: int, pp: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[ParallelGroups], Any]):
        super().__init__(tp, pp, timeout_s)
        ctx = _fork_server(make_runner)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=rank_main, name=f"kvmesh-rank{rank}", daemon=True,
                               args=(rank, tp, pp, port, timeout_s, threads, make_runner, theirs),
                               kwargs={"env": dict(os.environ)})
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        # Garbage collection and interpreter exit stop the ranks too (an LLM dropped without close()).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)

    def _alive(self, rank: int) -> bool:
        return self.procs[rank - 1].is_alive()

    def _describe(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        code = proc.exitcode
        state = "running" if code is None else f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        return f"pid {proc.pid}, {state}"

    def close(self) -> None:
        self._finalizer()


class RankLauncher(Protocol):
    """How a group's ranks 1.. start: `host` is the address rank 0's store and gloo bind to
    (every rank must reach it); calling it starts the ranks and returns their RankGroup."""

    host: str

    def __call__(self, tp: int, pp: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[ParallelGroups], Any]) -> RankGroup: ...


class ProcessLauncher:
    """Starts a group's ranks 1.. as this process's children, on loopback (the default)."""

    host = "127.0.0.1"

    def __call__(self, tp: int, pp: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[ParallelGroups], Any]) -> RankGroup:
        return RankProcesses(tp, pp, port, timeout_s, threads, make_runner)


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
