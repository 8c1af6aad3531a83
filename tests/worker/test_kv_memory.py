"""The CPU KV cache's memory: zero-filled as the attention kernels assume (padded reads of
the null block must be finite), without writing it up front (lazily mapped zero pages), so
a worker's cold start does not pay a memset of its whole cache budget."""

import mmap
import resource

import pytest
import torch

from kvmesh.build import build_engine
from kvmesh.worker.model_runner import zeroed_tensor
from kvmesh import SamplingParams


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / (1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_tensor_is_zero_writable_and_page_aligned(dtype):
    t = zeroed_tensor((64, 16, 2, 64), dtype, torch.device("cpu"))
    assert t.shape == (64, 16, 2, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % mmap.PAGESIZE == 0
    assert torch.count_nonzero(t) == 0
    t[3].fill_(1.5)
    assert t[3].float().sum().item() == 1.5 * 16 * 2 * 64 and torch.count_nonzero(t[4]) == 0


def test_zeroed_tensor_small_shape_is_plain_zeros():
    t = zeroed_tensor((3, 5), torch.float32, torch.device("cpu"))
    assert t.shape == (3, 5) and torch.count_nonzero(t) == 0


def test_large_cache_is_not_written_up_front():
    before = _rss_mib()
    t = zeroed_tensor((1024, 1 << 18), torch.float32, torch.device("cpu"))  # 1 GiB
    assert _rss_mib() - before < 64, "the cache's pages were touched at allocation"
    t[0].fill_(2.0)  # first touch maps only what is written
    assert t[0, -1].item() == 2.0 and t[-1, -1].item() == 0.0
    assert _rss_mib() - before < 128


def test_engine_cache_starts_zero_and_returns_every_block(model_factory):
    engine = build_engine(model=str(model_factory()), progress=False, num_blocks=64, num_threads=1)
    runner = engine.executor.runner
    assert all(torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0 for k, v in runner.kv_caches)
    engine.add_request("r", [5, 6, 7, 8, 9] * 7, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert len(done[0].outputs[0].token_ids) == 4
    assert any(torch.count_nonzero(k) > 0 for k, _ in runner.kv_caches)  # the prompt's KV was written
    assert engine.num_free_blocks == engine.num_usable_blocks
