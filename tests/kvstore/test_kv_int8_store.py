"""int8 KV blocks in the shared store: the codec sizes and names them apart from float
blocks, engines with int8 caches share them through a real Redis (values and scales
intact), and a float-cache engine on the same store neither reads nor overwrites them."""

from __future__ import annotations

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.errors import BlockDecodeError
from kvmesh.kvstore import BlockCodec

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_codec_sizes_int8_payloads_with_their_scales_and_keys_them_apart():
    f32 = BlockCodec("ab" * 16, "float32", 4, 2, 3, 64)
    q8 = BlockCodec("ab" * 16, "int8", 4, 2, 3, 64)
    assert f32.payload_bytes == 2 * 2 * 4 * 3 * 64 * 4
    assert q8.payload_bytes == 2 * 2 * 4 * 3 * (64 + 4)  # a float32 scale per (token, KV head)
    h = b"\x01\x02"
    assert f32.key(h) == b"kvmesh:kv:v1:" + b"ab" * 16 + b":0102"  # float keys unchanged
    assert q8.key(h) != f32.key(h) and b":int8:" in q8.key(h)
    payload = bytes(range(256)) * (q8.payload_bytes // 256) + bytes(q8.payload_bytes % 256)
    assert bytes(q8.decode(q8.encode(payload, q8.key(h)), q8.key(h))) == payload
    with pytest.raises(BlockDecodeError, match="foreign"):
        f32.decode(q8.encode(payload))


def _llm(path, url, kv_cache_dtype):
    torch.set_num_threads(1)
    return LLM(str(path), progress=False, block_size=BS, num_blocks=200, max_model_len=1000, kv_store=url,
               kv_cache_dtype=kv_cache_dtype)


def _ids(n, seed):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_int8_engines_share_blocks_through_redis_and_float_ones_keep_apart(model_factory, redis_server):
    path = model_factory(max_position_embeddings=1024)
    prefix = _ids(160, 0)
    writer = _llm(path, redis_server.url, "int8")
    writer.generate(prefix + _ids(8, 1), GREEDY)
    writer.engine.kv_connector.flush()
    keys = sorted(redis_server.client().keys(b"kvmesh:kv:v1:*"))
    assert len(keys) == 10 and all(b":int8:" in k for k in keys)

    prompt = prefix + _ids(8, 2)
    reader = _llm(path, redis_server.url, "int8")
    out = reader.generate(prompt, GREEDY)[0]
    stats = reader.engine.stats()
    assert out.num_cached_tokens == 160 and stats["kvstore_hit_blocks"] == 10
    # The loaded blocks are the writer's, scales included: the same tokens as computing them.
    cold = _llm(path, None, "int8").generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == cold
    assert reader.engine.num_free_blocks == reader.engine.num_usable_blocks

    # A float32-cache engine of the same model: no hit, no rejection, its own keys beside.
    f32 = _llm(path, redis_server.url, "auto")
    out = f32.generate(prompt, GREEDY)[0]
    f32.engine.kv_connector.flush()
    stats = f32.engine.stats()
    assert out.num_cached_tokens == 0 and stats.get("kvstore_hit_blocks", 0) == 0
    assert not any(k.startswith("kvstore_rejected") for k in stats)
    keys = redis_server.client().keys(b"kvmesh:kv:v1:*")
    assert sum(b":int8:" in k for k in keys) == 10 and sum(b":int8:" not in k for k in keys) == 10
