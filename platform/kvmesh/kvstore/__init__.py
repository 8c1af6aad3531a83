"""KV block stores shared by workers: a protocol, an in-process `memory` backend (the
embedded default) and a `redis` backend, and the block codec. The engine-side connector
that loads and saves blocks is kvmesh.worker.kv_connector."""

from kvmesh.kvstore import memory, redis_store  # noqa: F401  (backends register themselves)
from kvmesh.kvstore.base import KVStore, create_store
from kvmesh.kvstore.codec import BlockCodec, BlockDecodeError

__all__ = ["KVStore", "create_store", "BlockCodec", "BlockDecodeError"]
