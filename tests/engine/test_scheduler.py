"""Scheduler + KV cache manager bookkeeping, driven without a model.

`run_step` plays the model runner: every sequence that samples gets token 7.
"""

from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.outputs import ModelRunnerOutput
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, max_seqs=8, budget=64, max_len=48, caching=True, defer=0):
    kv = KVCacheManager(num_blocks, block_size, "fp", enable_prefix_caching=caching)
    return Scheduler(kv, max_seqs, budget, max_len, max_deferred_decode_steps=defer), kv


def req(rid, n, max_tokens=4, start=100):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(sched, token=7):
    out = sched.schedule()
    toks = {s.request_id: [token] for s in out.seqs if s.sample}
    return out, sched.update_from_output(out, ModelRunnerOutput(toks))


def test_chunked_prefill_mixed_with_decode():
    s, kv = make(budget=8)
    s.add_request(req("a", 3))
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.seqs] == [("a", 3, True)]
    s.add_request(req("b", 20))
    out, _ = run_step(s)
    # a decodes one token, b gets the remaining 7 tokens of the budget
    assert [(q.request_id, q.num_tokens, q.start_pos, q.sample) for q in out.seqs] == [
        ("a", 1, 3, True), ("b", 7, 0, False)]
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.start_pos) for q in out.seqs] == [("a", 1, 4), ("b", 7, 7)]
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.seqs] == [("a", 1, True), ("b", 6, True)]
    assert s.requests["b"].num_computed_tokens == 20 and s.requests["b"].output_token_ids == [7]


def test_prefill_first_defers_decodes_for_at_most_n_steps():
    s, kv = make(budget=8, defer=2)
    s.add_request(req("a", 3, max_tokens=8))
    run_step(s)
    s.add_request(req("b", 20))
    # b's prompt takes whole steps while a's decode sits out, two steps in a row at most
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.start_pos) for q in out.seqs] == [("b", 8, 0)]
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.start_pos) for q in out.seqs] == [("b", 8, 8)]
    out, _ = run_step(s)  # the cap: a decodes, b gets the rest of the budget
    assert [(q.request_id, q.num_tokens, q.start_pos) for q in out.seqs] == [("a", 1, 3), ("b", 4, 16)]
    out, _ = run_step(s)  # no prompt work left: everyone decodes
    assert [(q.request_id, q.num_tokens) for q in out.seqs] == [("a", 1), ("b", 1)]
    s.add_request(req("c", 5, start=300))
    out, _ = run_step(s)  # a new prompt: its step carries no decode rows
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.seqs] == [("c", 5, True)]
    while s.has_unfinished():
        run_step(s)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefill_first_runs_decodes_when_no_prompt_can_start():
    s, kv = make(max_seqs=1, defer=4)
    s.add_request(req("a", 4, max_tokens=3))
    run_step(s)
    s.add_request(req("b", 4, start=50))  # no seat for b: a must not stall
    for pos in (4, 5):
        out, _ = run_step(s)
        assert [(q.request_id, q.num_tokens, q.start_pos) for q in out.seqs] == [("a", 1, pos)]
    out, _ = run_step(s)  # a finished; b starts
    assert [(q.request_id, q.num_tokens) for q in out.seqs] == [("b", 4)]
    while s.has_unfinished():
        run_step(s)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_negative_deferral_is_refused():
    import pytest

    with pytest.raises(ValueError, match="max_deferred_decode_steps"):
        make(defer=-1)


def test_block_table_is_append_only_and_freed_on_finish():
    s, kv = make(block_size=4)
    s.add_request(req("a", 6, max_tokens=5))
    out, _ = run_step(s)
    assert out.seqs[0].block_ids == [1, 2]
    tables = []
    while s.has_unfinished():
        out, res = run_step(s)
        tables.append(out.seqs[0].block_ids)
    assert tables[-1][:2] == [1, 2] and tables[-1] == [1, 2, 3]
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_max_num_seqs_caps_running():
    s, _ = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, start=10 * i))
    out, _ = run_step(s)
    assert [q.request_id for q in out.seqs] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_preemption_frees_newest_and_recomputes():
    # 5 usable blocks of 2 tokens: two requests of 4-token prompts use 4 blocks
    s, kv = make(num_blocks=6, block_size=2, max_len=10, caching=False)
    s.add_request(req("old", 4, max_tokens=4))
    s.add_request(req("new", 4, max_tokens=4, start=200))
    run_step(s)  # both prefilled: 4 blocks used, 1 free
    assert kv.num_free_blocks == 1
    run_step(s)  # each decode needs a 3rd block: old gets the last one, new is preempted
    assert s.requests["new"].status == RequestStatus.PREEMPTED
    assert s.requests["new"].num_computed_tokens == 0
    assert s.num_preemptions == 1
    steps = 0
    while s.has_unfinished():
        run_step(s)
        steps += 1
        assert steps < 50
    assert s.num_preemptions == 1
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_prefix_hit_skips_cached_blocks():
    s, kv = make(block_size=4)
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)  # a finishes after one token; its 2 full prompt blocks stay cached
    assert kv.num_free_blocks == kv.num_usable_blocks
    s.add_request(req("b", 11, max_tokens=1))  # same first 10 tokens + 1
    out, _ = run_step(s)
    (seq,) = out.seqs
    assert seq.start_pos == 8 and seq.num_tokens == 3
    assert s.requests.get("b") is None  # finished
    assert kv.hit_tokens == 8


def test_full_prompt_hit_still_computes_last_token():
    s, kv = make(block_size=4)
    s.add_request(req("a", 8, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 8, max_tokens=1))
    out, _ = run_step(s)
    # both blocks cached, but the last token must run to produce logits: only the
    # first block counts as a hit and the second block's 4 tokens are recomputed
    assert out.seqs[0].start_pos == 4 and out.seqs[0].num_tokens == 4


def test_abort_waiting_and_running():
    s, kv = make()
    s.add_request(req("a", 5))
    s.add_request(req("b", 5, start=300))
    run_step(s)
    s.add_request(req("c", 5, start=400))
    s.finish_requests(["a", "c"], RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(s)
    assert [q.request_id for q in out.seqs] == ["b"]
    assert out.finished_req_ids == {"a", "c"}
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_usable_blocks and not s.has_unfinished()


def test_stop_token_and_length():
    s, _ = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    s.add_request(r)
    _, res = run_step(s, token=7)
    assert res[0].finished and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=99)
    s.add_request(r2)
    run_step(s)
    _, res = run_step(s)
    assert res[0].finished and r2.status == RequestStatus.FINISHED_LENGTH
    r3 = Request("c", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_id=7)
    s.add_request(r3)
    run_step(s, token=7)
    assert r3.status == RequestStatus.FINISHED_STOPPED


def test_every_eos_id_of_the_model_stops_unless_ignore_eos():
    # Chat models end a turn on another id than the tokenizer's eos (Gemma 3's <end_of_turn>).
    s, _ = make()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=1, eos_token_ids=(1, 7))
    s.add_request(r)
    _, res = run_step(s, token=7)
    assert res[0].finished and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    r2 = Request("b", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=1, eos_token_ids=(7,))
    s.add_request(r2)
    run_step(s, token=7)
    _, res = run_step(s, token=7)
    assert res[0].finished and r2.status == RequestStatus.FINISHED_LENGTH


def test_max_model_len_caps_output():
    s, _ = make(max_len=6)
    r = req("a", 4, max_tokens=100)
    s.add_request(r)
    while s.has_unfinished():
        run_step(s)
    assert r.num_tokens == 6 and r.status == RequestStatus.FINISHED_LENGTH


def test_hold_kv_keeps_blocks_until_released():
    s, kv = make(block_size=4)
    r = req("p", 9, max_tokens=1)
    r.hold_kv = True
    s.add_request(r)
    run_step(s)
    assert r.is_finished and r.held_block_ids == [1, 2, 3]
    assert kv.num_free_blocks == kv.num_usable_blocks - 3
    # held blocks are referenced: a flood of new requests cannot evict them
    assert kv.release("p") and not kv.release("p")
    assert kv.num_free_blocks == kv.num_usable_blocks
    a = req("a", 9, max_tokens=1)
    a.hold_kv = True
    s.add_request(a)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # aborts never hold
    assert a.held_block_ids is None and kv.num_free_blocks == kv.num_usable_blocks
