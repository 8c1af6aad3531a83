"""csrc/shm_allreduce.cpp between real processes: every rank gets the exact rank-order sum
(the same bits everywhere), for float32 and bfloat16, tensors smaller and larger than a
slot (chunked, both phases reused many times); a peer that exits mid-collective or never
joins fails the wait with a clear error instead of hanging it; nothing is left in /dev/shm."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from kvmesh.layers import native, shm_allreduce

pytestmark = pytest.mark.skipif(not native.load() or not os.path.isdir(shm_allreduce.SHM_DIR),
                                reason="the shm all-reduce needs the native CPU kernels and /dev/shm")

SLOT = 256  # bytes: 64 float32 per chunk, so most tensors below take several chunks
SIZES = (1, 7, 64, 65, 1000, 3 * SLOT + 5)


def _inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float().clone()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(parts[0].dtype)


def _peer(path: str, rank: int, world: int, mode: str, queue) -> None:
    native.load()
    seg = shm_allreduce.open_segment(path, rank, world)
    if seg is None:
        queue.put((rank, "no segment"))
        return
    if mode == "exit":
        return  # attached, never joins
    if mode == "hang":
        time.sleep(60)
        return
    handle = shm_allreduce.ShmAllReduce(seg, rank, 30.0)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for x in _inputs(rank, dtype):
            out.append(handle(x).float().numpy().copy())  # (bfloat16 to float32 is exact)
    queue.put((rank, out))


def _start(world: int, modes: list[str]):
    made = shm_allreduce.create_segment(world, SLOT)
    assert made is not None
    path, seg = made
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(path, r, world, modes[r - 1], queue), daemon=True)
             for r in range(1, world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        while not shm_allreduce.peers_visible(seg):  # every peer attached
            assert time.monotonic() < deadline and all(p.is_alive() or p.exitcode == 0 for p in procs)
            time.sleep(0.05)
    finally:
        os.unlink(path)  # as worker/groups.py does once every rank mapped it: the mapping lives on
    return seg, procs, queue


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_order_sum(world):
    seg, procs, queue = _start(world, ["reduce"] * (world - 1))
    handle = shm_allreduce.ShmAllReduce(seg, 0, 30.0)
    mine = [handle(x).clone() for dtype in (torch.float32, torch.bfloat16) for x in _inputs(0, dtype)]
    got = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    expected = [_rank_order_sum([_inputs(r, dtype)[i] for r in range(world)])
                for dtype in (torch.float32, torch.bfloat16) for i in range(len(SIZES))]
    for i, want in enumerate(expected):
        assert torch.equal(mine[i], want), f"rank 0, tensor {i}"
        for r in range(1, world):
            assert torch.equal(torch.from_numpy(got[r][i]), want.float()), f"rank {r}, tensor {i}"


def test_a_peer_that_exits_fails_the_wait_fast():
    seg, procs, _ = _start(2, ["exit"])
    procs[0].join(30)  # exited, not reaped by the kernel until joined: both are covered
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited in the middle of a collective"):
        shm_allreduce.ShmAllReduce(seg, 0, 300.0)(torch.ones(8))
    assert time.monotonic() - t0 < 5


def test_a_zombie_peer_counts_as_exited():
    seg, procs, _ = _start(2, ["exit"])
    pid = procs[0].pid
    deadline = time.monotonic() + 30
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # exited, unreaped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match=f"pid {pid}"):
        shm_allreduce.ShmAllReduce(seg, 0, 300.0)(torch.ones(8))
    procs[0].join(10)


def test_a_peer_that_never_joins_times_out():
    seg, procs, _ = _start(2, ["hang"])
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not join the collective within 0.5 s"):
            shm_allreduce.ShmAllReduce(seg, 0, 0.5)(torch.ones(8))
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)


def test_bad_inputs_are_refused():
    path, seg = shm_allreduce.create_segment(2, SLOT)
    os.unlink(path)
    handle = shm_allreduce.ShmAllReduce(seg, 0, 1.0)
    assert not handle.supports(torch.ones(4, dtype=torch.int64)) and not handle.supports(torch.ones(4, 4).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        handle(torch.ones(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="outside world"):
        torch.ops.kvmesh.shm_all_reduce_(torch.ones(4), seg, 5, 1.0)
    with pytest.raises(RuntimeError, match="not initialized"):
        torch.ops.kvmesh.shm_all_reduce_(torch.ones(4), torch.zeros(4096, dtype=torch.uint8), 0, 1.0)
    assert shm_allreduce.open_segment("/nonexistent/kvmesh", 1, 2) is None
    assert not shm_allreduce.peers_visible(seg)  # rank 1 never attached


def _gather_peer(path: str, rank: int, world: int, queue) -> None:
    native.load()
    seg = shm_allreduce.open_segment(path, rank, world)
    handle = shm_allreduce.ShmAllReduce(seg, rank, 30.0)
    got = [handle.all_gather(x).numpy().copy() for x in _gather_inputs(rank)]
    queue.put((rank, got))


def _gather_inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    # a chunk of the slot, several slots (chunked), a transposed view (made contiguous), int64
    return [torch.randn(3, 5, generator=g), torch.randn(2, 3 * SLOT // 4 + 9, generator=g),
            torch.randn(6, 4, generator=g).t(), torch.randint(0, 1 << 40, (11,), generator=g)]


def test_all_gather_stacks_every_ranks_tensor_in_rank_order():
    world = 3
    made = shm_allreduce.create_segment(world, SLOT)
    path, seg = made
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gather_peer, args=(path, r, world, queue), daemon=True) for r in range(1, world)]
    try:
        for p in procs:
            p.start()
        handle = shm_allreduce.ShmAllReduce(seg, 0, 60.0)
        mine = [handle.all_gather(x) for x in _gather_inputs(0)]
        got = dict(queue.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(10)
    finally:
        os.unlink(path)
    for i, out in enumerate(mine):
        want = torch.stack([_gather_inputs(r)[i] for r in range(world)])
        assert torch.equal(out, want), i
        for r in range(1, world):
            assert torch.equal(torch.from_numpy(got[r][i]), want), (r, i)
