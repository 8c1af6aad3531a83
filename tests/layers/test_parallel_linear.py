"""layers/linear.py: tensor-parallel layouts (real torch.distributed over gloo, two processes)
and the LoRA delta hook, against the unsharded layer."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import run_collecting_logits

from kvmesh import SamplingParams
from kvmesh.build import build_engine
from kvmesh.layers.linear import Linear, MergedColumnLinear
from kvmesh.layers.op import OpContext, TPGroup

HIDDEN, INTER = 32, 48


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"gate": torch.randn(INTER, HIDDEN, generator=g), "up": torch.randn(INTER, HIDDEN, generator=g),
            "gate_b": torch.randn(INTER, generator=g), "up_b": torch.randn(INTER, generator=g),
            "down": torch.randn(HIDDEN, INTER, generator=g), "down_b": torch.randn(HIDDEN, generator=g),
            "x": torch.randn(5, HIDDEN, generator=g)}


def _mlp(ctx: OpContext, w) -> tuple[MergedColumnLinear, Linear]:
    gate_up = MergedColumnLinear(HIDDEN, {"gate": INTER, "up": INTER}, bias=True, ctx=ctx)
    down = Linear(INTER, HIDDEN, bias=True, ctx=ctx, parallel="row")
    for shard in ("gate", "up"):
        gate_up.weight_loader(gate_up.weight, w[shard], shard)
        gate_up.weight_loader(gate_up.bias, w[f"{shard}_b"], shard)
    down.weight_loader(down.weight, w["down"])
    down.weight_loader(down.bias, w["down_b"])
    return gate_up, down


def _run(gate_up, down, x):
    gu = gate_up(x)
    gate, up = gu.chunk(2, dim=-1)
    return down(F.silu(gate) * up)


def _rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        w = _weights()
        ctx = OpContext(tp=TPGroup(rank, 2, dist.group.WORLD))
        gate_up, down = _mlp(ctx, w)
        assert gate_up.weight.shape == (INTER, HIDDEN) and down.weight.shape == (HIDDEN, INTER // 2)
        with torch.inference_mode():
            torch.save(_run(gate_up, down, w["x"]), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_column_then_row_parallel_equals_unsharded(tmp_path):
    """gate-up split by columns, down by rows with one all-reduce: each rank's output is the
    unsharded MLP's (the bias added once, after the reduce)."""
    w = _weights()
    with torch.inference_mode():
        ref = _run(*_mlp(OpContext(), w), w["x"])
    mp.start_processes(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    # fp32 partial sums over half of K each, then added, against one sum over K: rounding apart
    # (the kernels' own tolerance, tests/worker/test_linear.py).
    for rank in (0, 1):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), ref, rtol=1e-4, atol=1e-4)


def test_sharding_needs_divisible_shapes():
    with pytest.raises(ValueError, match="not divisible by the tensor parallel size 2"):
        Linear(HIDDEN, 7, ctx=OpContext(tp=TPGroup(0, 2)), parallel="column")
    with pytest.raises(ValueError, match="outside world size"):
        TPGroup(2, 2)


def test_lora_delta_hook():
    g = torch.Generator().manual_seed(1)
    lin = Linear(HIDDEN, 24)
    a, b = torch.randn(4, HIDDEN, generator=g), torch.randn(24, 4, generator=g)  # rank-4 LoRA
    x = torch.randn(3, HIDDEN, generator=g)
    with torch.inference_mode():
        base = lin(x)
        assert lin.stack_form() is not None
        lin.set_delta(lambda inp, y: y + (inp @ a.t()) @ b.t())
        torch.testing.assert_close(lin(x), base + x @ a.t() @ b.t(), rtol=1e-5, atol=1e-5)
        # A delta is the identity off adapter rows (layers/lora.py), so the layer keeps its
        # decode-stack form; the stack itself steps aside on steps with adapter rows.
        assert lin.stack_form() is not None
        lin.set_delta(None)
        assert torch.equal(lin(x), base) and lin.stack_form() is not None


def test_a_delta_set_after_build_keeps_base_steps_on_the_decode_stack(model_factory, stack_calls):
    """The decode stack gathers its layers once; a LoRA delta set afterwards is the identity
    on steps without adapter rows (`lora.active()` false), so those steps stay on the stack,
    with the same tokens, while a forward under a `lora_batch` goes through the layer loop."""
    from kvmesh.layers import lora

    path = model_factory()
    prompts = [[5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = build_engine(model=str(path), progress=False, block_size=4, num_blocks=64)
    stack_calls.clear()
    ref, _ = run_collecting_logits(engine, prompts, params)
    assert any(stack_calls)
    model = engine.executor.runner.model
    seen = []

    def delta(x, y):
        seen.append(lora.active())
        return y

    model.model.layers[0].self_attn.qkv_proj.set_delta(delta)
    stack_calls.clear()
    engine.reset_prefix_cache()
    got, _ = run_collecting_logits(engine, prompts, params)
    assert got == ref
    assert any(stack_calls), "base-only decode steps left the decode stack"
    assert seen and not any(seen)  # the prefill (layer loop) called it, never under adapters
