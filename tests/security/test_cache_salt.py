"""The cache salt in the engine's bookkeeping: block hashes, and prefix hits in the KV
cache manager, never cross salts; equal salts still share."""

from __future__ import annotations

import pytest

from kvmesh.engine.hashing import block_hashes, root_hash
from kvmesh.engine.kv_cache_manager import KVCacheManager
from kvmesh.engine.request import Request
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.errors import InvalidRequestError

BS = 4
PROMPT = list(range(1, 18))  # 4 full blocks


def test_salt_roots_a_separate_hash_chain():
    plain, a, b = (block_hashes(PROMPT, BS, "fp", cache_salt=s) for s in ("", "a", "b"))
    assert plain == block_hashes(PROMPT, BS, "fp")  # the empty salt keeps the unsalted chain
    assert set(plain).isdisjoint(a) and set(a).isdisjoint(b)
    assert a == block_hashes(PROMPT, BS, "fp", cache_salt="a")
    assert root_hash("fp", "a") != root_hash("fpa") and root_hash("f", "pa") != root_hash("fp", "a")


def _admit(kv: KVCacheManager, rid: str, salt: str) -> int:
    req = Request(rid, PROMPT, SamplingParams(cache_salt=salt))
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(PROMPT) - hit.num_tokens, hit) is not None
    kv.free(req)
    return hit.num_tokens


def test_prefix_hits_stay_within_a_salt():
    kv = KVCacheManager(num_blocks=64, block_size=BS, model_fingerprint="fp")
    assert _admit(kv, "a1", "tenant-a") == 0
    assert _admit(kv, "b1", "tenant-b") == 0
    assert _admit(kv, "u1", "") == 0
    assert _admit(kv, "a2", "tenant-a") == 16
    assert _admit(kv, "b2", "tenant-b") == 16
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_salt_is_validated():
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        SamplingParams(cache_salt="x" * 257)
