"""The batched multi-LoRA delta (layers/lora_kernels.py) on CPU: the native kernel against the
PyTorch reference (a loop over segments, two matmuls per shard).

Decode-shaped steps: T rows (1..64 sequences, one row each) grouped into segments of equal
size, one adapter slot each (`--adapters`, 4 by default), on three projections:

* **smollm2 qkv**: SmolLM2-135M's fused q / k / v (K 576, shards 576 + 192 + 192), rank 16;
* **llama8b qkv**: Llama-3-8B's (K 4096, shards 4096 + 1024 + 1024), rank 16;
* **llama8b o**: Llama-3-8B's o_proj (K 4096, N 4096), rank 64.

Medians over repeats; "MB" = the adapters' A and B bytes a call reads.

    python benchmarks/lora_kernels.py [--threads 2] [--repeats 50] [--dtypes float32,bfloat16]
    python benchmarks/lora_kernels.py --quick    # tiny shapes, 3 repeats: a smoke run (lora_kernels_quick.*)

JSON + markdown + PNG into benchmarks/results/lora_kernels.*; the load average (start and end)
and the CPU model are printed and stored beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch

from kvmesh.layers import native
from kvmesh.layers.lora_kernels import lora_sgmv_native, lora_sgmv_torch

from _common import check_idle, cpu_model, load_snapshot, md_table, median, time_calls, write_results

SHAPES = {  # name: (K, shard widths, R)
    "smollm2 qkv": (576, (576, 192, 192), 16),
    "llama8b qkv": (4096, (4096, 1024, 1024), 16),
    "llama8b o": (4096, (4096,), 64),
}
QUICK_SHAPES = {"tiny qkv": (64, (64, 16, 16), 8), "tiny o": (96, (96,), 16)}
BATCHES = (1, 16, 64)
VARIANTS = {"native": lora_sgmv_native, "torch": lora_sgmv_torch}


def build_case(k: int, widths: tuple[int, ...], r: int, t: int, adapters: int, dtype: torch.dtype) -> tuple:
    """(y, x, a, b, starts, lens, slots, offsets) for T rows in min(T, adapters) equal segments."""
    g = torch.Generator().manual_seed(t)
    n, slots = sum(widths), max(adapters, 1)
    a = (torch.randn(len(widths), slots, r, k, generator=g) * k ** -0.5).to(dtype)
    b = (torch.randn(slots, r, n, generator=g) * r ** -0.5).to(dtype)
    x, y = torch.randn(t, k, generator=g).to(dtype), torch.zeros(t, n, dtype=dtype)
    segs = min(t, slots)
    bounds = [t * i // segs for i in range(segs + 1)]
    starts = torch.tensor(bounds[:-1])
    lens = torch.tensor([hi - lo for lo, hi in zip(bounds, bounds[1:])])
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return y, x, a, b, starts, lens, torch.arange(segs), offsets


def bench_case(shape: str, dtype: torch.dtype, t: int, adapters: int, repeats: int) -> list[dict]:
    k, widths, r = (QUICK_SHAPES | SHAPES)[shape]
    args = build_case(k, widths, r, t, adapters, dtype)
    segments = args[6].numel()
    mb = segments * (len(widths) * r * k + r * sum(widths)) * dtype.itemsize / 1e6
    rows = []
    for name, fn in VARIANTS.items():
        times = time_calls(lambda fn=fn: fn(*args), repeats, warmup=2)
        t_med = median(times)
        rows.append({"shape": shape, "dtype": str(dtype).removeprefix("torch."), "batch": t, "segments": segments,
                     "variant": name, "us": 1e6 * t_med, "us_min": 1e6 * min(times), "mb": mb,
                     "gb_s": mb / 1e3 / t_med})
    ref = next(r for r in rows if r["variant"] == "torch")
    for row in rows:
        row["speedup"] = ref["us"] / row["us"]
    return rows


def render(data: dict) -> str:
    lines = [f"# Batched multi-LoRA delta on CPU: native vs PyTorch reference ({data['date']})", "",
             f"CPU: {data['cpu']} ({data['isa']}), {data['threads']} threads; medians of {data['repeats']} calls; "
             f"up to {data['adapters']} adapters per step; load (1 min) at start {data['load_start']['1min']:.2f}, "
             f"at end {data['load_end']['1min']:.2f}.", "",
             "Shapes (K, shard widths, R): " + "; ".join(f"{n} {data['shapes'][n]}" for n in data["shapes"]) + ".", ""]
    lines += md_table(["shape", "dtype", "T", "segments", "variant", "us", "x torch", "MB", "GB/s"],
                      [[r["shape"], r["dtype"], r["batch"], r["segments"], r["variant"], f"{r['us']:.1f}",
                        f"{r['speedup']:.2f}x", f"{r['mb']:.2f}", f"{r['gb_s']:.1f}"] for r in data["rows"]],
                      "lllrlrrrr")
    return "\n".join(lines) + "\n"


def plot(plt, data: dict):
    rows = data["rows"]
    cases = list(dict.fromkeys((r["shape"], r["dtype"], r["batch"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases)), 4))
    for j, v in enumerate(VARIANTS):
        ys = [next((r["us"] for r in rows if (r["shape"], r["dtype"], r["batch"]) == c and r["variant"] == v), 0)
              for c in cases]
        ax.bar([n + (j - 0.5) * 0.4 for n in range(len(cases))], ys, 0.4, label=v)
    ax.set_xticks(range(len(cases)), [f"{s}\n{d} T{b}" for s, d, b in cases], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("us per call (log)")
    ax.set_title(f"lora_sgmv on CPU, {data['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated of {sorted(SHAPES)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 3 repeats: a smoke run")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    if not native.load():
        raise SystemExit("the kvmesh CPU kernels did not build on this machine")
    shapes = list(QUICK_SHAPES) if args.quick else args.shapes.split(",")
    unknown = set(shapes) - set(SHAPES) - set(QUICK_SHAPES)
    if unknown:
        raise SystemExit(f"unknown shapes: {sorted(unknown)}")
    repeats = 3 if args.quick else args.repeats
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    torch.set_num_threads(args.threads)
    check_idle(args.threads)
    print(f"CPU: {cpu_model()} ({native.isa()})", flush=True)
    data = {"date": dt.datetime.now().isoformat(timespec="minutes"), "cpu": cpu_model(), "isa": native.isa(),
            "threads": args.threads, "repeats": repeats, "adapters": args.adapters, "quick": args.quick,
            "shapes": {s: (QUICK_SHAPES | SHAPES)[s] for s in shapes}, "load_start": load_snapshot(), "rows": []}
    with torch.no_grad():
        for shape in shapes:
            for dtype in dtypes:
                for t in BATCHES:
                    data["rows"] += bench_case(shape, dtype, t, args.adapters, repeats)
    data["load_end"] = load_snapshot()
    md = render(data)
    print(md)
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    for path in write_results("lora_kernels_quick" if args.quick else "lora_kernels", data, md, plot, **kw):
        print("wrote", path)


if __name__ == "__main__":
    main()
