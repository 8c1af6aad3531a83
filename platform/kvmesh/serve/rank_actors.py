"""A multi-rank replica's ranks 1.. as Ray actors, one per bundle of the replica's placement group.

`rank_launch: actors` (ServingConfig): Ray Serve starts the replica (rank 0) in bundle 0 and
the replica's engine starts rank r as a `RankActor` pinned to bundle r with that bundle's
CPUs / GPU share (`rank_actor_options`), as Ray Serve LLM places vLLM's workers. Unlike the
default rank processes (children of the replica, on its node), a rank actor may run on
another node of the group (pipeline stages with PACK / SPREAD), so everything binds to the
node's address, not loopback:

* rank 0's TCPStore and gloo devices bind to the replica's node IP; each actor's gloo
  device to its own node's;
* calls travel over one socket per rank (`multiprocessing.connection`, authenticated by a
  random key made per group), carrying the same messages as the rank processes' pipes, and
  each actor runs the same loop (worker/rank_process.py `rank_main`), so a TP=2 group of
  actors computes exactly what a TP=2 group of processes does.

Failure: an actor whose process dies closes its socket and its gloo connections (rank 0's
pending collective fails at once and the group is marked broken: health NOT_SERVING, Ray
Serve replaces the replica); its `run` call's object ref then fails too, which `_alive`
sees. Rank actors are owned by the replica's process: Ray kills them with it (fate
sharing), and `close()` stops them (shutdown message, then `ray.kill`).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvmesh.errors import RankFailedError
from kvmesh.worker.groups import ParallelGroups
from kvmesh.worker.rank_process import RankGroup, rank_main

logger = logging.getLogger(__name__)


def rank_actor_options(rank: int, placement_group: Any = None) -> dict[str, Any]:
    """`.options(...)` for a Ray actor running rank `rank` (>= 1) inside the replica's placement group.

    Pins rank r to bundle r, with that bundle's resources, and keeps the actor's own children
    in the group. Called from inside the replica (the group is
    `ray.util.get_current_placement_group()` there) unless `placement_group` is given."""
    pg = placement_group if placement_group is not None else ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("rank_actor_options: not inside a placement group (a replica with world_size 1, or "
                           "called outside a Ray Serve replica)")
    specs = pg.bundle_specs
    if not 1 <= rank < len(specs):
        raise ValueError(f"rank {rank}: the replica's placement group has bundles 0..{len(specs) - 1} "
                         "(bundle 0 is the replica itself)")
    bundle = specs[rank]
    opts: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True),
    }
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory") and not k.startswith("bundle_group")}
    if custom:
        opts["resources"] = custom
    if "memory" in bundle:
        opts["memory"] = bundle["memory"]
    return opts


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """One rank of a parallel worker. `run` is its whole life: it returns when rank 0 says
    shutdown or goes away, and the actor then exits."""

    def run(self, rank: int, tp: int, pp: int, store_host: str, port: int, call_address: tuple[str, int],
            authkey: bytes, timeout_s: float, threads: int, make_runner: Callable[[ParallelGroups], Any]) -> None:
        host = ray.util.get_node_ip_address()
        conn = Client(call_address, authkey=authkey)
        conn.send((rank, os.getpid(), host))
        try:
            rank_main(rank, tp, pp, port, timeout_s, threads, make_runner, conn, store_host, host)
        finally:
            conn.close()
        ray.actor.exit_actor()


class RankActors(RankGroup):
    """Ranks 1..size-1 as Ray actors in bundles 1.. of `placement_group` (default: the
    current one, the replica's), seen from rank 0 at `host`."""

    def __init__(self, tp: int, pp: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[ParallelGroups], Any], host: str, placement_group: Any = None):
        super().__init__(tp, pp, timeout_s)
        authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=authkey)
        self.conns = [None] * (self.size - 1)
        self.where: list[tuple[int, str] | None] = [None] * (self.size - 1)  # (pid, node IP) per rank
        self._arrived = threading.Condition()
        self.actors, self.refs = [], []
        for rank in range(1, self.size):
            actor = RankActor.options(**rank_actor_options(rank, placement_group)).remote()
            self.actors.append(actor)
            self.refs.append(actor.run.remote(rank, tp, pp, host, port, self._listener.address, authkey,
                                              timeout_s, threads, make_runner))
        threading.Thread(target=self._accept, name="kvmesh-rank-accept", daemon=True).start()
        self._finalizer = weakref.finalize(self, _stop, self.actors, self.refs, self.conns, self._listener)

    def _accept(self) -> None:
        """Take the actors' call connections as they come, each saying which rank it is."""
        while None in self.conns:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed: the group is stopping
            except AuthenticationError:
                continue  # not one of ours
            try:
                rank, pid, node = conn.recv()
            except (OSError, EOFError):
                continue
            with self._arrived:
                self.conns[rank - 1], self.where[rank - 1] = conn, (pid, node)
                self._arrived.notify_all()

    def _connected(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while None in self.conns:
                missing = self.conns.index(None) + 1
                if not self._alive(missing):
                    raise RankFailedError(f"{self.kind} parallel rank {missing} ({self._describe(missing)}) "
                                          f"failed before connecting: {self._error(missing)}")
                if time.monotonic() >= deadline:
                    raise RankFailedError(f"{self.kind} parallel rank {missing} (a Ray actor) did not connect within "
                                          f"{timeout_s:g}s: is its bundle of the placement group schedulable?")
                self._arrived.wait(0.5)

    def _alive(self, rank: int) -> bool:
        done, _ = ray.wait([self.refs[rank - 1]], timeout=0)
        return not done

    def _error(self, rank: int) -> str:
        try:
            ray.get(self.refs[rank - 1], timeout=0)
            return "its run returned"
        except Exception as exc:  # the actor's failure, as Ray reports it
            return repr(exc)

    def _describe(self, rank: int) -> str:
        where = self.where[rank - 1]
        actor = self.actors[rank - 1]._actor_id.hex()[:12]
        state = "running" if self._alive(rank) else "gone"
        return (f"Ray actor {actor}, pid {where[0]} on {where[1]}, {state}" if where
                else f"Ray actor {actor}, {state}")

    def pids(self) -> list[int | None]:
        """The actors' process ids (None for a rank not connected yet)."""
        return [w[0] if w else None for w in self.where]

    def close(self) -> None:
        self._finalizer()


class RayRankLauncher:
    """Starts a group's ranks 1.. as Ray actors (a `kvmesh.worker.rank_process.RankLauncher`):
    in `placement_group` (default: the replica's own), everything bound to this node's IP."""

    def __init__(self, placement_group: Any = None):
        self.placement_group = placement_group
        self.host = ray.util.get_node_ip_address()

    def __call__(self, tp: int, pp: int, port: int, timeout_s: float, threads: int,
                 make_runner: Callable[[ParallelGroups], Any]) -> RankGroup:
        return RankActors(tp, pp, port, timeout_s, threads, make_runner, self.host, self.placement_group)


def _stop(actors: list, refs: list, conns: list, listener: Listener, grace_s: float = 5.0) -> None:
    """Ask every rank to exit, give them `grace_s`, then kill what is left."""
    for conn in conns:
        if conn is not None:
            try:
                conn.send(("shutdown", ()))
            except OSError:
                pass
    try:
        ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    except Exception:  # Ray already shut down (interpreter exit)
        pass
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:
            pass
    for conn in conns:
        if conn is not None:
            conn.close()
    listener.close()
