"""The CPU KV cache's memory: zero-filled without a memset at start, populated in the
background.

`torch.zeros` of the cache writes every page before the worker can serve: ~3 s for the
default 2 GiB on a fresh VM (guest memory touched for the first time) and several times
that beside a loaded replica, which is most of an autoscaled replica's start. Left lazy
(zero pages the kernel maps on first write), the cost moves into serving instead: each
step that writes a never-used block takes page faults, ~10% of offline throughput until
the LRU free queue has cycled through every block. So the cache is allocated as anonymous
zero memory (`zeroed_tensor`) and a low-priority thread then asks the kernel to populate
it (`populate_in_background`: madvise MADV_POPULATE_WRITE, Linux >= 5.14, which maps the
pages without writing their contents), paced to a fifth of the time: the worker is ready at
once and at full speed seconds later. Elsewhere (older kernels, other systems) the pages stay lazy.

The thread runs at nice 19, so a worker busy from its first second (a load test, an offline
batch) starves it: on a 2-vCPU Zen 4 VM it was still running after a minute of steps, which
then took the faults themselves (huge pages on memory the VM had never touched: 2 GiB cost
3-5 s to map, ~7% of an offline pass that wrote ~0.9 GiB of fresh blocks). So
`kv_cache_populate: startup` (the offline `LLM`'s default) maps the whole cache with `populate`
before the engine is ready, as vLLM's zeroed cache does.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # linux/mman.h (Python's mmap module does not name it)
_CHUNK_BYTES = 16 << 20  # one madvise call's span: the thread yields between calls
BACKGROUND_DUTY = 0.2  # the background populate runs a fifth of the time (2 GiB: ~1.3 s of work, ~7 s wall here)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it lies in page-aligned anonymous memory that the
    kernel maps as zero pages when first written (calloc's promise without the memset),
    advised into transparent huge pages where the kernel offers them; elsewhere it is
    `torch.zeros`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        buf.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds `buf` (unmapped when the last view of it goes).
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[weakref.ref, int, int]]:
    """(weak reference, first byte, end) of each CPU tensor: a populate thread must not
    keep a dropped engine's cache alive."""
    return [(weakref.ref(t), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for t in tensors if t.device.type == "cpu"]


def _rounds(spans: list[tuple[weakref.ref, int, int]]) -> list[tuple[weakref.ref, int, int]]:
    """The spans cut into (ref, start, end) pieces ordered so that every tensor advances
    together, each round covering the same fraction of each: the cache's layers are separate
    tensors indexed by block, and the block pool hands out low block ids first, so the pages
    of block b in every layer are mapped before those of block b + 1 in any (populating
    layer by layer left the last layers' pages lazy until the very end)."""
    total = sum(end - start for _, start, end in spans)
    rounds = max(1, -(-total // _CHUNK_BYTES))
    pieces: list[tuple[weakref.ref, int, int]] = []
    cuts = []
    for ref, start, end in spans:
        start -= start % mmap.PAGESIZE
        step = -(-(end - start) // rounds)
        step += -step % mmap.PAGESIZE
        cuts.append((ref, start, end, step))
    for i in range(rounds):
        for ref, start, end, step in cuts:
            a = start + i * step
            if a < end:
                pieces.append((ref, a, min(a + step, end)))
    return pieces


def _populate_spans(spans: list[tuple[weakref.ref, int, int]], duty: float) -> bool:
    madvise = _madvise()
    if madvise is None:
        return False
    began = time.monotonic()
    done = 0
    for ref, start, end in _rounds(spans):
        if ref() is None:  # the cache was dropped: its memory is gone (or someone else's)
            continue
        # ctypes releases the GIL for the call: the engine's threads run meanwhile.
        if madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            logger.debug("KV cache populate stopped: %s", os.strerror(err))
            return False
        done += end - start
        if duty < 1.0 and done >= _CHUNK_BYTES:  # pace per chunk's worth of pages
            time.sleep((time.monotonic() - began) * (1.0 - duty) / max(duty, 1e-3))
            began, done = time.monotonic(), 0
    return True


def populate(tensors: Iterable[torch.Tensor], duty: float = 1.0) -> bool:
    """Map every page of these CPU tensors now (MADV_POPULATE_WRITE) without changing
    their contents, so later writes take no page faults. Safe while the tensors are in
    use: a page already mapped is left as it is. `duty` < 1 paces it: after each chunk it
    sleeps so that it runs that fraction of the time. False where the kernel cannot (the
    pages then stay lazy)."""
    return _populate_spans(_spans(tensors), duty)


def populate_in_background(tensors: list[torch.Tensor], duty: float = BACKGROUND_DUTY) -> threading.Thread:
    """`populate` on a daemon thread at the lowest CPU priority (nice 19) and paced to
    `duty` of the time: a replica that has just started is needed at once, and mapping
    fresh memory in a VM costs hypervisor work that no priority can defer (unpaced, it cost
    an autoscaled replica's start ~2x its time on 2 shared cores). Returns the thread."""
    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        _populate_spans(spans, duty)

    spans = _spans(tensors)  # the thread holds no strong reference: a dropped cache stops it
    thread = threading.Thread(target=run, name="kvmesh-kv-populate", daemon=True)
    thread.start()
    return thread
