import time

import pytest

from kvmesh.kvstore import BlockCodec, BlockDecodeError, create_store
from kvmesh.kvstore.codec import block_key

CODEC = BlockCodec("ab" * 16, "float32", 4, 2, 1, 8)


def _payload(seed=1):
    return bytes((seed * 7 + i) % 256 for i in range(CODEC.payload_bytes))


def test_codec_round_trip_and_rejections():
    value = CODEC.encode(_payload())
    assert bytes(CODEC.decode(value)) == _payload()
    corrupted = bytearray(value)
    corrupted[-1] ^= 0xFF
    with pytest.raises(BlockDecodeError) as e:
        CODEC.decode(bytes(corrupted))
    assert e.value.kind == "corrupt"
    with pytest.raises(BlockDecodeError) as e:
        CODEC.decode(value[:-10])
    assert e.value.kind == "truncated"
    other = BlockCodec("cd" * 16, "float32", 4, 2, 1, 8)
    with pytest.raises(BlockDecodeError) as e:
        other.decode(value)
    assert e.value.kind == "foreign"
    with pytest.raises(BlockDecodeError):
        CODEC.decode(b"junk")
    assert block_key("fp", b"\x01\x02") == b"kvmesh:kv:v1:fp:0102"


def test_memory_store_lru_bytes_and_pins():
    store = create_store("memory://?max_bytes=300")
    store.put_many([(b"a", b"x" * 100), (b"b", b"x" * 100)], None)
    store.pin([b"a"])
    store.put_many([(b"c", b"x" * 100), (b"d", b"x" * 100)], None)
    # over budget: the oldest unpinned (b) goes; pinned a survives
    assert store.get_many([b"a", b"b", b"c", b"d"]) == [b"x" * 100, None, b"x" * 100, b"x" * 100]
    store.put_many([(b"t", b"y")], ttl_s=0.01)
    time.sleep(0.02)
    assert store.exists([b"t", b"a"]) == [False, True]


def test_unknown_store_url():
    with pytest.raises(ValueError, match="kv_store"):
        create_store("etcd://x")


def test_redis_store_basic_pin_and_ttl(redis_server):
    store = create_store(redis_server.url)
    store.put_many([(b"k1", b"v1"), (b"k2", b"v2")], ttl_s=60)
    assert store.get_many([b"k1", b"nope", b"k2"]) == [b"v1", None, b"v2"]
    store.pin([b"k1"])
    c = redis_server.client()
    assert c.ttl(b"k1") == -1 and c.ttl(b"k2") > 0
    store.unpin([b"k1"], 30)
    assert 0 < c.ttl(b"k1") <= 30
    store.delete([b"k1"])
    assert store.exists([b"k1", b"k2"]) == [False, True]


def test_redis_down_is_a_fast_miss_and_breaker_recovers(redis_server, monkeypatch):
    # A cooldown far longer than the test: no half-open probe can happen by itself however
    # slow the machine is, so every count below is exact.
    store = create_store(redis_server.url + "?timeout_ms=50&breaker_cooldown_s=300")
    assert store.breaker.cooldown_s == 300 and store.breaker.threshold == 3
    store.put_many([(b"k", b"v")], None)
    reached = []  # MGETs that reached the redis client (each pays a connect / timeout when it is down)
    real_mget = store._redis.mget
    monkeypatch.setattr(store._redis, "mget", lambda keys: (reached.append(keys), real_mget(keys))[1])
    redis_server.stop()
    results = [store.get_many([b"k"]) for _ in range(20)]
    assert results == [[None]] * 20
    # The breaker stops paying a timeout per call: only the `threshold` calls that opened it
    # reached redis (and failed); the other 17 were answered without touching it.
    assert len(reached) == store.errors == store.breaker.threshold
    assert store.breaker.trips == 1 and store.skipped == 17
    redis_server.start()  # restarted, empty
    assert store.get_many([b"k"]) == [None] and len(reached) == 3 and store.skipped == 18  # open: not probed yet
    store.breaker.opened_at -= store.breaker.cooldown_s  # the cooldown has passed (instead of waiting it out)
    assert store.get_many([b"k"]) == [None]  # the half-open probe reaches the restarted redis
    assert len(reached) == 4 and store.errors == 3 and store.breaker.opened_at is None  # closed again
    store.put_many([(b"k", b"v2")], None)
    assert store.get_many([b"k"]) == [b"v2"] and len(reached) == 5
    assert store.stats() == {"errors": 3, "skipped_breaker_open": 18, "breaker_trips": 1}
