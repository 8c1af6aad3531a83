"""The int8 KV cache against the fp32 one on the embedded SmolLM2-135M-Instruct: decode
throughput at long contexts, memory, and quality.

Two engines in one process, the same fp32 weights, the same KV memory budget
(``--kv-gb``): ``kv_cache_dtype=auto`` (float32 K / V) and ``kv_cache_dtype=int8``.

Throughput: ``--batch`` sequences (8), each with a context of C tokens (1k, 2k, 4k), decode
``--new`` tokens (32) together. Each sequence's prompt is distinct text (no shared prefix
blocks, so no cascade attention), prefilled once per engine and kept in its prefix cache;
a timed round re-submits the prompts (a prefix hit: only the last partial block is
computed, in a first step that is not timed) and times the decode steps after it. Rounds
alternate the two engines (fp32 first, then int8 first, ...) so drift in the machine's
state hits both alike; each number is the median of ``--repeats`` rounds (3). The
1-minute load average is printed beside every round and recorded in the JSON.

Quality (the int8 engine against the fp32 one):

* greedy agreement over a long generation: ``--gen`` (256) tokens from a chat prompt,
  the number of leading tokens both engines agree on and the position-wise agreement;
* teacher-forced logits along the fp32 engine's sequence (prompt + its generation), every
  position in one chunked pass per engine: max |logit diff|, relative to max |logit|, and
  how often the two argmax tokens agree;
* perplexity on the first 1,024 tokens of CPython's LICENSE.txt (kvmesh.quant.quality).

Run on idle cores (``--wait-idle S`` waits up to S seconds for the load to settle)::

    python benchmarks/kv_cache_dtype.py --wait-idle 180    # ~10 minutes on 2 cores
    python benchmarks/kv_cache_dtype.py --smoke            # tiny settings: kv_cache_dtype_smoke.*

Target: int8 decode >= 1.3x the fp32 cache's at 2k context. Results:
benchmarks/results/kv_cache_dtype.{json,md,png} (kv_cache_dtype_smoke.* for --smoke).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from _common import (
    IDLE_LOAD,
    RESULTS_DIR,
    check_idle,
    cpu_flags,
    cpu_model,
    is_idle,
    loadavg,
    md_table,
    median,
    wait_for_idle,
    write_results,
)

KINDS = ("auto", "int8")  # kv_cache_dtype of the two engines; "auto" is the fp32 cache here
LABEL = {"auto": "fp32 KV", "int8": "int8 KV"}
TARGET_CTX, TARGET = 2048, 1.3
CHAT_PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def _prompts(tokenizer, ctx: int, batch: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `ctx` tokens: windows of the LICENSE text at
    different offsets, each led by its own token (so no two share a first block)."""
    from kvmesh.quant.quality import license_text

    ids = tokenizer(license_text()[0], add_special_tokens=False)["input_ids"]
    out = []
    for i in range(batch):
        start = (i * 997) % max(1, len(ids) - ctx)
        window = (ids[start:] + ids)[: ctx - 1]
        out.append([1000 + i, *window])
    return out


def _engines(args):
    from kvmesh import LLM

    # room for the longest context, and for the quality checks (1,024-token perplexity, the chat
    # prompt and its generation)
    max_len = max(max(args.contexts) + args.new, 1100 + args.gen) + 16
    return {kind: LLM(progress=False, kv_cache_dtype=kind, kv_cache_memory_gb=args.kv_gb, block_size=16,
                      max_model_len=max_len, max_num_seqs=max(args.batch, 8),
                      max_num_batched_tokens=2048, num_threads=args.threads)
            for kind in KINDS}


def _submit(engine, prompts, max_tokens: int, tag: str) -> list[str]:
    from kvmesh import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]


def _decode_round(engine, prompts, new: int, tag: str) -> float:
    """Decode tok/s of the batch: steps until every request has its first token (the
    prefix-hit tail) untimed, then the remaining decode steps timed."""
    rids = set(_submit(engine, prompts, new + 1, tag))
    started: set[str] = set()
    while started != rids:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def throughput(llms: dict, args) -> list[dict]:
    rows = []
    for ctx in args.contexts:
        prompts = {kind: _prompts(llm.tokenizer, ctx, args.batch) for kind, llm in llms.items()}
        for kind, llm in llms.items():  # prefill once: later rounds hit the prefix cache
            t0 = time.perf_counter()
            _submit(llm.engine, prompts[kind], 1, f"prime{ctx}")
            _drain(llm.engine)
            print(f"ctx {ctx}: {LABEL[kind]} prefilled {args.batch} x {ctx} tokens in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        samples: dict[str, list[float]] = {k: [] for k in KINDS}
        loads = []
        for r in range(args.repeats):
            order = KINDS if r % 2 == 0 else KINDS[::-1]
            for kind in order:
                tok_s = _decode_round(llms[kind].engine, prompts[kind], args.new, f"c{ctx}r{r}")
                samples[kind].append(tok_s)
                load = loadavg()[0]
                loads.append(load)
                print(f"ctx {ctx} round {r}: {LABEL[kind]:8s} {tok_s:7.1f} tok/s   (load 1 min {load:.2f})",
                      flush=True)
        row = {"context": ctx, "batch": args.batch, "new_tokens": args.new, "samples": samples, "loads": loads,
               **{f"{k}_tok_s": median(v) for k, v in samples.items()}}
        row["speedup"] = row["int8_tok_s"] / row["auto_tok_s"]
        rows.append(row)
        print(f"ctx {ctx}: median fp32 KV {row['auto_tok_s']:.1f}, int8 KV {row['int8_tok_s']:.1f} tok/s: "
              f"{row['speedup']:.2f}x   (load 1 min {loadavg()[0]:.2f})", flush=True)
    return rows


def _all_logits(engine, token_ids: list[int], chunk: int = 512):
    """(n, V) logits at every position of `token_ids`, teacher-forced, in chunks (the
    quality helper's borrowed-blocks pass, kvmesh.quant.quality.perplexity)."""
    import math

    import torch

    from kvmesh.layers.attention import SeqSpan

    runner, pool = engine.executor.runner, engine.kv_manager.pool
    bs, n = runner.block_size, len(token_ids)
    blocks = pool.get_new_blocks(math.ceil(n / bs))
    ids_all = [b.block_id for b in blocks]
    out = []
    try:
        with torch.inference_mode():
            for start in range(0, n, chunk):
                ids = token_ids[start:start + chunk]
                span = SeqSpan(0, len(ids), start, ids_all[: math.ceil((start + len(ids)) / bs)])
                meta = runner.backend.build_metadata([span], 0)
                hidden = runner.model(torch.tensor(ids), torch.arange(start, start + len(ids)), runner.kv_caches,
                                      meta, runner.backend)
                out.append(runner.model.compute_logits(hidden).float())
    finally:
        pool.free_blocks(blocks)
    return torch.cat(out)


def quality(llms: dict, args) -> dict:
    from kvmesh import SamplingParams
    from kvmesh.quant.quality import eval_tokens, perplexity

    ref_llm, q_llm = llms["auto"], llms["int8"]
    prompt = ref_llm.engine.encode_chat([{"role": "user", "content": CHAT_PROMPT}])
    params = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)
    gens = {k: llm.generate([prompt], params)[0].outputs[0].token_ids for k, llm in llms.items()}
    a, b = gens["auto"], gens["int8"]
    lead = next((i for i in range(len(a)) if a[i] != b[i]), len(a))
    seq = prompt + list(a)
    la, lb = _all_logits(ref_llm.engine, seq), _all_logits(q_llm.engine, seq)
    gen_rows = slice(len(prompt) - 1, len(seq) - 1)  # the positions that predicted the generation
    diff = (la - lb).abs()
    ids, source = eval_tokens(ref_llm.tokenizer, 128 if args.smoke else 1024)
    ppl = {k: perplexity(llm.engine, ids) for k, llm in llms.items()}
    return {
        "gen_tokens": len(a), "leading_agreement": lead,
        "positionwise_agreement": sum(x == y for x, y in zip(a, b)) / max(len(a), 1),
        "max_logit_error": diff.max().item(), "max_logit": la.abs().max().item(),
        "max_logit_error_rel": (diff.max() / la.abs().max()).item(),
        "mean_logit_error": diff.mean().item(),
        "teacher_forced_top1_agreement": (la[gen_rows].argmax(-1) == lb[gen_rows].argmax(-1)).float().mean().item(),
        "perplexity": ppl, "ppl_text": source,
        "text": {k: llms[k].tokenizer.decode(v) for k, v in gens.items()},
    }


def _markdown(res: dict) -> str:
    meta, rows, q = res["meta"], res["throughput"], res["quality"]
    lines = [f"# kvmesh KV cache dtype: int8 vs fp32 KV, {meta['model']}", "",
             (f"{meta['date']}, {meta['cpu']}, torch threads {meta['threads']}, KV budget {meta['kv_gb']} GiB, "
              f"load avg start/end {meta['load_start']:.2f}/{meta['load_end']:.2f}"
              f"{' (BUSY: do not quote)' if not meta['idle'] else ''}{' — SMOKE settings' if meta['smoke'] else ''}"),
             "", f"KV blocks of 16 tokens in the budget: fp32 {meta['blocks']['auto']}, int8 {meta['blocks']['int8']} "
             f"({meta['blocks']['int8'] / meta['blocks']['auto']:.2f}x the tokens).", "",
             f"Decode throughput, {rows[0]['batch']} sequences x {rows[0]['new_tokens']} new tokens, medians of "
             f"{meta['repeats']} alternating rounds:", ""]
    lines += md_table(["context", "fp32 KV tok/s", "int8 KV tok/s", "int8 / fp32", "max 1-min load"],
                      ([r["context"], f"{r['auto_tok_s']:.1f}", f"{r['int8_tok_s']:.1f}", f"{r['speedup']:.2f}x",
                        f"{max(r['loads']):.2f}"] for r in rows), "rrrrr")
    at = next((r for r in rows if r["context"] == TARGET_CTX), None)
    if at is not None:
        verdict = "met" if at["speedup"] >= TARGET else "MISSED"
        lines += ["", f"Target: int8 decode >= {TARGET}x fp32 at {TARGET_CTX} context: {at['speedup']:.2f}x, {verdict}."]
    lines += ["", "Quality of the int8 cache against the fp32 one:", "",
              f"- greedy generation of {q['gen_tokens']} tokens: the first {q['leading_agreement']} agree, "
              f"{100 * q['positionwise_agreement']:.0f}% of positions agree",
              f"- teacher-forced along the fp32 sequence: max |logit diff| {q['max_logit_error']:.3f} "
              f"({100 * q['max_logit_error_rel']:.2f}% of max |logit| {q['max_logit']:.1f}), mean "
              f"{q['mean_logit_error']:.4f}; argmax agrees at {100 * q['teacher_forced_top1_agreement']:.1f}% of "
              "the generated positions",
              f"- perplexity ({q['ppl_text']}): fp32 KV {q['perplexity']['auto']:.3f}, int8 KV "
              f"{q['perplexity']['int8']:.3f} ({100 * (q['perplexity']['int8'] / q['perplexity']['auto'] - 1):+.2f}%)",
              "", "Greedy text (first 200 characters):", ""]
    lines += [f"- **{LABEL[k]}**: {t[:200]!r}" for k, t in q["text"].items()]
    return "\n".join(lines) + "\n"


def _plot(plt, res: dict):
    rows = res["throughput"]
    ctx = [r["context"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for kind, color in (("auto", "#888"), ("int8", "#3a7")):
        ax1.plot(ctx, [r[f"{kind}_tok_s"] for r in rows], "o-", color=color, label=LABEL[kind])
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(ctx, [str(c) for c in ctx])
    ax1.set_xlabel("context tokens per sequence")
    ax1.set_ylabel("decode tok/s")
    ax1.set_title(f"decode, batch {rows[0]['batch']}")
    ax1.legend()
    ax2.bar([str(c) for c in ctx], [r["speedup"] for r in rows], color="#3a7")
    ax2.axhline(TARGET, color="#c73", ls="--", label=f"target {TARGET}x at {TARGET_CTX}")
    ax2.axhline(1.0, color="#888", lw=0.8)
    ax2.set_title("int8 KV / fp32 KV")
    ax2.set_xlabel("context tokens per sequence")
    ax2.legend()
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny settings; writes kv_cache_dtype_smoke.*")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="1024,2048,4096", help="comma list of context lengths")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--new", type=int, default=32, help="decode tokens timed per round")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds per context (median reported)")
    p.add_argument("--gen", type=int, default=256, help="tokens of the greedy quality generation")
    p.add_argument("--kv-gb", type=float, default=2.0, help="KV memory budget of each engine, GiB")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default=None, help="result file names (default kv_cache_dtype; --smoke: kv_cache_dtype_smoke)")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help=f"wait up to S seconds for the 1-minute load average to fall below {IDLE_LOAD}")
    args = p.parse_args(argv)
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        args.contexts, args.batch, args.new, args.repeats, args.gen, args.kv_gb = [128, 256], 2, 4, 1, 24, 0.25
    wait_for_idle(args.wait_idle)
    start = loadavg()[0]
    check_idle(args.threads, start)
    llms = _engines(args)
    rows = throughput(llms, args)
    q = quality(llms, args)
    end = loadavg()[0]
    meta = {"model": "SmolLM2-135M-Instruct (embedded), float32 weights",
            "date": dt.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(), "cpu_flags": cpu_flags(),
            "threads": args.threads, "kv_gb": args.kv_gb, "repeats": args.repeats, "load_start": start,
            "load_end": end, "idle": is_idle(start) and is_idle(end, own_threads=args.threads),
            "smoke": args.smoke, "blocks": {k: llm.engine.num_usable_blocks + 1 for k, llm in llms.items()}}
    res = {"meta": meta, "throughput": rows, "quality": q}
    md = _markdown(res)
    write_results(args.name or ("kv_cache_dtype_smoke" if args.smoke else "kv_cache_dtype"), res, md, _plot, args.out_dir,
                  dpi=110)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
