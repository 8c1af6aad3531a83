"""Chained block hashes: the identity of a block of KV is its whole token prefix.

hash(block i) = sha256(hash(block i-1) || token ids of block i), with the chain rooted
at sha256("kvmesh-kv-v1" || model fingerprint). Two blocks therefore share a hash only
if every token before and inside them matches *and* the model (weights, dtype, block
size, RoPE, quantization: whatever the fingerprint covers) matches. The function uses
only hashlib and fixed little-endian encoding, so the same tokens and fingerprint give
the same hash in every process on every machine (unlike Python's `hash()`); the local
prefix cache, a shared KV store and the router can all use it.

A non-empty `cache_salt` (vLLM's name; a request field, or derived from the API key by
the router) is mixed into the root: requests with different salts never share a block
hash, so prefix-cache hits, shared-store blocks and `cached_tokens` never cross
tenants, while requests with the same salt still share. The empty salt keeps the
unsalted root (blocks written before salts existed stay valid).

A LoRA adapter's `lora_key` (the adapter's content fingerprint, `LoRARequest.key`) is mixed
in the same way: the same prompt under two adapters (or an adapter and the base model) has
different KV, so its blocks never share a hash. Keying by content rather than by name means
an adapter re-loaded under its name with other weights never hits the old blocks, and the
same weights under two names share theirs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32 bytes (sha256 digest)

_ROOT_TAG = b"kvmesh-kv-v1"
_SALT_TAG = b"\0cache-salt\0"
_LORA_TAG = b"\0lora\0"
MAX_CACHE_SALT_CHARS = 256


def root_hash(model_fingerprint: str, cache_salt: str = "", lora_key: str = "") -> BlockHash:
    """The parent hash of a sequence's first block (per salt and adapter, see the module docstring)."""
    root = _ROOT_TAG + model_fingerprint.encode()
    # Length-prefixed: no (fingerprint, salt, adapter) triple can collide with another's bytes.
    for tag, value in ((_SALT_TAG, cache_salt), (_LORA_TAG, lora_key)):
        if value:
            raw = value.encode()
            root += tag + struct.pack("<I", len(raw)) + raw
    return hashlib.sha256(root).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent + payload).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    start: Sequence[BlockHash] = (),
    cache_salt: str = "",
    lora_key: str = "",
) -> list[BlockHash]:
    """Chained hashes of every *full* block of `token_ids`.

    `start` holds already computed hashes of the leading blocks (a request's growing
    list, computed with the same salt and adapter); only the remaining full blocks are hashed.
    """
    out = list(start)
    parent = out[-1] if out else root_hash(model_fingerprint, cache_salt, lora_key)
    for i in range(len(out), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
