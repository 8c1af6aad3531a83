"""CUDA-graph bookkeeping without a GPU (buckets, padding, static buffers, fallback), and the
whole model on the triton backend (kernels interpreted here) against transformers' greedy
tokens: attention only, then with the fused ops and decode graphs replayed through
EagerRecorder (the static-buffer plumbing a CUDA graph replays)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_marks import requires_triton
from helpers import hf_greedy

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.layers.attention import SeqSpan
from kvmesh.worker.cuda_graphs import (
    DecodeGraphs,
    EagerRecorder,
    GraphBuffers,
    capture_sizes,
    pad_decode_inputs,
    pick_bucket,
)


def test_buckets():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(48)
    assert [pick_bucket(n, sizes) for n in (1, 3, 8, 9, 33, 48)] == [1, 4, 8, 16, 48, 48]
    assert pick_bucket(49, sizes) is None


def test_padding_rows_write_and_read_nothing():
    spans = [SeqSpan(0, 1, 5, [7, 3]), SeqSpan(1, 1, 0, [9])]
    inp = pad_decode_inputs(spans, [11, 12], bucket=4, max_blocks=3, block_size=4)
    assert inp.input_ids.tolist() == [11, 12, 0, 0] and inp.positions.tolist() == [5, 0, 0, 0]
    assert inp.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4, -1, -1]
    assert inp.context_lens.tolist() == [6, 1, 0, 0]
    assert inp.block_table.tolist() == [[7, 3, 0], [9, 0, 0], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="graph buffers hold 1"):
        pad_decode_inputs(spans, [11, 12], bucket=2, max_blocks=1, block_size=4)
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_inputs(spans, [11, 12], bucket=1, max_blocks=3, block_size=4)


def test_buffers_keep_their_addresses():
    buf = GraphBuffers(8, 3, torch.device("cpu"))
    ptrs = [t.data_ptr() for t in (buf.input_ids, buf.slot_mapping, buf.block_table)]
    buf.fill(pad_decode_inputs([SeqSpan(0, 1, 2, [5])], [4], 2, 3, 4))
    assert [t.data_ptr() for t in (buf.input_ids, buf.slot_mapping, buf.block_table)] == ptrs
    assert buf.slot_mapping[:2].tolist() == [22, -1] and buf.input_ids[0] == 4


class _Backend:
    def graph_metadata(self, slots, table, lens, max_ctx):
        return {"rows": slots.shape[0], "max_ctx": max_ctx}


def test_replay_reads_the_static_buffers_and_falls_back():
    calls = []

    def forward(ids, pos, meta):
        calls.append(meta["rows"])
        return (ids * 10 + pos)[:, None].float()

    graphs = DecodeGraphs(forward, _Backend(), 4, 32, 4, torch.device("cpu"), EagerRecorder())
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4] and calls == [4, 2, 1]  # largest first
    spans = [SeqSpan(0, 1, 3, [2]), SeqSpan(1, 1, 6, [5, 6]), SeqSpan(2, 1, 0, [1])]
    out = graphs.run(spans, [1, 2, 3])
    assert out.flatten().tolist() == [13, 26, 30] and calls[-1] == 4  # bucket 4, padded
    assert graphs.can_run(spans, 3)
    assert not graphs.can_run(spans + [SeqSpan(3, 4, 0, [8])], 3)  # a prefill chunk: eager
    assert not graphs.can_run([SeqSpan(i, 1, 0, [1]) for i in range(5)], 5)  # above the largest bucket
    assert not graphs.can_run([SeqSpan(0, 1, 40, [1] * 11)], 1)  # past max_model_len


def _prompts(vocab, lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy(engine, prompts, max_new):
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@requires_triton
@pytest.mark.parametrize("fused_ops_and_graphs", [False, True])
def test_whole_model_on_triton_matches_transformers(device, model_factory, fused_ops_and_graphs):
    from transformers import AutoModelForCausalLM

    if device.type != "cpu":
        pytest.skip("the CUDA model check is benchmarks/gpu_check.py")
    torch.set_num_threads(1)
    path = model_factory()
    # block size 4 and a 7-token budget: prefix blocks, chunked prefill, mixed steps
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=96, max_model_len=64,
                          max_num_batched_tokens=7, attention_backend="triton",
                          layer_ops="triton" if fused_ops_and_graphs else "auto")
    runner = engine.executor.runner
    if fused_ops_and_graphs:
        runner._capture_graphs(4, 64, EagerRecorder())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, (3, 9, 5))
    tokens = _greedy(engine, prompts, 6)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(hf, prompt, 6)
    if fused_ops_and_graphs:
        assert runner.graphs.replays > 0
    assert engine.num_free_blocks == engine.num_usable_blocks
    assert np.isfinite(runner.kv_caches[0][0].numpy()).all()
