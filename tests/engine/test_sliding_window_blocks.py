"""Sliding-window block freeing in the KV cache manager and scheduler, without a model:
a long request holds about a window of blocks, dropped entries are the null block and lie
wholly before the window, prefix hits need only the window's blocks, preemption and
speculative rollback keep the window, and an idle manager has every block free again."""

import pytest

from kvmesh.engine.kv_cache_manager import KVCacheManager, PrefixHit, blocks_per_request
from kvmesh.engine.outputs import ModelRunnerOutput
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler

BS, WINDOW = 4, 8


def make(num_blocks=32, budget=8, max_len=200, window=WINDOW, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, "fp", enable_prefix_caching=caching, sliding_window=window)
    return Scheduler(kv, max_seqs, budget, max_len), kv


def req(rid, n, max_tokens=4, start=100):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(sched, token=7):
    out = sched.schedule()
    toks = {s.request_id: [token] * (1 + len(s.spec_token_ids)) for s in out.seqs if s.sample}
    return out, sched.update_from_output(out, ModelRunnerOutput(toks))


def check_invariants(sched, kv):
    """Ref counts equal table occurrences; every scheduled chunk's window is in real blocks
    and every dropped entry lies wholly before it."""
    counts = {}
    for blocks in list(kv.req_blocks.values()) + list(kv.held.values()):
        for b in blocks:
            if b is not kv.pool.null_block:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
    for b in kv.pool.blocks[1:]:
        assert b.ref_cnt == counts.get(b.block_id, 0), b
        assert (b.ref_cnt == 0) == (b.block_id in kv.pool._free)
    for r in sched.running:
        # The next chunk starts at num_computed_tokens: it reads keys from lo on.
        table, lo = kv.get_block_ids(r.request_id), max(0, r.num_computed_tokens - WINDOW + 1)
        assert all((i + 1) * BS <= lo for i, bid in enumerate(table) if bid == 0)
        assert 0 not in table[lo // BS:]


def test_blocks_per_request():
    assert blocks_per_request(100, 4, None, 8) == 25
    assert blocks_per_request(100, 4, 8, 8) == 5  # (8 - 1 + 8) tokens over 4 + 1 blocks
    assert blocks_per_request(10, 4, 8, 8) == 3  # never more than the whole sequence
    assert blocks_per_request(1000, 16, 4096, 512) == 63


def test_long_request_holds_a_window_of_blocks_and_returns_them():
    s, kv = make(budget=8)
    s.add_request(req("a", 150, max_tokens=30))
    peak = 0
    while s.has_unfinished():
        out, _ = run_step(s)
        check_invariants(s, kv)
        held = kv.num_usable_blocks - kv.num_free_blocks
        peak = max(peak, held)
        seq = out.seqs[0]
        # the entries before the chunk's window are the null block, the rest real
        first = max(0, seq.start_pos - WINDOW + 1) // BS
        assert seq.block_ids[:first] == [0] * first and 0 not in seq.block_ids[first:]
    assert peak <= blocks_per_request(180, BS, WINDOW, 8)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_request_longer_than_the_cache_is_served():
    # 7 usable blocks hold 28 tokens; the window needs at most 5 at a time.
    s, kv = make(num_blocks=8, budget=8, max_len=200)
    s.add_request(req("a", 120, max_tokens=40))
    while s.has_unfinished():
        run_step(s)
        check_invariants(s, kv)
    assert kv.num_free_blocks == kv.num_usable_blocks
    with pytest.raises(ValueError, match="max_model_len=200"):
        make(num_blocks=8, budget=8, max_len=200, window=None)


def test_prefix_hit_skips_blocks_before_the_window():
    s, kv = make()
    s.add_request(req("a", 40))
    while s.has_unfinished():
        run_step(s)
    b = req("b", 40)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 36  # (40 - 1) // 4 blocks
    skip = (36 - WINDOW + 1) // BS
    assert [x.block_id for x in hit.blocks[:skip]] == [0] * skip
    # the hit's real blocks hold b's own prefix
    for i, blk in enumerate(hit.blocks[skip:], start=skip):
        assert blk.block_hash == b.block_hashes[i]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 4, hit) is not None
    # only the window's 2 hit blocks were taken back (+1 new), not the 7 dropped ones
    assert free_before - kv.num_free_blocks == 3
    kv.free(b)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_hit_needs_the_whole_window_cached():
    s, kv = make()
    s.add_request(req("a", 40))
    while s.has_unfinished():
        run_step(s)
    b = req("b", 40)
    kv.update_block_hashes(b)
    # Evict block 7 (in the window of the 36-token hit): the best hit then ends before it...
    victim = kv.pool.get_cached_block(b.block_hashes[7])
    kv.pool._free.move_to_end(victim.block_id, last=False)
    kv.pool.get_new_blocks(1)
    hit = kv.get_computed_blocks(b)
    # ... at 28 tokens (blocks 5, 6 cover its window (28 - 8, 28]) rather than 36.
    assert hit.num_tokens == 28
    assert all(x.block_id == 0 for x in hit.blocks[:5]) and all(x.block_id != 0 for x in hit.blocks[5:])


def test_no_window_keeps_the_leading_contiguous_hit():
    s, kv = make(window=None, max_len=100)
    s.add_request(req("a", 40))
    while s.has_unfinished():
        run_step(s)
    b = req("b", 40)
    kv.update_block_hashes(b)
    first = kv.pool.get_cached_block(b.block_hashes[0])
    kv.pool._free.move_to_end(first.block_id, last=False)
    kv.pool.get_new_blocks(1)
    assert kv.get_computed_blocks(b).num_tokens == 0


def test_preemption_frees_everything_and_recomputes():
    s, kv = make(num_blocks=8, budget=16, max_len=100)
    for i in range(4):
        s.add_request(req(f"r{i}", 60, max_tokens=10, start=100 * (i + 1)))
    while s.has_unfinished():
        run_step(s)
        check_invariants(s, kv)
    assert s.num_preemptions > 0
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_spec_rollback_keeps_the_window():
    """Drafts ride along with a decode; rejected ones roll num_computed_tokens back, never
    before the chunk's start, so the blocks its window needs were not dropped."""
    s, kv = make(budget=16)
    r = req("a", 30, max_tokens=20)
    s.add_request(r)
    while r.num_output_tokens == 0:
        run_step(s)
    while s.has_unfinished():
        r.spec_token_ids = [1, 2, 3, 4]
        out = s.schedule()
        seq = out.seqs[0]
        assert len(seq.spec_token_ids) > 0 or r.num_output_tokens >= 16
        # accept one draft of the four: the bonus token follows it
        toks = {seq.request_id: [7, 7] if seq.spec_token_ids else [7]}
        s.update_from_output(out, ModelRunnerOutput(toks))
        check_invariants(s, kv)
        if s.has_unfinished():
            table = kv.get_block_ids("a")
            lo = max(0, r.num_computed_tokens - WINDOW + 1)
            assert all(table[p // BS] != 0 for p in range(lo, r.num_computed_tokens))
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_held_requests_keep_every_block():
    s, kv = make()
    r = req("a", 40)
    r.hold_kv = True
    s.add_request(r)
    while s.has_unfinished():
        run_step(s)
    assert 0 not in r.held_block_ids and len(r.held_block_ids) == 11
    kv.release("a")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_idle_after_mixed_traffic_and_cache_reset():
    s, kv = make(num_blocks=24, budget=12)
    for i in range(6):
        s.add_request(req(f"r{i}", 20 + 13 * i, max_tokens=6, start=100 + (i % 2) * 7))
    while s.has_unfinished():
        run_step(s)
        check_invariants(s, kv)
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert kv.pool.reset_prefix_cache()


def test_admission_hit_counts_only_touched_blocks():
    kv = KVCacheManager(16, BS, "fp", sliding_window=WINDOW)
    a = req("a", 40)
    assert kv.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    kv.free(a)
    b = req("b", 41)
    hit = kv.get_computed_blocks(b)
    assert isinstance(hit, PrefixHit) and hit.num_tokens == 40
    # 15 usable: the 2 window blocks come back from the free queue, 1 new one for the last token
    assert kv.allocate_slots(b, 1, hit) is not None
    assert kv.num_free_blocks == 15 - 3
