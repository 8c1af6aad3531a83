"""The scheduler's KVLoader hook: KV computed by one engine, loaded into another.

This is the seam the shared prefix store and P/D transfer plug into; here the
"remote" side is a second real engine whose blocks are read with
`ModelRunner.read_blocks`.
"""

import pytest
import torch

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.hashing import block_hashes

BS = 4


def _engine(path):
    return build_engine(model=str(path), progress=False, block_size=BS, num_blocks=128, max_model_len=256)


class CopyFromEngine:
    """Serves full blocks of one prompt whose KV lives in another engine's cache."""

    def __init__(self, src: LLMEngine, dst: LLMEngine, prompt: list[int], src_block_ids: list[int],
                 fail_after: int | None = None):
        self.src, self.dst, self.prompt, self.src_blocks = src, dst, prompt, src_block_ids
        self.fail_after = fail_after
        self.loaded = 0

    def lookup(self, request, num_local):
        n = 0
        while n + BS <= len(self.prompt) and request.all_token_ids[: n + BS] == self.prompt[: n + BS]:
            n += BS
        return max(n - num_local, 0)

    def load(self, request, block_ids, start, num_tokens):
        first, n = start // BS, num_tokens // BS
        if self.fail_after is not None:
            n = min(n, self.fail_after)
        data = self.src.executor.read_blocks(self.src_blocks[first : first + n])
        self.dst.executor.write_blocks(block_ids[first : first + n], data)
        self.loaded += n * BS
        return n * BS


@pytest.mark.parametrize("fail_after", [None, 2])
def test_loaded_kv_gives_identical_output_and_skips_compute(tiny_llama, fail_after):
    torch.set_num_threads(1)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = torch.randint(3, 384, (26,), generator=torch.Generator().manual_seed(0)).tolist()

    src = _engine(tiny_llama)
    src.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0))
    src.step()  # prefill; the request finishes, its full blocks stay cached in src
    # The prompt's blocks, found in src's prefix cache by their chained hashes.
    hashes = block_hashes(prompt, BS, src.fingerprint)
    src_blocks = [src.kv_manager.pool.get_cached_block(h).block_id for h in hashes]
    assert len(src_blocks) == 6

    ref = _engine(tiny_llama)
    ref.add_request("x", prompt, greedy)
    expected = None
    while ref.has_unfinished():
        for o in ref.step():
            expected = o.outputs[0].token_ids

    dst = _engine(tiny_llama)
    loader = CopyFromEngine(src, dst, prompt, src_blocks, fail_after=fail_after)
    dst.scheduler.kv_loader = loader
    dst.add_request("x", prompt, greedy)
    sched = dst.scheduler.schedule()
    (seq,) = sched.seqs
    loaded = 24 if fail_after is None else 8
    assert loader.loaded == loaded
    assert seq.start_pos == loaded and seq.num_tokens == 26 - loaded  # only the tail is computed
    out = dst.executor.execute(sched)
    dst.scheduler.update_from_output(sched, out)
    tokens = [t for ts in out.sampled_token_ids.values() for t in ts]
    while dst.has_unfinished():
        sched = dst.scheduler.schedule()
        out = dst.executor.execute(sched)
        dst.scheduler.update_from_output(sched, out)
        tokens += [t for ts in out.sampled_token_ids.values() for t in ts]
    assert tokens == expected
    dst._states.clear()
    assert dst.num_free_blocks == dst.num_usable_blocks
