"""Where each scheduled token's K/V goes in the paged cache: the flat slot index
block_id * block_size + offset, for every token of every span in batch order (what every
attention backend writes through)."""

from __future__ import annotations

import numpy as np


def slot_mapping(spans, block_size: int) -> np.ndarray:
    """(T,) int64 slots of the tokens at positions [start_pos, ctx_len) of each span."""
    slots = []
    for s in spans:
        pos = np.arange(s.start_pos, s.ctx_len)
        table = np.asarray(s.block_ids, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return np.concatenate(slots)
