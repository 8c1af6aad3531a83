"""A GGUF file's scalar metadata and tensor table, read without gguf.GGUFReader.

Torch-free. Shared by the float conversion (checkpoint/gguf_convert.py) and the quantized
GGUF loader (quant/gguf_weights.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.errors import ModelNotFoundError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SHORT_ARRAY = 1024


class GGUFHeader:
    """A GGUF file's scalar metadata and tensor table, parsed directly.

    gguf.GGUFReader builds a numpy view per element of every metadata array (the
    49,152-token vocabulary and its merges): ~10 s for SmolLM2, longer than loading
    the weights. This walks the same layout (GGUF v2 / v3) and keeps only short arrays of
    scalars (per-layer settings, at most `_SHORT_ARRAY` long) as lists; the vocabulary and
    merges are skipped.
    """

    def __init__(self, path: Path):
        import struct

        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        raw = memoryview(self.buf)
        self.pos = 0

        def read(fmt: str):
            (v,) = struct.unpack_from(fmt, raw, self.pos)
            self.pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            n = read("<Q")
            self.pos += n
            return bytes(raw[self.pos - n:self.pos]).decode("utf-8")

        def skip(vtype: int) -> None:
            if vtype == _STRING:
                n = read("<Q")  # read first: `self.pos += read()` would drop its advance
                self.pos += n
            elif vtype == _ARRAY:
                etype, n = read("<I"), read("<Q")
                if etype in _SCALARS:
                    self.pos += n * struct.calcsize(_SCALARS[etype])
                else:
                    for _ in range(n):
                        skip(etype)
            else:
                self.pos += struct.calcsize(_SCALARS[vtype])

        magic = bytes(raw[:4])
        self.pos = 4
        version = read("<I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ModelNotFoundError(f"model: {path} is not a GGUF v2 / v3 file")
        n_tensors, n_kv = read("<Q"), read("<Q")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, vtype = string(), read("<I")
            if vtype == _STRING:
                self.meta[key] = string()
            elif vtype in _SCALARS:
                self.meta[key] = read(_SCALARS[vtype])
            elif vtype == _ARRAY and self._short_array(raw, read):
                etype, n = read("<I"), read("<Q")
                self.meta[key] = [read(_SCALARS[etype]) for _ in range(n)]
            else:
                skip(vtype)
        self.tensors: list[tuple[str, int, tuple[int, ...], int]] = []  # name, ggml type, HF shape, offset
        for _ in range(n_tensors):
            name, ndim = string(), read("<I")
            dims = [read("<Q") for _ in range(ndim)]
            ttype, offset = read("<I"), read("<Q")
            self.tensors.append((name, ttype, tuple(reversed(dims)), offset))  # GGUF lists dims innermost first
        align = int(self.meta.get("general.alignment", 32))
        self.data_start = (self.pos + align - 1) // align * align

    def _short_array(self, raw, read) -> bool:
        """Whether the array at the read position holds at most _SHORT_ARRAY scalars (position kept)."""
        pos = self.pos
        etype, n = read("<I"), read("<Q")
        self.pos = pos
        return etype in _SCALARS and n <= _SHORT_ARRAY

    def data(self, ttype_name: str, shape: tuple[int, ...], offset: int) -> np.ndarray:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[ttype_name]]
        size = int(np.prod(shape)) // block * nbytes
        start = self.data_start + offset
        raw = self.buf[start:start + size]
        if ttype_name in ("F32", "F16"):
            return raw.view(np.float32 if ttype_name == "F32" else np.float16)
        if ttype_name == "BF16":  # bfloat16 is the high half of a float32
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return raw
