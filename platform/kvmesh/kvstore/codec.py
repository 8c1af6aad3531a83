"""Wire format of one KV block, shared by every store and by KV transfer.

    header (little endian, 48 bytes)
      magic      4s   b"KVMB"
      version    H    1
      dtype      B    code of the tensor dtype
      _pad       B
      block_size H
      num_layers H
      kv_heads   H
      head_dim   H
      fingerprint 16s model fingerprint (first 16 bytes of its hex digest, decoded)
      length     I    payload bytes
      crc32      I    of the payload
      _reserved  4s
    payload: K/V of all layers, (num_layers, 2, block_size, kv_heads, head_dim) in dtype

A block is only ever decoded by a worker whose fingerprint, dtype and geometry all
match; anything else (another model, a truncated or corrupted value) raises
BlockDecodeError and the caller computes the block itself.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from kvmesh.errors import BlockDecodeError

_HEADER = struct.Struct("<4sHBBHHHH16sII4s")
MAGIC = b"KVMB"
VERSION = 1
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
KEY_PREFIX = b"kvmesh:kv:v1:"


def block_key(fingerprint: str, block_hash: bytes) -> bytes:
    """Store key of a block: the fingerprint in the key keeps models apart even before
    the header check."""
    return KEY_PREFIX + fingerprint.encode() + b":" + block_hash.hex().encode()


@dataclass(frozen=True)
class BlockCodec:
    fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int

    @property
    def _fp(self) -> bytes:
        return bytes.fromhex(self.fingerprint[:32].ljust(32, "0"))

    @property
    def payload_bytes(self) -> int:
        elem = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * elem

    def encode(self, payload: bytes) -> bytes:
        header = _HEADER.pack(
            MAGIC, VERSION, DTYPE_CODES[self.dtype], 0, self.block_size, self.num_layers,
            self.kv_heads, self.head_dim, self._fp, len(payload), zlib.crc32(payload), b"\0" * 4,
        )
        return header + payload

    def decode(self, value: bytes) -> memoryview:
        """The payload of an encoded block, validated against this worker's model."""
        if len(value) < _HEADER.size:
            raise BlockDecodeError("truncated", f"{len(value)} bytes is shorter than the header")
        (magic, version, dtype, _, bs, layers, kvh, hd, fp, length, crc, _) = _HEADER.unpack_from(value)
        if magic != MAGIC or version != VERSION:
            raise BlockDecodeError("corrupt", f"bad magic/version {magic!r}/{version}")
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
