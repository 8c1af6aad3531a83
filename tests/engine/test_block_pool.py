from kvmesh.engine.block_pool import BlockPool
from kvmesh.engine.hashing import block_hashes


def test_null_block_reserved_and_fifo_allocation():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4 == pool.num_usable_blocks
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1


def test_free_order_is_eviction_order():
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a, b])
    # block 4 was never used, then the freed ones in the order they were freed
    assert [x.block_id for x in pool.get_new_blocks(4)] == [4, 3, 1, 2]


def test_cached_free_block_can_be_touched_back_until_evicted():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    h = block_hashes([1, 2], 2, "fp")[0]
    pool.cache_full_block(a, h)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    assert pool.get_cached_block(h) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([a])
    # three allocations consume 2, 3 and finally evict 1 (a)
    got = pool.get_new_blocks(3)
    assert [x.block_id for x in got] == [2, 3, 1]
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_shared_block_refcount():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_keeps_first_block_canonical():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = b"x" * 32
    pool.cache_full_block(a, h)
    pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_no_caching_mode_forgets_hashes():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"y" * 32)
    assert pool.get_cached_block(b"y" * 32) is None
