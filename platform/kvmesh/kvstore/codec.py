"""Wire format of one KV block, shared by every store and by KV transfer.

    header (little endian, 48 bytes)
      magic      4s   b"KVMB"
      version    H    1
      dtype      B    code of what the cache stores (DTYPE_CODES)
      _pad       B
      block_size H
      num_layers H
      kv_heads   H
      head_dim   H
      fingerprint 16s model fingerprint (first 16 bytes of its hex digest, decoded)
      length     I    payload bytes
      crc32      I    of the payload
      _reserved  4s
    payload: K/V of all layers, (num_layers, 2, block_size, kv_heads, head_dim) in dtype;
             for an 8-bit cache (int8, fp8_e4m3) per (layer, K or V) the block_size x
             kv_heads x head_dim bytes, then their block_size x kv_heads float32 scales
             (worker/model_runner.py KVCacheSpec)
    mac:     32 bytes, only in version 2 (authenticated) blocks

A block is only ever decoded by a worker whose fingerprint, dtype and geometry all
match; anything else (another model, a truncated or corrupted value) raises
BlockDecodeError and the caller computes the block itself. Workers of one model whose
caches store different dtypes (an int8 cache beside a float one) share no keys
(`BlockCodec.key`): neither overwrites the other's blocks in a shared store, and no block
is ever converted between them.

Authentication: with a cluster key (`KVMESH_KV_HMAC_KEY`, see `load_mac_key`) blocks are
written as version 2 with HMAC-SHA256(key, store key || header || payload) appended, and a
reader with the key accepts nothing else: a block without a valid MAC (written by anyone
who can reach Redis but lacks the key, or copied under another block's key) is rejected
as "forged" and computed locally. The store key is in the MAC, so a valid block cannot
be replayed under another prefix's hash.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import BlockDecodeError

_HEADER = struct.Struct("<4sHBBHHHH16sII4s")
MAGIC = b"KVMB"
VERSION = 1
VERSION_AUTHENTICATED = 2
MAC_BYTES = 32
MAC_KEY_ENV = "KVMESH_KV_HMAC_KEY"
MAC_KEY_FILE_ENV = "KVMESH_KV_HMAC_KEY_FILE"
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3, "int8": 4, "fp8_e4m3": 5}
# Bytes per value; an 8-bit cache adds a float32 scale per (token, KV head) row.
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}
QUANTIZED_DTYPES = frozenset({"int8", "fp8_e4m3"})
_SCALE_BYTES = 4
KEY_PREFIX = b"kvmesh:kv:v1:"


def block_key(fingerprint: str, block_hash: bytes, kv_dtype: str | None = None) -> bytes:
    """Store key of a block: the fingerprint in the key keeps models apart even before
    the header check; `kv_dtype` (an 8-bit cache's) keeps its blocks apart from the float ones."""
    middle = fingerprint.encode() + (b":" + kv_dtype.encode() if kv_dtype else b"")
    return KEY_PREFIX + middle + b":" + block_hash.hex().encode()


def load_mac_key(key_file: str | None = None) -> bytes | None:
    """The cluster's KV authentication key: `KVMESH_KV_HMAC_KEY`, else the file `key_file`,
    else the file named by `KVMESH_KV_HMAC_KEY_FILE`; None when none is set (blocks unsigned)."""
    value = os.environ.get(MAC_KEY_ENV)
    path = key_file or os.environ.get(MAC_KEY_FILE_ENV)
    if not value and path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"KV HMAC key file {path!r} cannot be read ({exc}); fix the path") from None
    return value.encode() if value else None


@dataclass(frozen=True)
class BlockCodec:
    fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    mac_key: bytes | None = None  # set: write version 2 blocks and accept only those with a valid MAC

    @property
    def _fp(self) -> bytes:
        return bytes.fromhex(self.fingerprint[:32].ljust(32, "0"))

    @property
    def payload_bytes(self) -> int:
        row = self.head_dim * _ELEMENT_BYTES[self.dtype] + (_SCALE_BYTES if self.dtype in QUANTIZED_DTYPES else 0)
        return 2 * self.num_layers * self.block_size * self.kv_heads * row

    def key(self, block_hash: bytes) -> bytes:
        """The store key of a block of this codec's model and cache dtype."""
        return block_key(self.fingerprint, block_hash, self.dtype if self.dtype in QUANTIZED_DTYPES else None)

    def _mac(self, key: bytes, signed: bytes | memoryview) -> bytes:
        return hmac.new(self.mac_key, key + bytes(signed), hashlib.sha256).digest()  # type: ignore[arg-type]

    def encode(self, payload: bytes, key: bytes = b"") -> bytes:
        """An encoded block; `key` (its store key) is bound into the MAC when the codec has a mac_key."""
        version = VERSION if self.mac_key is None else VERSION_AUTHENTICATED
        header = _HEADER.pack(
            MAGIC, version, DTYPE_CODES[self.dtype], 0, self.block_size, self.num_layers,
            self.kv_heads, self.head_dim, self._fp, len(payload), zlib.crc32(payload), b"\0" * 4,
        )
        if self.mac_key is None:
            return header + payload
        return header + payload + self._mac(key, header + payload)

    def decode(self, value: bytes, key: bytes = b"") -> memoryview:
        """The payload of an encoded block, validated against this worker's model (and, with a
        mac_key, authenticated as written under store key `key` by a holder of the key)."""
        if len(value) < _HEADER.size:
            raise BlockDecodeError("truncated", f"{len(value)} bytes is shorter than the header")
        (magic, version, dtype, _, bs, layers, kvh, hd, fp, length, crc, _) = _HEADER.unpack_from(value)
        if magic != MAGIC or version not in (VERSION, VERSION_AUTHENTICATED):
            raise BlockDecodeError("corrupt", f"bad magic/version {magic!r}/{version}")
        if self.mac_key is not None:
            value = self._authenticated(value, version, key)
        elif version != VERSION:
            raise BlockDecodeError("foreign", f"block is authenticated (HMAC) but this worker has no "
                                              f"{MAC_KEY_ENV}; give every worker the cluster's key")
        if (fp, dtype, bs, layers, kvh, hd) != (
            self._fp, DTYPE_CODES[self.dtype], self.block_size, self.num_layers, self.kv_heads, self.head_dim
        ):
            raise BlockDecodeError("foreign", "block was written by another model or geometry")
        payload = memoryview(value)[_HEADER.size :]
        if len(payload) != length or length != self.payload_bytes:
            raise BlockDecodeError("truncated", f"payload {len(payload)} bytes, expected {self.payload_bytes}")
        if zlib.crc32(payload) != crc:
            raise BlockDecodeError("corrupt", "checksum mismatch")
        return payload

    def _authenticated(self, value: bytes, version: int, key: bytes) -> bytes:
        """`value` without its MAC, once the MAC checks out (else BlockDecodeError "forged")."""
        if version != VERSION_AUTHENTICATED or len(value) < _HEADER.size + MAC_BYTES:
            raise BlockDecodeError("forged", "block carries no MAC: it was not written by a holder of the "
                                             "cluster's KV key")
        body, mac = memoryview(value)[:-MAC_BYTES], bytes(value[-MAC_BYTES:])
        if not hmac.compare_digest(mac, self._mac(key, body)):
            raise BlockDecodeError("forged", "MAC mismatch: the block was not written under this key by a "
                                             "holder of the cluster's KV key")
        return bytes(body)
