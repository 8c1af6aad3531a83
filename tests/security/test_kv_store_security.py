"""The shared KV store, secured: Redis with a password (URL or KVMESH_REDIS_PASSWORD), KV
blocks authenticated with the cluster's HMAC key (a writer without the key cannot plant
KV), and rate-limit buckets shared by routers through that Redis."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.engine.hashing import block_hashes
from kvmesh.kvstore import BlockCodec, BlockDecodeError, create_store
from kvmesh.kvstore.codec import block_key
from kvmesh.router.ratelimit import RateLimitConfig, RateLimiter

BS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
CODEC = BlockCodec("ab" * 16, "float32", 4, 2, 1, 8, mac_key=b"cluster-key")


def _payload(seed: int = 0) -> bytes:
    return bytes((seed + i) % 251 for i in range(CODEC.payload_bytes))


def test_codec_mac_rejects_unsigned_wrong_key_and_replayed_blocks():
    key_a, key_b = b"kvmesh:kv:v1:x:aa", b"kvmesh:kv:v1:x:bb"
    value = CODEC.encode(_payload(), key_a)
    assert bytes(CODEC.decode(value, key_a)) == _payload()
    unsigned = BlockCodec(*[getattr(CODEC, f) for f in ("fingerprint", "dtype", "block_size", "num_layers",
                                                         "kv_heads", "head_dim")])
    other_key = BlockCodec(**{**CODEC.__dict__, "mac_key": b"attacker-guess"})
    tampered = bytearray(value)
    tampered[60] ^= 1
    for forged, key in ((unsigned.encode(_payload(), key_a), key_a), (other_key.encode(_payload(), key_a), key_a),
                        (value, key_b), (bytes(tampered), key_a)):
        with pytest.raises(BlockDecodeError) as exc:
            CODEC.decode(forged, key)
        assert exc.value.kind == "forged"
    with pytest.raises(BlockDecodeError) as exc:
        unsigned.decode(value, key_a)  # a keyless worker does not take authenticated blocks either
    assert exc.value.kind == "foreign"


def test_redis_store_with_a_password(password_redis, monkeypatch):
    monkeypatch.delenv("KVMESH_REDIS_PASSWORD", raising=False)
    with_password = create_store(password_redis.url)
    with_password.put_many([(b"k", b"v")], ttl_s=60)
    assert with_password.get_many([b"k"]) == [b"v"]
    no_password = create_store(password_redis.url_without_password)
    assert no_password.get_many([b"k"]) == [None] and no_password.errors == 1  # refused: a miss, not a crash
    monkeypatch.setenv("KVMESH_REDIS_PASSWORD", password_redis.password)
    from_env = create_store(password_redis.url_without_password)
    assert from_env.get_many([b"k"]) == [b"v"] and from_env.errors == 0
    for store in (with_password, no_password, from_env):
        store.close()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path, url: str) -> LLM:
    torch.set_num_threads(1)
    return LLM(str(path), progress=False, block_size=BS, num_blocks=128, max_model_len=256, kv_store=url)


def test_a_writer_without_the_key_cannot_plant_kv(tiny_llama, password_redis, monkeypatch):
    """Engines with the cluster key share KV through a real (password) Redis; blocks an
    attacker with Redis access writes, unsigned or signed with a guessed key, are rejected,
    counted and computed locally: output is unchanged."""
    monkeypatch.setenv("KVMESH_KV_HMAC_KEY", "the-cluster-key")
    url = password_redis.url
    prompt = _ids(41, 1)
    writer = _llm(tiny_llama, url)
    ref = writer.generate(prompt, GREEDY)[0].outputs[0].token_ids
    writer.engine.kv_connector.flush()
    reader = _llm(tiny_llama, url)
    out = reader.generate(prompt, GREEDY)[0]
    assert out.outputs[0].token_ids == ref and out.num_cached_tokens == 40  # signed blocks are shared

    codec = writer.engine.kv_connector.codec
    fp = codec.fingerprint
    keys = [block_key(fp, h) for h in block_hashes(prompt, BS, fp)]
    fields = {f: getattr(codec, f) for f in ("fingerprint", "dtype", "block_size", "num_layers", "kv_heads",
                                             "head_dim")}
    zeros = b"\0" * codec.payload_bytes
    client = password_redis.client()
    genuine = client.get(keys[0])
    for planted in (BlockCodec(**fields, mac_key=b"a-guess").encode(zeros, keys[0]),  # a guessed key
                    BlockCodec(**fields).encode(zeros, keys[0]),  # no MAC at all
                    client.get(keys[2])):  # a genuine block replayed under another prefix's key
        client.set(keys[0], planted)
        fresh = _llm(tiny_llama, url)
        out = fresh.generate(prompt, GREEDY)[0]
        assert out.outputs[0].token_ids == ref and out.num_cached_tokens == 0
        assert fresh.engine.stats()["kvstore_rejected_forged"] == 1
        assert fresh.engine.num_free_blocks == fresh.engine.num_usable_blocks
        fresh.engine.kv_connector.flush()  # its own (genuine) rewrite lands before the next plant
    client.set(keys[0], genuine)
    assert _llm(tiny_llama, url).generate(prompt, GREEDY)[0].num_cached_tokens == 40


def test_rate_limit_buckets_are_shared_by_routers_through_redis(password_redis):
    config = RateLimitConfig(requests_per_minute=3, tokens_per_minute=1000, redis_url=password_redis.url)

    async def run():
        a, b = RateLimiter(config), RateLimiter(config)  # two routers
        decisions = [await (a if i % 2 else b).check("tenant-1", 10) for i in range(4)]
        other = await a.check("tenant-2", 10)
        await a.refund("tenant-1", 5)
        big = await b.check("tenant-3", 995)
        bigger = await b.check("tenant-3", 10)
        errors = a.redis_errors + b.redis_errors
        await a.close()
        await b.close()
        return decisions, other, big, bigger, errors

    decisions, other, big, bigger, errors = asyncio.run(run())
    assert [d.allowed for d in decisions] == [True, True, True, False] and decisions[-1].retry_after_s >= 1
    assert other.allowed  # buckets are per tenant
    assert big.allowed and not bigger.allowed  # the token bucket: 995 + 10 > 1000
    assert errors == 0


def test_rate_limit_in_memory_without_redis():
    limiter = RateLimiter(RateLimitConfig(tokens_per_minute=100))

    async def run():
        first = await limiter.check(None, 80)
        second = await limiter.check(None, 30)
        await limiter.refund(None, 50)  # the first request generated less than its max_tokens
        third = await limiter.check(None, 30)
        return first, second, third

    first, second, third = asyncio.run(run())
    assert first.allowed and not second.allowed and third.allowed
    assert 1 <= second.retry_after_s <= 7  # 10 missing tokens at 100 / 60 per second
