"""KV events: the block pool's hook, the worker-side log and the router's exact index."""

import pytest

from kvmesh.engine.block_pool import BlockPool
from kvmesh.engine.kv_events import KVEventLog
from kvmesh.router.kv_index import KVIndex
from kvmesh.router.plugins import PrecisePrefixScorer, RouteRequest
from kvmesh.router.registry import WorkerHandle


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def cached(pool: BlockPool) -> set[bytes]:
    return set(pool.cached_block_hashes(pool.num_cached_blocks))


def sync(log: KVEventLog, index: KVIndex):
    ev = log.since(index.epoch, index.seq)
    index.apply(ev.epoch, ev.seq, ev.reset, ev.stored, ev.removed)
    return ev


def test_pool_hook_hears_stores_and_evictions_in_order():
    pool = BlockPool(4)
    events = []
    pool.on_event = lambda hh, stored: events.append((hh, stored))
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, h(1))
    pool.cache_full_block(b, h(2))
    pool.cache_full_block(c, h(1))  # duplicate content: not a new cached hash
    pool.free_blocks([c, b, a])
    pool.get_new_blocks(2)  # evicts c (uncached) then b (h2)
    assert events == [(h(1), True), (h(2), True), (h(2), False)]
    pool.free_blocks([])
    assert pool.reset_prefix_cache() is False  # two blocks still in use


def test_log_coalesces_to_current_state_and_index_matches_pool():
    pool = BlockPool(5)
    log, index = KVEventLog(pool, epoch=7), KVIndex()
    first = sync(log, index)
    assert first.reset and first.stored == [] and index.epoch == 7
    blocks = pool.get_new_blocks(4)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, h(i))
    pool.free_blocks(reversed(blocks))
    ev = sync(log, index)
    assert not ev.reset and sorted(ev.stored) == [h(0), h(1), h(2), h(3)] and ev.removed == []
    assert index.hashes == cached(pool)
    got = pool.get_new_blocks(2)  # evicts h3, h2 (tail blocks freed first)
    pool.cache_full_block(got[0], h(9))
    ev = sync(log, index)
    assert ev.stored == [h(9)] and sorted(ev.removed) == [h(2), h(3)]
    assert index.hashes == cached(pool) == {h(0), h(1), h(9)}
    assert index.prefix_blocks([h(0), h(1), h(2), h(9)]) == 2
    assert sync(log, index).stored == [] and index.seq == log.seq  # nothing new: empty batch


def test_reader_behind_the_window_or_from_another_epoch_gets_a_snapshot():
    pool = BlockPool(6)
    log, index = KVEventLog(pool, window=2, epoch=3), KVIndex()
    sync(log, index)
    blocks = pool.get_new_blocks(3)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, h(i))
    ev = sync(log, index)  # 3 events > window 2
    assert ev.reset and sorted(ev.stored) == [h(0), h(1), h(2)] and index.hashes == cached(pool)
    stale = KVIndex()
    stale.apply(99, 1, False, [h(42)], [])  # a previous incarnation of the worker
    ev = sync(log, stale)
    assert ev.reset and stale.hashes == cached(pool) and stale.epoch == 3
    with pytest.raises(ValueError, match="already has an event listener"):
        KVEventLog(pool)


def test_precise_scorer_reads_the_exact_index():
    a, b = WorkerHandle("a:1", 0), WorkerHandle("b:1", 0)
    a.kv_index.apply(1, 3, True, [h(1), h(2), h(3)], [])
    b.kv_index.apply(2, 1, True, [h(1)], [])
    req = RouteRequest("r", list(range(64)), [h(1), h(2), h(3), h(4)], 16)
    assert PrecisePrefixScorer().score(req, [a, b]) == [0.75, 0.25]
    assert PrecisePrefixScorer().score(RouteRequest("s", [1], [], 16), [a]) == [0.0]
