"""engine_throughput's results: target verdicts, the markdown summary and the bar chart.

All three read only the JSON-able result dict, so a results file written earlier can be
re-rendered: ``render_markdown(json.load(f))``. Peers that were skipped (no venv) or failed
appear as a line with the reason, and their targets as "not measured".
"""

from __future__ import annotations

from _common import md_table

# Targets from the issues (16: vLLM and llama.cpp; the earlier ones: transformers and the floor).
TARGET_VS_VLLM = 1.2
TARGET_VS_LLAMACPP = 1.0
TARGET_VS_STATIC = 5.0
TARGET_VS_BATCH1 = 20.0
TARGET_STEP_VS_FLOOR = 1.5
TARGET_BF16_VS_FP32 = 1.0  # on CPUs with native bf16 (issue 16)
# (kvmesh system, llama.cpp system, precision) pairs of the batch-1 decode table.
B1_PAIRS = (("kvmesh_f32", "llamacpp_f32", "f32"), ("kvmesh_gguf", "llamacpp_q4_1", "Q4_1"))


def _target(name: str, goal: str, value: float | None, met: bool | None, note: str = "") -> dict:
    return {"name": name, "target": goal, "value": value, "met": met, "note": note}


def _not_measured(peers: dict, *keys: str) -> str:
    """Why a peer's numbers are missing: the first skipped / failed record among `keys`."""
    for k in keys:
        rec = peers.get(k)
        if rec and rec.get("status") != "ok":
            return f"{k} {rec['status']}: {rec.get('reason', '').splitlines()[0] if rec.get('reason') else '?'}"
    return "not run"


def summarize(systems: dict, step: dict | None, bandwidth: dict | None, wbytes: int | None,
              b1: dict | None = None, peers: dict | None = None, rounds: dict | None = None) -> dict:
    """Ratios and target verdicts (met None = not measured, with a note saying why). Against
    vLLM, the median of the alternating rounds' ratios when there were rounds."""
    ratios, targets, peers = {}, [], peers or {}
    kv = systems.get("kvmesh")
    if kv and "vllm_cpu" in systems:
        r = kv["tok_per_s"] / systems["vllm_cpu"]["tok_per_s"]
        if rounds and rounds.get("ratio_median") is not None:
            r = rounds["ratio_median"]
            ratios["kvmesh_vs_vllm_cpu_spread"] = [rounds["ratio_min"], rounds["ratio_max"]]
        ratios["kvmesh_vs_vllm_cpu"] = r
        targets.append(_target("offline throughput vs vLLM CPU (fp32)", f">= {TARGET_VS_VLLM:g}x", r,
                               r >= TARGET_VS_VLLM))
    elif kv and peers:
        targets.append(_target("offline throughput vs vLLM CPU (fp32)", f">= {TARGET_VS_VLLM:g}x", None, None,
                               _not_measured(peers, "vllm")))
    b1s = (b1 or {}).get("systems", {})
    for ours, theirs, prec in B1_PAIRS:
        name = f"batch-1 decode vs llama.cpp ({prec})"
        if ours in b1s and theirs in b1s:
            ratios[f"{ours}_vs_{theirs}"] = r = b1s[ours]["decode_tok_per_s"] / b1s[theirs]["decode_tok_per_s"]
            targets.append(_target(name, f">= {TARGET_VS_LLAMACPP:g}x", r, r >= TARGET_VS_LLAMACPP))
        elif b1 is not None:
            why = _not_measured(peers, "llamacpp", "kvmesh_gguf" if prec == "Q4_1" else "f32_gguf")
            targets.append(_target(name, f">= {TARGET_VS_LLAMACPP:g}x", None, None, why))
    if kv and "kvmesh_bf16" in systems:
        ratios["kvmesh_bf16_vs_fp32"] = r = systems["kvmesh_bf16"]["tok_per_s"] / kv["tok_per_s"]
        targets.append(_target("offline throughput bf16 vs fp32 (kvmesh)", f">= {TARGET_BF16_VS_FP32:g}x", r,
                               r >= TARGET_BF16_VS_FP32))
    if "kvmesh_bf16" in b1s and "kvmesh_f32" in b1s:
        ratios["kvmesh_bf16_vs_f32_b1"] = r = b1s["kvmesh_bf16"]["decode_tok_per_s"] / b1s["kvmesh_f32"][
            "decode_tok_per_s"]
        targets.append(_target("batch-1 decode bf16 vs fp32 (kvmesh)", f">= {TARGET_BF16_VS_FP32:g}x", r,
                               r >= TARGET_BF16_VS_FP32))
    static = {k: v for k, v in systems.items() if k.startswith("hf_static")}
    if kv and static:
        best = max(static, key=lambda k: static[k]["tok_per_s"])
        ratios["hf_best_static"] = best
        ratios["kvmesh_vs_hf_best_static"] = r = kv["tok_per_s"] / static[best]["tok_per_s"]
        targets.append(_target(f"kvmesh vs best static batch ({systems[best]['label']})",
                               f">= {TARGET_VS_STATIC:g}x", r, r >= TARGET_VS_STATIC))
    if kv and "hf_batch1" in systems:
        ratios["kvmesh_vs_hf_batch1"] = r = kv["tok_per_s"] / systems["hf_batch1"]["tok_per_s"]
        targets.append(_target("kvmesh vs one-at-a-time", f">= {TARGET_VS_BATCH1:g}x", r, r >= TARGET_VS_BATCH1))
    floor = None
    if step and bandwidth and wbytes:
        floor_ms = wbytes / (bandwidth["bandwidth_gbps"] * 1e9) * 1e3
        r = step["decode_step_ms_median"] / floor_ms
        floor = {"weight_bytes": wbytes, "bandwidth_gbps": bandwidth["bandwidth_gbps"],
                 "floor_ms": floor_ms, "step_ms": step["decode_step_ms_median"], "step_vs_floor": r}
        targets.append(_target("batch-1 decode step vs bandwidth floor", f"<= {TARGET_STEP_VS_FLOOR:g}x", r,
                               r <= TARGET_STEP_VS_FLOOR))
    return {"ratios": ratios, "floor": floor, "targets": targets}


def _verdict(t: dict) -> str:
    return "not measured" + (f" ({t['note']})" if t.get("note") else "") if t["met"] is None else (
        "MET" if t["met"] else "MISSED")


def _offline_table(res: dict) -> list[str]:
    systems = res["systems"]
    kv_tps = systems.get("kvmesh", {}).get("tok_per_s")
    rows = ([s["label"], f"{s['tok_per_s']:.1f}",
             "—" if key.startswith("kvmesh") or kv_tps is None else f"{kv_tps / s['tok_per_s']:.2f}x",
             f"{s['wall_s']:.2f}", len(s.get("wall_s_all", [s["wall_s"]]))]
            for key, s in systems.items())
    return md_table(["system", "output tok/s", "kvmesh / it", "wall s (median)", "timed passes"], rows, "lrrrr")


def _b1_lines(res: dict) -> list[str]:
    b1 = res.get("b1_decode")
    if not b1 or not b1.get("systems"):
        return []
    s = b1["systems"]
    rows = []
    for ours, theirs, prec in B1_PAIRS:
        for key in (ours, theirs):
            if key in s:
                ratio = "—" if key == ours or ours not in s else \
                    f"{s[ours]['decode_tok_per_s'] / s[key]['decode_tok_per_s']:.2f}x"
                rows.append([s[key]["label"], s[key].get("precision", prec), f"{s[key]['decode_tok_per_s']:.1f}", ratio,
                             f"{s[key]['first_token_s_median'] * 1e3:.1f}"])
    if "kvmesh_bf16" in s:
        rows.append([s["kvmesh_bf16"]["label"], "BF16", f"{s['kvmesh_bf16']['decode_tok_per_s']:.1f}", "—",
                     f"{s['kvmesh_bf16']['first_token_s_median'] * 1e3:.1f}"])
    lines = ["", (f"Batch-1 greedy decode ({b1['prompt_tokens']}-token prompt, {b1['max_tokens']} output tokens, "
                  f"{b1['threads']} thread(s), median of {b1['repeats']} runs after 1 warm-up; prefill excluded):"),
             ""]
    lines += md_table(["system", "precision", "decode tok/s", "kvmesh / it", "first token ms"], rows, "llrrr") + [""]
    for prec, a in b1.get("agreement", {}).items():
        text = f"- Greedy agreement {prec}: first {a['common_prefix']} of {a['tokens']} tokens equal"
        if "first_tokens_equal" in a:
            text += (f"; first {a['first_tokens_required']} required: "
                     f"**{'match' if a['first_tokens_equal'] else 'MISMATCH'}**")
        elif prec == "q4_1":
            text += " (llama.cpp's Q4_1 kernels quantize activations to Q8: exact equality is not expected)"
        lines.append(text)
    return lines


def _notes(res: dict) -> list[str]:
    """The lines under the tables: peers, baselines' caveats, the step vs the floor, targets, sanity."""
    systems, lines, notes = res["systems"], [], []
    for name, rec in res.get("peers", {}).items():
        if rec.get("status") != "ok":
            reason = (rec.get("reason") or "").splitlines()
            notes.append(f"{name}: {rec['status']}: {reason[0] if reason else ''}")
        if rec.get("note"):
            notes.append(f"{name}: {rec['note']}")
    vm = res.get("peers", {}).get("vllm", {}).get("output_match")
    if vm:
        bad = ", ".join(f"#{m['request']} at token {m['first_mismatch']}" for m in vm["mismatches"][:8])
        notes.append(f"Greedy outputs kvmesh vs vLLM: **{vm['requests_equal']}/{vm['requests_compared']} requests "
                     f"equal**" + ("" if vm["count_matches"] else " (request counts differ)")
                     + (f"; differ: {bad}" if bad else ""))
    agree = systems.get("kvmesh_bf16", {}).get("agreement_with_fp32")
    if agree:
        notes.append(f"Greedy outputs kvmesh bf16 vs fp32: {agree['requests_equal']}/{agree['requests']} requests "
                     f"equal; median common prefix {agree['common_prefix_median']:.0f} of "
                     f"{agree['output_tokens_median']:.0f} tokens (bf16 rounding: divergence after a while is "
                     "expected; per-step logits within bf16 tolerance are tested in tests/worker/test_correctness.py)")
    if "hf_batch1" in systems:
        b1 = systems["hf_batch1"]
        notes.append(f"transformers batch 1 ran on the first {b1['subset_requests']} requests only; its tok/s "
                     f"is computed on that subset (full workload would take "
                     f"~{b1['estimated_full_workload_wall_s']:.0f} s).")
    if any(k.startswith("hf_static") for k in systems):
        notes.append("Static batches: arrival order, left padding, each batch runs to its longest request; "
                     "only the tokens each request asked for count.")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines += _b1_lines(res)
    fl = res["summary"]["floor"]
    if fl:
        st = res["decode_step"]
        lines += [
            "",
            (f"Batch-1 decode step (kvmesh, {st['prompt_tokens']}-token prompt, {st['max_tokens']} output tokens, "
             f"median of {st['num_decode_steps']} decode steps): **{fl['step_ms']:.2f} ms** "
             f"(mean {st['decode_step_ms_mean']:.2f}, min {st['decode_step_ms_min']:.2f}, "
             f"p90 {st['decode_step_ms_p90']:.2f})"),
            (f"Bandwidth floor: {fl['weight_bytes'] / 1e6:.1f} MB of weights / {fl['bandwidth_gbps']:.2f} GB/s copy "
             f"bandwidth = **{fl['floor_ms']:.2f} ms**; step / floor = **{fl['step_vs_floor']:.2f}x**"),
        ]
    if res["summary"]["targets"]:
        lines += ["", "Targets:", ""] + md_table(
            ["target", "goal", "measured", "verdict"],
            ([t["name"], t["target"], "—" if t["value"] is None else f"{t['value']:.2f}x", _verdict(t)]
             for t in res["summary"]["targets"]), "lrrl")
    san = res.get("sanity")
    if san:
        verdict = "match" if san["all_match"] else "MISMATCH"
        detail = ", ".join(f"#{p['request']}: {'ok' if p['match'] else 'differs at token ' + str(p['first_mismatch'])}"
                           for p in san["per_request"])
        lines += ["", (f"Sanity: kvmesh greedy vs transformers batch 1 on the first {san['requests_compared']} "
                       f"requests: **{verdict}** ({detail}).")]
    la = res["load_average"]
    lines += ["", f"Load average (1 min) at start {la['start']['1min']:.2f}, at end {la['end']['1min']:.2f}"
                  + ("" if res["idle_at_start"] else " — WARNING: the machine was busy at start")]
    return lines


def render_markdown(res: dict) -> str:
    cfg = res["config"]
    title = "Engine throughput" + (" (SMOKE run: numbers are not meaningful)" if res["smoke"] else "")
    la = res["load_average"]["start"]
    passes = (f"{cfg.get('warmup_passes', 0)} untimed warm-up pass(es), then {cfg['repeats']} timed pass(es) "
              f"(median wall time) for kvmesh and vLLM, alternating (a kvmesh pass, then a vLLM pass); transformers {cfg.get('hf_repeats', cfg['repeats'])} pass(es).")
    lines = [
        f"# {title}",
        "",
        (f"{res['date']} · {res['model']} float32 · torch {res['torch_version']} · "
         f"transformers {res['transformers_version']} · {cfg['threads']} thread(s) · {res['cpu']}"),
        "",
        (f"**Load average at start: {la['1min']:.2f} / {la['5min']:.2f} / {la['15min']:.2f}** (1 / 5 / 15 min)"
         + ("" if res["idle_at_start"] else " — BUSY: do not quote these numbers")),
        "",
        (f"Workload{' (' + cfg['preset'] + ')' if cfg.get('preset') else ''}: {cfg['num_requests']} requests, "
         f"prompts {cfg['prompt_len_range'][0]}-{cfg['prompt_len_range'][1]} tokens "
         f"({res['workload']['total_prompt_tokens']} total), outputs "
         f"{cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} tokens "
         f"({res['workload']['total_output_tokens']} total), seed {cfg['seed']}, greedy, EOS ignored, all submitted "
         f"at once. Prompt text: {res['workload']['source']}."),
        passes,
        "",
    ]
    lines += _offline_table(res)
    lines += _rounds_lines(res.get("rounds"))
    return "\n".join(lines + _notes(res)) + "\n"


def _rounds_lines(rounds: dict | None) -> list[str]:
    """The alternating kvmesh / vLLM rounds, one row each, and the median ratio with its spread."""
    if not rounds or not rounds.get("played"):
        return []
    lines = ["", "Alternating rounds (one kvmesh pass, then one vLLM pass, both engines loaded and warm):", "",
             "| round | kvmesh wall s | vLLM wall s | kvmesh / vLLM |", "|---|---|---|---|"]
    lines += [f"| {r['round'] + 1} | {r['kvmesh_wall_s']:.2f} | {r['vllm_wall_s']:.2f} | {r['ratio']:.3f}x |"
              for r in rounds["played"]]
    lines += ["", f"**Median {rounds['ratio_median']:.3f}x** (spread {rounds['ratio_min']:.3f}-"
              f"{rounds['ratio_max']:.3f}x over {len(rounds['played'])} rounds)."]
    return lines


def _bars(ax, labels: list[str], values: list[float], highlight: list[bool], ratios: list[str], ylabel: str,
          title: str) -> None:
    colors = ["tab:orange" if h else "tab:gray" for h in highlight]
    bars = ax.bar(range(len(values)), values, color=colors, edgecolor="black", linewidth=0.6)
    top = max(values)
    for bar, v, h, r in zip(bars, values, highlight, ratios):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + top * 0.015, f"{v:.1f}" + (f"\n{r}" if r else ""),
                ha="center", va="bottom", fontsize=8, fontweight="bold" if h else "normal")
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * 1.3)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def plot(plt, res: dict):
    systems, cfg = res["systems"], res["config"]
    b1s = (res.get("b1_decode") or {}).get("systems", {})
    fig, axes = plt.subplots(1, 2 if b1s else 1, figsize=(14 if b1s else 9, 5.2),
                             gridspec_kw={"width_ratios": [3, 2]} if b1s else None, squeeze=False)
    keys = list(systems)
    kv_tps = systems.get("kvmesh", {}).get("tok_per_s")
    _bars(axes[0][0],
          [systems[k]["label"].replace(" (", "\n(").replace("transformers ", "transformers\n") for k in keys],
          [systems[k]["tok_per_s"] for k in keys], [k.startswith("kvmesh") for k in keys],
          ["" if k == "kvmesh" or not kv_tps else f"{systems[k]['tok_per_s'] / kv_tps:.2f}x fp32"
           if k.startswith("kvmesh") else f"kvmesh = {kv_tps / systems[k]['tok_per_s']:.2f}x" for k in keys],
          "useful output tokens / s",
          f"offline: {cfg['num_requests']} requests, {cfg['threads']} thread(s)" + ("  [SMOKE]" if res["smoke"] else ""))
    if b1s:
        order = [k for pair in B1_PAIRS for k in pair[:2] if k in b1s] + [k for k in ("kvmesh_bf16",) if k in b1s]
        ratio = {}
        if "kvmesh_bf16" in b1s and "kvmesh_f32" in b1s:
            ratio["kvmesh_bf16"] = f"{b1s['kvmesh_bf16']['decode_tok_per_s'] / b1s['kvmesh_f32']['decode_tok_per_s']:.2f}x f32"
        for ours, theirs, _ in B1_PAIRS:
            if ours in b1s and theirs in b1s:
                ratio[theirs] = f"kvmesh = {b1s[ours]['decode_tok_per_s'] / b1s[theirs]['decode_tok_per_s']:.2f}x"
        _bars(axes[0][1], [b1s[k]["label"].replace(" ", "\n", 1) for k in order],
              [b1s[k]["decode_tok_per_s"] for k in order], [b1s[k].get("system") == "kvmesh" for k in order],
              [ratio.get(k, "") for k in order], "decode tokens / s", "batch-1 greedy decode")
    fl = res["summary"]["floor"]
    la = res["load_average"]["start"]["1min"]
    foot = f"{res['model']} · load at start {la:.2f}"
    if fl:
        foot += (f" · kvmesh decode step {fl['step_ms']:.1f} ms vs bandwidth floor {fl['floor_ms']:.1f} ms "
                 f"({fl['step_vs_floor']:.2f}x; {fl['bandwidth_gbps']:.1f} GB/s copy)")
    fig.text(0.5, 0.01, foot, ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig
