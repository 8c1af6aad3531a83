"""The decode-time CPU kernels against PyTorch doing the same work, side by side.

* **Paged decode attention** (`torch.ops.kvmesh.paged_decode_attention`, csrc/paged_attention.cpp)
  vs PyTorch's fused CPU SDPA on the same K/V gathered from the paged cache (the gather
  not timed, so the peer is favoured), SmolLM2-135M's head layout (9 query heads, 3 KV
  heads, head size 64, blocks of 16 tokens). Two cache states: **warm** (the same
  sequences every call: their K/V stay in L2/L3) and **cold** (a 64 MB buffer is written
  between calls, as the GEMM weights do between a layer's attention calls in the engine).
  Blocks are scattered over a 500 MB cache, as after a long-running server's churn.
* **Batch-1 linear** (`torch.ops.kvmesh.skinny_linear`, csrc/skinny_gemm.cpp) vs
  `F.linear` (MKL) over every weight of SmolLM2-135M (30 layers x qkv, o, gate_up, down,
  plus the tied lm_head: 538 MB, so every pass streams from DRAM), one input row.

Medians over repeats; effective bandwidth = bytes of K/V (or weights) read / time. Ratios
are against the peer measured in the same run. JSON + markdown + PNG into
benchmarks/results/cpu_kernels.*; the load average is printed and stored.

    python benchmarks/cpu_kernels.py [--threads 2] [--repeats 25]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvmesh.layers import native

from _common import check_idle, cpu_model, load_snapshot, md_table, write_results

H, KVH, D, BS = 9, 3, 64, 16
ATTN_CASES = [(1, 600), (12, 576), (48, 130)]  # (sequences, context tokens)
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _median_time(fn, repeats: int, before=None) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_attention(repeats: int, bar) -> list[dict]:
    nblocks = 40000  # 2 x 480 MB of fp32 K/V
    kc, vc = torch.randn(nblocks, BS, KVH, D), torch.randn(nblocks, BS, KVH, D)
    junk = torch.empty(16 << 20)  # 64 MB written between calls: a cold cache
    rows = []
    for b, ctx in ATTN_CASES:
        nb = (ctx + BS - 1) // BS
        table = torch.randperm(nblocks)[: b * nb].view(b, nb)
        lens = torch.full((b,), ctx, dtype=torch.int64)
        q = torch.randn(b, H, D)
        # The peer: SDPA over the gathered K/V (B, KVH*G heads, ctx, D); the gather is not timed.
        k = kc[table].reshape(b, nb * BS, KVH, D)[:, :ctx].permute(0, 2, 1, 3).repeat_interleave(H // KVH, 1)
        v = vc[table].reshape(b, nb * BS, KVH, D)[:, :ctx].permute(0, 2, 1, 3).repeat_interleave(H // KVH, 1)
        k, v, qq = k.contiguous(), v.contiguous(), q.unsqueeze(2)
        ours = lambda: torch.ops.kvmesh.paged_decode_attention(q, kc, vc, table, lens, D ** -0.5)  # noqa: E731
        peer = lambda: F.scaled_dot_product_attention(qq, k, v)  # noqa: E731
        err = (ours() - peer().squeeze(2)).abs().max().item()
        nbytes = b * ctx * KVH * D * 4 * 2
        for cache, before in (("warm", None), ("cold", lambda: junk.fill_(1.0))):
            t_ours = _median_time(ours, repeats, before)
            t_peer = _median_time(peer, repeats, before)
            rows.append({"sequences": b, "context": ctx, "cache": cache, "kvmesh_us": 1e6 * t_ours,
                         "sdpa_us": 1e6 * t_peer, "kvmesh_gb_s": nbytes / t_ours / 1e9,
                         "sdpa_gb_s": nbytes / t_peer / 1e9, "speedup": t_peer / t_ours, "max_abs_err": err})
            bar.update(1)
    return rows


def bench_linear(repeats: int, bar) -> dict:
    weights = [torch.randn(n, k) for n, k in LINEAR_SHAPES]
    xs = {k: torch.randn(1, k) for k in {k for _, k in LINEAR_SHAPES}}
    nbytes = sum(w.numel() * 4 for w in weights)
    err = max((torch.ops.kvmesh.skinny_linear(xs[w.shape[1]], w, None) - F.linear(xs[w.shape[1]], w)).abs().max().item()
              for w in weights[:5])

    def ours():
        for w in weights:
            torch.ops.kvmesh.skinny_linear(xs[w.shape[1]], w, None)

    def peer():
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    t_ours = _median_time(ours, max(5, repeats // 3))
    bar.update(1)
    t_peer = _median_time(peer, max(5, repeats // 3))
    bar.update(1)
    return {"weights_mb": nbytes / 1e6, "kvmesh_ms": 1e3 * t_ours, "mkl_ms": 1e3 * t_peer,
            "kvmesh_gb_s": nbytes / t_ours / 1e9, "mkl_gb_s": nbytes / t_peer / 1e9, "speedup": t_peer / t_ours,
            "max_abs_err": err}


def render(data: dict) -> str:
    lines = [f"# Decode CPU kernels vs PyTorch ({data['date']})", "",
             f"CPU: {data['cpu']} ({data['isa']}), {data['threads']} threads; medians of {data['repeats']} calls; "
             f"load (1 min) at start {data['load_start']['1min']:.2f}, at end {data['load_end']['1min']:.2f}.", "",
             "## Paged decode attention (9 heads / 3 KV heads / d 64, fp32, blocks scattered over 500 MB)", ""]
    lines += md_table(["sequences", "context", "cache", "kvmesh us", "SDPA us (gathered K/V)", "kvmesh GB/s",
                       "SDPA GB/s", "kvmesh / SDPA speed", "max abs err"],
                      [[r["sequences"], r["context"], r["cache"], f"{r['kvmesh_us']:.0f}", f"{r['sdpa_us']:.0f}",
                        f"{r['kvmesh_gb_s']:.1f}", f"{r['sdpa_gb_s']:.1f}", f"{r['speedup']:.2f}x",
                        f"{r['max_abs_err']:.1e}"] for r in data["attention"]], "rrlrrrrrr")
    lin = data["linear"]
    lines += ["", f"## Batch-1 linear over all of SmolLM2-135M's weights ({lin['weights_mb']:.0f} MB, from DRAM)", ""]
    lines += md_table(["kernel", "ms per pass", "GB/s"],
                      [["kvmesh skinny_linear", f"{lin['kvmesh_ms']:.2f}", f"{lin['kvmesh_gb_s']:.1f}"],
                       ["F.linear (MKL)", f"{lin['mkl_ms']:.2f}", f"{lin['mkl_gb_s']:.1f}"]], "lrr")
    lines += ["", f"kvmesh / MKL: {lin['speedup']:.2f}x (max abs err {lin['max_abs_err']:.1e})", ""]
    return "\n".join(lines)


def plot(plt, data: dict):
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = data["attention"]
    labels = [f"B{r['sequences']} ctx{r['context']}\n{r['cache']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["kvmesh_gb_s"] for r in rows], 0.4, label="kvmesh paged kernel")
    ax.bar([i + 0.2 for i in x], [r["sdpa_gb_s"] for r in rows], 0.4, label="SDPA on gathered K/V")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("effective GB/s of K/V read")
    ax.set_title("Decode attention, SmolLM2-135M heads, fp32")
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    if not native.load():
        raise SystemExit("the kvmesh CPU kernels did not build on this machine")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    check_idle(args.threads)
    data = {"date": dt.datetime.now().isoformat(timespec="minutes"), "cpu": cpu_model(), "isa": native.isa(),
            "threads": args.threads, "repeats": args.repeats, "load_start": load_snapshot()}
    with tqdm(total=2 * len(ATTN_CASES) + 2, desc="cpu kernels") as bar:
        data["attention"] = bench_attention(args.repeats, bar)
        data["linear"] = bench_linear(args.repeats, bar)
    data["load_end"] = load_snapshot()
    md = render(data)
    print(md)
    kw = {"out_dir": args.out_dir} if args.out_dir else {}
    for path in write_results("cpu_kernels", data, md, plot, **kw):
        print("wrote", path)


if __name__ == "__main__":
    main()
