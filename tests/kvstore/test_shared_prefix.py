"""Engines sharing KV blocks through a real Redis: cross-process prefix reuse, faults,
and the pinned prompt cache."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import hf_greedy
from kvmesh import LLM, SamplingParams
from kvmesh.kvstore import BlockCodec

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_model(model_factory):
    return model_factory(max_position_embeddings=4096)


def _ids(n, seed):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, url=None, **kw):
    torch.set_num_threads(1)
    opts = dict(progress=False, block_size=BS, num_blocks=400, max_model_len=3000)
    opts.update(kw)
    if url:
        opts["kv_store"] = url
    return LLM(str(path), **opts)


_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from kvmesh import LLM, SamplingParams
path, url, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(path, progress=False, block_size=16, num_blocks=400, max_model_len=3000, kv_store=url)
out = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
llm.engine.kv_connector.flush()
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                  "stats": llm.engine.stats()}))
"""


def _run_child(path, url, prompt):
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), url, json.dumps(prompt)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_two_processes_share_a_prefix_through_redis(long_model, redis_server):
    from transformers import AutoModelForCausalLM

    prefix = _ids(1024, 0)
    first = _run_child(long_model, redis_server.url, prefix + _ids(32, 1))
    assert first["cached"] == 0 and first["stats"]["kvstore_written_blocks"] >= 64
    prompt = prefix + _ids(32, 2)
    second = _run_child(long_model, redis_server.url, prompt)
    # the second process computed only the 32-token tail
    assert second["cached"] == 1024
    assert second["stats"]["kvstore_hit_blocks"] == 64
    cold = _llm(long_model).generate(prompt, GREEDY)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(long_model, dtype=torch.float32).eval()
    assert second["tokens"] == cold == hf_greedy(hf, prompt, 6)


def test_corrupted_and_foreign_blocks_are_recomputed(long_model, redis_server):
    prompt = _ids(160, 3) + _ids(8, 4)
    writer = _llm(long_model, redis_server.url)
    ref = writer.generate(prompt, GREEDY)[0].outputs[0].token_ids
    writer.engine.kv_connector.flush()
    c = redis_server.client()
    keys = sorted(c.keys(b"kvmesh:kv:v1:*"))
    assert len(keys) == 10
    from kvmesh.engine.hashing import block_hashes
    from kvmesh.kvstore.codec import block_key

    fp = writer.engine.fingerprint
    hashes = block_hashes(prompt, BS, fp)
    c.set(block_key(fp, hashes[3]), c.get(block_key(fp, hashes[3]))[:-7] + b"garbage")
    reader = _llm(long_model, redis_server.url)
    out = reader.generate(prompt, GREEDY)[0]
    assert out.outputs[0].token_ids == ref
    assert out.num_cached_tokens == 3 * BS  # the 3 blocks before the corrupted one
    assert reader.engine.stats()["kvstore_rejected_corrupt"] == 1

    codec = reader.engine.kv_connector.codec
    foreign = BlockCodec("ff" * 16, codec.dtype, codec.block_size, codec.num_layers, codec.kv_heads, codec.head_dim)
    c.set(block_key(fp, hashes[0]), foreign.encode(b"\0" * codec.payload_bytes))
    fresh = _llm(long_model, redis_server.url)
    out = fresh.generate(prompt, GREEDY)[0]
    assert out.outputs[0].token_ids == ref and out.num_cached_tokens == 0
    assert fresh.engine.stats()["kvstore_rejected_foreign"] == 1
    for llm in (writer, reader, fresh):
        assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


def test_redis_killed_and_restarted_mid_run(long_model, redis_server):
    llm = _llm(long_model, redis_server.url + "?timeout_ms=30&breaker_cooldown_s=0.2")
    eng = llm.engine
    prompts = [_ids(100 + 10 * i, 10 + i) for i in range(4)]
    ref = [o.outputs[0].token_ids for o in _llm(long_model).generate(prompts, GREEDY)]
    rids = [eng.add_request(None, p, GREEDY) for p in prompts]
    eng.step()
    redis_server.stop()  # dies mid-run
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert [outs[r].outputs[0].token_ids for r in rids] == ref
    # new requests while it is down: still served, computed locally
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    # A prompt the local cache does not hold: its store lookup meets the dead server
    # whether or not the writer thread still had the first step's blocks to write when
    # the server died (that race made the error count timing-dependent).
    unseen = _ids(120, 77)
    want = _llm(long_model).generate(unseen, GREEDY)[0].outputs[0].token_ids
    assert llm.generate(unseen, GREEDY)[0].outputs[0].token_ids == want
    assert eng.stats()["kvstore_backend_errors"] >= 1
    redis_server.start()
    import time

    time.sleep(0.25)
    llm.generate(_ids(100, 99), GREEDY)  # a prompt not in the local cache
    eng.kv_connector.flush()
    assert len(redis_server.client().keys(b"kvmesh:kv:v1:*")) > 0  # writing again
    assert eng.num_free_blocks == eng.num_usable_blocks


def test_maxmemory_reached(long_model):
    from redis_procs import RedisServer

    server = RedisServer(maxmemory="2mb")  # a few dozen blocks of this model
    try:
        llm = _llm(long_model, server.url)
        prompts = [_ids(300, 100 + i) for i in range(8)]
        ref = [o.outputs[0].token_ids for o in _llm(long_model).generate(prompts, GREEDY)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
        llm.engine.kv_connector.flush()
        info = server.client().info("memory")
        assert info["used_memory"] <= 3 * 1024 * 1024
        assert server.client().info("stats")["evicted_keys"] > 0
        assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks
    finally:
        server.stop()


def test_pinned_prompt_survives_pressure_and_is_released(long_model, redis_server):
    # 320 blocks x 16 = 5,120 tokens of KV: the pinned 2,000-token prompt takes 125, within the
    # pin quota (half the cache, and room left for one max_model_len=3000 request)
    llm = _llm(long_model, redis_server.url, num_blocks=321)
    eng = llm.engine
    system = _ids(2000, 50)
    assert eng.cache_prompt("system", system) == 2000
    assert eng.num_free_blocks == eng.num_usable_blocks - 125
    c = redis_server.client()
    from kvmesh.engine.hashing import block_hashes
    from kvmesh.kvstore.codec import block_key

    keys = [block_key(eng.fingerprint, h) for h in block_hashes(system, BS, eng.fingerprint)]
    assert all(c.ttl(k) == -1 for k in keys)  # pinned in the store: no TTL
    # pressure: many other prompts cycle through every unpinned block
    for i in range(6):
        llm.generate(_ids(600, 200 + i), GREEDY)
    out = llm.generate(system + _ids(20, 9), GREEDY)[0]
    assert out.num_cached_tokens == 2000
    assert eng.uncache_prompt("system") and not eng.uncache_prompt("system")
    assert eng.num_free_blocks == eng.num_usable_blocks
    assert all(0 < c.ttl(k) <= 3600 for k in keys)
    for i in range(10):  # 380 blocks: more than the whole cache, so the released pin is evicted
        llm.generate(_ids(600, 300 + i), GREEDY)
    assert eng.kv_manager.pool.get_cached_block(block_hashes(system, BS, eng.fingerprint)[0]) is None


@pytest.mark.parametrize("writer_kw, reader_kw", [
    ({"tensor_parallel_size": 2}, {}),
    ({}, {"pipeline_parallel_size": 2}),
], ids=["tp2-writes-tp1-reads", "tp1-writes-pp2-reads"])
def test_parallel_groups_share_blocks_with_one_rank(long_model, redis_server, writer_kw, reader_kw):
    """Blocks in the shared store hold every KV head and layer whatever wrote them: a TP=2
    group's blocks serve a TP=1 engine, a TP=1 engine's serve a PP=2 group, same tokens."""
    redis_server.client().flushall()
    prefix = _ids(128, 5)
    writer = _llm(long_model, redis_server.url, **writer_kw)
    reader = _llm(long_model, redis_server.url, **reader_kw)
    try:
        writer.generate(prefix + _ids(8, 6), GREEDY)
        writer.engine.kv_connector.flush()
        prompt = prefix + _ids(8, 7)
        out = reader.generate(prompt, GREEDY)[0]
        assert out.num_cached_tokens == 128
        assert out.outputs[0].token_ids == _llm(long_model).generate(prompt, GREEDY)[0].outputs[0].token_ids
    finally:
        writer.close()
        reader.close()
