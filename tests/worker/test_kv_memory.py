"""The CPU KV cache's memory (worker/kv_memory.py): zero-filled as the attention kernels
assume (padded reads of the null block must be finite) without a memset at start, then
populated in the background without changing what the engine already wrote."""

import ctypes
import gc
import mmap
import platform
import resource
import threading
import weakref

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.build import build_engine
from kvmesh.worker import kv_memory
from kvmesh.worker.kv_memory import populate, populate_in_background, zeroed_tensor

CPU = torch.device("cpu")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


def _resident_fraction(t: torch.Tensor) -> float:
    """The fraction of `t`'s pages mapped in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def _madvise_range(t: torch.Tensor, advice: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(t.data_ptr(), t.numel() * t.element_size(), advice) == 0, ctypes.get_errno()


def _kernel_populates() -> bool:
    """MADV_POPULATE_WRITE exists from Linux 5.14."""
    if platform.system() != "Linux":
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_tensor_is_zero_writable_and_page_aligned(dtype):
    t = zeroed_tensor((64, 16, 2, 64), dtype, CPU)
    assert t.shape == (64, 16, 2, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % mmap.PAGESIZE == 0
    assert torch.count_nonzero(t) == 0
    t[3].fill_(1.5)
    assert t[3].float().sum().item() == 1.5 * 16 * 2 * 64 and torch.count_nonzero(t[4]) == 0


def test_zeroed_tensor_small_shape_is_plain_zeros():
    t = zeroed_tensor((3, 5), torch.float32, CPU)
    assert t.shape == (3, 5) and torch.count_nonzero(t) == 0


def test_allocation_writes_nothing_and_populate_keeps_contents():
    before = _rss_mib()
    t = zeroed_tensor((512, 1 << 18), torch.float32, CPU)  # 512 MiB
    assert _rss_mib() - before < 32, "the pages were written at allocation"
    # Plain pages here: Linux >= 6.12 with transparent_hugepage/shrink_underused splits huge
    # pages that hold mostly zeros and frees those subpages under memory pressure (seen in
    # a full test run: 176 of 512 MiB still mapped after the populate), which would measure
    # the kernel's reclaim, not the populate.
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        _madvise_range(t, mmap.MADV_NOHUGEPAGE)
    t[7].fill_(2.0)  # the engine wrote a block before the populate thread got there
    t[300, :5] = torch.arange(5.0)
    populated = populate([t])
    assert populated == _kernel_populates()
    if populated:
        assert _rss_mib() - before > 480, "populate left pages unmapped"
    assert (t[7] == 2.0).all() and t[300, :5].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert torch.count_nonzero(t) == (1 << 18) + 4


def test_background_populate_stops_when_the_cache_is_dropped(monkeypatch):
    if not _kernel_populates():
        pytest.skip("MADV_POPULATE_WRITE needs Linux >= 5.14: the populate thread ends at its first call")

    real = kv_memory._madvise()
    calls: list[int] = []  # madvise return codes, one per 16 MiB chunk populated
    first_chunk = threading.Event()

    def counting_madvise():
        def madvise(addr, length, advice):
            rc = real(addr, length, advice)
            calls.append(rc)
            first_chunk.set()
            return rc
        return madvise

    monkeypatch.setattr(kv_memory, "_madvise", counting_madvise)
    chunks = 16
    t = zeroed_tensor((256, 1 << 18), torch.float32, CPU)  # 256 MiB: 16 chunks
    dropped = weakref.ref(t)
    thread = populate_in_background([t], duty=0.01)  # ~99x its work asleep after each chunk
    assert first_chunk.wait(60)
    del t
    gc.collect()
    assert dropped() is None, "the populate thread kept a strong reference to the cache"
    thread.join(60)  # hang guard
    assert not thread.is_alive()
    # It stopped because the weak reference died: every chunk it did succeeded, and it did
    # not go on to the end of the (freed) cache.
    assert calls and all(rc == 0 for rc in calls)
    assert len(calls) < chunks, f"populated all {chunks} chunks of a dropped cache"


def test_engine_cache_starts_zero_and_returns_every_block(model_factory):
    engine = build_engine(model=str(model_factory()), progress=False, num_blocks=64, num_threads=1)
    runner = engine.executor.runner
    runner.kv_populate.join(30)
    assert not runner.kv_populate.is_alive()
    assert all(torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0 for k, v in runner.kv_caches)
    engine.add_request("r", [5, 6, 7, 8, 9] * 7, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert len(done[0].outputs[0].token_ids) == 4
    assert any(torch.count_nonzero(k) > 0 for k, _ in runner.kv_caches)  # the prompt's KV was written
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_startup_populate_maps_the_cache_before_the_engine_is_ready(model_factory):
    """kv_cache_populate=startup maps every page of the cache before build_engine returns (no
    background thread, no page faults in the first steps); the offline LLM class defaults to
    it, a served worker's engine (the config default) to the background thread."""
    if not _kernel_populates():
        pytest.skip("MADV_POPULATE_WRITE needs Linux >= 5.14: the cache stays lazy there")
    model = str(model_factory())
    engine = build_engine(model=model, progress=False, num_blocks=64, num_threads=1, kv_cache_populate="startup")
    runner = engine.executor.runner
    assert runner.kv_populate is None
    tensors = [t for kv in runner.kv_caches for t in kv]
    assert all(_resident_fraction(t) == 1.0 for t in tensors)
    assert all(torch.count_nonzero(t) == 0 for t in tensors)
    engine.close()

    with LLM(model=model, progress=False, num_blocks=64, num_threads=1) as llm:
        assert llm.engine.config.cache.kv_cache_populate == "startup"
        assert llm.engine.executor.runner.kv_populate is None
    with LLM(model=model, progress=False, num_blocks=64, num_threads=1, kv_cache_populate="background") as llm:
        assert llm.engine.executor.runner.kv_populate is not None
    fresh = build_engine(model=model, progress=False, num_blocks=64, num_threads=1)
    assert fresh.config.cache.kv_cache_populate == "background" and fresh.executor.runner.kv_populate is not None
    fresh.close()
