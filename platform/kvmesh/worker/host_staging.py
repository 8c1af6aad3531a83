"""Device -> host copies of KV blocks through one reused page-locked (pinned) buffer.

The shared KV store path (kv_connector.py) turns blocks read from the cache into bytes on
the host. From a CUDA cache, a copy into pageable memory goes through a driver bounce
buffer and allocates every time; a pinned buffer takes the DMA directly and is allocated
once (grown when a larger read comes). On the CPU there is nothing to copy: `to_host`
returns the tensor itself.
"""

from __future__ import annotations

import torch


class HostStaging:
    """One reused host buffer; `pin` page-locks it (CUDA machines only: pinning needs the
    CUDA driver). Not thread-safe: one caller at a time (the engine's step thread)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffer: torch.Tensor | None = None
        self.allocations = 0  # how often the buffer was (re)allocated

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the CPU: itself when it already is, else a copy in the reused buffer,
        valid until the next call (take bytes out of it before calling again)."""
        return t if t.device.type == "cpu" else self.copy(t)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """Copy `t` (any device) into the buffer; returns a view of `t`'s shape and dtype."""
        nbytes = t.numel() * t.element_size()
        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(nbytes, 2 * self._buffer.numel() if self._buffer is not None else 0)
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        out = self._buffer[:nbytes].view(t.dtype).view(t.shape)
        out.copy_(t, non_blocking=True)  # asynchronous from CUDA into pinned memory ...
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()  # ... and complete before anyone reads it
        return out
