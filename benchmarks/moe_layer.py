"""One MoE layer on CPU against a dense MLP of the same *active* parameters.

The MoE layer is the router gate (Linear(H, E)) plus FusedMoE (E experts, top k, expert
intermediate I); its dense twin is kvmesh's gated MLP with intermediate k I (the same
weights a token multiplies: gate-up (2 k I, H) + down (H, k I)). Two shapes scaled to fit
one layer in memory:

* **qwen3-moe**: Qwen3-30B-A3B's layer (H 2048, I 768, E 128, k 8): 2.4 GB of fp32 experts,
  150 MB active per token;
* **mixtral**: a Mixtral-like layer at 1/4 width (H 1024, I 3584, E 8, k 2): 352 MB of experts.

Variants: `moe cpu` (FusedMoE's native grouped path), `moe torch` (its PyTorch reference,
transformers' loop), `moe int8` / `moe int4` (quant/moe.py, native quantized GEMMs per
active expert), `dense cpu` (MergedColumnLinear + SiLU-and-mul + Linear, oneDNN prepacked
where the rows call for it). Each call gets a fresh input (so fresh routing: the experts a
call reads are not the previous call's); at batch 32 with 128 experts, ~100 of them get a
token, so the MoE layer reads most of its weights where the dense one reads 150 MB.
Medians over repeats; "GB/s" = weight bytes the call touched / time.

    python benchmarks/moe_layer.py [--threads 2] [--repeats 20] [--dtypes float32,bfloat16]
    python benchmarks/moe_layer.py --quick     # tiny shapes, 2 repeats: a smoke run (results not written
                                               # over the real ones: moe_layer_quick.*)

JSON + markdown + PNG into benchmarks/results/moe_layer.*; the load average (start and end)
and the CPU model are printed and stored beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch
from tqdm import tqdm

from kvmesh.config import KernelConfig
from kvmesh.layers import native
from kvmesh.layers.activation import SiluAndMul
from kvmesh.layers.linear import Linear, MergedColumnLinear
from kvmesh.layers.moe import FusedMoE, route
from kvmesh.layers.op import OpContext
from kvmesh.quant.methods import get_method
from kvmesh.quant.moe import QuantFusedMoE

from _common import check_idle, cpu_model, load_snapshot, md_table, median, time_calls, write_results

SHAPES = {  # name: (H, I, E, k)
    "qwen3-moe": (2048, 768, 128, 8),
    "mixtral": (1024, 3584, 8, 2),
}
QUICK_SHAPES = {"tiny-128e": (128, 64, 16, 4), "tiny-8e": (64, 96, 8, 2)}
BATCHES = (1, 32)
VARIANTS = ("moe cpu", "moe torch", "moe int8", "moe int4", "dense cpu")


class DenseMLP(torch.nn.Module):
    def __init__(self, h: int, inter: int, ctx: OpContext):
        super().__init__()
        self.gate_up = MergedColumnLinear(h, {"gate": inter, "up": inter}, bias=False, ctx=ctx)
        self.act = SiluAndMul(ctx)
        self.down = Linear(inter, h, bias=False, ctx=ctx)

    def forward(self, x):
        return self.down(self.act(self.gate_up(x)))


def _random_(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def build_layers(h: int, i: int, e: int, k: int, dtype: torch.dtype, variants: list[str]) -> tuple[Linear, dict]:
    """(router gate, {variant: (callable(x), weight bytes per expert or the dense layer's bytes)})."""
    gen = torch.Generator().manual_seed(0)
    cpu, ref = OpContext(dtype=dtype), OpContext(dtype=dtype, kernels=KernelConfig(cpu_kernels=False))
    gate = Linear(h, e, bias=False, ctx=cpu)
    _random_(gate, gen)
    moe = FusedMoE(e, k, h, i, renormalize=True, ctx=cpu)
    _random_(moe, gen)
    expert_bytes = 3 * h * i * dtype.itemsize
    layers = {}
    if "moe cpu" in variants:
        layers["moe cpu"] = (lambda x: moe(x, gate(x)), expert_bytes)
    if "moe torch" in variants:
        with torch.device("meta"):  # no second copy of the experts
            slow = FusedMoE(e, k, h, i, renormalize=True, ctx=ref)
        slow.w13, slow.w2 = moe.w13, moe.w2  # the same storage, the reference backend
        layers["moe torch"] = (lambda x: slow(x, gate(x)), expert_bytes)
    for scheme, group in (("int8", None), ("int4", 32)):
        if f"moe {scheme}" not in variants:
            continue
        method = get_method(scheme, group)
        q = QuantFusedMoE(scheme, e, k, h, i, renormalize=True, quantize=method.quantize_linear, ctx=cpu)
        q.weight_loader(None, moe.w13.detach().float(), None, "gate_up")
        q.weight_loader(None, moe.w2.detach().float(), None, "down")
        q.finalize(dtype)
        layers[f"moe {scheme}"] = (lambda x, q=q: q(x, gate(x)), q.weight_bytes() // e)
    if "dense cpu" in variants:
        dense = DenseMLP(h, k * i, cpu)
        _random_(dense, gen)
        dense.gate_up.prepack()
        dense.down.prepack()
        layers["dense cpu"] = (dense, 3 * h * k * i * dtype.itemsize)
    return gate, layers


def bench_case(shape: str, dtype: torch.dtype, batch: int, gate: Linear, layers: dict, repeats: int,
               bar) -> list[dict]:
    k = (QUICK_SHAPES | SHAPES)[shape][3]
    gen = torch.Generator().manual_seed(batch)
    xs = [torch.randn(batch, gate.in_features, generator=gen).to(dtype) for _ in range(repeats + 1)]
    with torch.no_grad():  # experts a call touches (one router gate for every MoE variant)
        active = [torch.unique(route(gate(x), k, True)[1]).numel() for x in xs]
    rows = []
    for name, (layer, unit_bytes) in layers.items():
        it = iter(xs)
        with torch.no_grad():
            times = time_calls(lambda: layer(next(it)), repeats, warmup=1)
        t = median(times)
        touched = unit_bytes * (median(active) if name.startswith("moe") else 1)
        rows.append({"shape": shape, "dtype": str(dtype).removeprefix("torch."), "batch": batch, "variant": name,
                     "ms": 1e3 * t, "ms_min": 1e3 * min(times), "active_experts": median(active),
                     "bytes_touched_mb": touched / 1e6, "gb_s": touched / t / 1e9})
        bar.update(1)
    dense = next((r for r in rows if r["variant"] == "dense cpu"), None)
    for r in rows:
        r["vs_dense"] = r["ms"] / dense["ms"] if dense else None
    return rows


def render(data: dict) -> str:
    lines = [f"# MoE layer vs dense MLP of the same active parameters ({data['date']})", "",
             f"CPU: {data['cpu']} ({data['isa']}), {data['threads']} threads; medians of {data['repeats']} calls, a "
             f"fresh input (routing) per call; load (1 min) at start {data['load_start']['1min']:.2f}, at end "
             f"{data['load_end']['1min']:.2f}.", "",
             "Shapes (H, expert I, experts E, top k): "
             + "; ".join(f"{n} {data['shapes'][n]}" for n in data["shapes"]) + ". Dense MLP: intermediate k I.", ""]
    lines += md_table(["shape", "dtype", "batch", "variant", "ms", "x dense", "experts hit", "MB touched", "GB/s"],
                      [[r["shape"], r["dtype"], r["batch"], r["variant"], f"{r['ms']:.3f}",
                        f"{r['vs_dense']:.2f}x" if r["vs_dense"] else "-",
                        f"{r['active_experts']:.0f}" if r["variant"].startswith("moe") else "-",
                        f"{r['bytes_touched_mb']:.1f}", f"{r['gb_s']:.1f}"] for r in data["rows"]], "lllrrrrrr")
    return "\n".join(lines) + "\n"


def plot(plt, data: dict):
    rows = data["rows"]
    cases = list(dict.fromkeys((r["shape"], r["dtype"], r["batch"]) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        ys = [next((r["ms"] for r in rows if (r["shape"], r["dtype"], r["batch"]) == c and r["variant"] == v), 0)
              for c in cases]
        ax.bar([n + (j - (len(variants) - 1) / 2) * width for n in range(len(cases))], ys, width, label=v)
    ax.set_xticks(range(len(cases)), [f"{s}\n{d} B{b}" for s, d, b in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer call (log)")
    ax.set_title(f"MoE layer vs dense MLP of equal active parameters, {data['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {sorted(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {list(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats: a smoke run")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    if not native.load():
        raise SystemExit("the kvmesh CPU kernels did not build on this machine")
    shapes = list(QUICK_SHAPES) if args.quick else args.shapes.split(",")
    repeats = 2 if args.quick else args.repeats
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS) or set(shapes) - set(SHAPES) - set(QUICK_SHAPES)
    if unknown:
        raise SystemExit(f"unknown shapes / variants: {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    check_idle(args.threads)
    print(f"CPU: {cpu_model()} ({native.isa()})", flush=True)
    data = {"date": dt.datetime.now().isoformat(timespec="minutes"), "cpu": cpu_model(), "isa": native.isa(),
            "threads": args.threads, "repeats": repeats, "quick": args.quick,
            "shapes": {s: (QUICK_SHAPES | SHAPES)[s] for s in shapes}, "load_start": load_snapshot(), "rows": []}
    total = len(shapes) * len(dtypes) * len(BATCHES) * len(variants)
    with tqdm(total=total, desc="moe layer") as bar:
        for shape in shapes:
            for dtype in dtypes:
                bar.set_postfix_str(f"building {shape} {dtype}")
                gate, layers = build_layers(*data["shapes"][shape], dtype, variants)
                for batch in BATCHES:
                    bar.set_postfix_str(f"{shape} {dtype} B{batch}")
                    data["rows"] += bench_case(shape, dtype, batch, gate, layers, repeats, bar)
                del gate, layers
    data["load_end"] = load_snapshot()
    md = render(data)
    print(md)
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    for path in write_results("moe_layer_quick" if args.quick else "moe_layer", data, md, plot, **kw):
        print("wrote", path)


if __name__ == "__main__":
    main()
