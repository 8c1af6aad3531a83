"""KV block stores shared by workers: a protocol, an in-process `memory` backend (the
embedded default) and a `redis` backend, plus the engine connector that loads blocks
at admission and saves new ones behind the response path."""

from kvmesh.kvstore.base import KVStore, create_store
from kvmesh.kvstore.codec import BlockCodec, BlockDecodeError

__all__ = ["KVStore", "create_store", "BlockCodec", "BlockDecodeError"]
