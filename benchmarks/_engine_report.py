"""engine_throughput's results: target verdicts, the markdown summary and the bar chart.

All three read only the JSON-able result dict, so a results file written earlier can be
re-rendered: ``render_markdown(json.load(f))``.
"""

from __future__ import annotations

from _common import md_table

# Targets from the issue.
TARGET_VS_STATIC = 5.0
TARGET_VS_BATCH1 = 20.0
TARGET_STEP_VS_FLOOR = 1.5


def summarize(systems: dict, step: dict | None, bandwidth: dict | None, wbytes: int | None) -> dict:
    """Ratios and target verdicts."""
    ratios, targets = {}, []
    kv = systems.get("kvmesh")
    static = {k: v for k, v in systems.items() if k.startswith("hf_static")}
    if kv and static:
        best = max(static, key=lambda k: static[k]["tok_per_s"])
        ratios["hf_best_static"] = best
        ratios["kvmesh_vs_hf_best_static"] = kv["tok_per_s"] / static[best]["tok_per_s"]
        targets.append({"name": f"kvmesh vs best static batch ({systems[best]['label']})",
                        "target": f">= {TARGET_VS_STATIC:g}x",
                        "value": ratios["kvmesh_vs_hf_best_static"],
                        "met": ratios["kvmesh_vs_hf_best_static"] >= TARGET_VS_STATIC})
    if kv and "hf_batch1" in systems:
        ratios["kvmesh_vs_hf_batch1"] = kv["tok_per_s"] / systems["hf_batch1"]["tok_per_s"]
        targets.append({"name": "kvmesh vs one-at-a-time", "target": f">= {TARGET_VS_BATCH1:g}x",
                        "value": ratios["kvmesh_vs_hf_batch1"],
                        "met": ratios["kvmesh_vs_hf_batch1"] >= TARGET_VS_BATCH1})
    floor = None
    if step and bandwidth and wbytes:
        floor_ms = wbytes / (bandwidth["bandwidth_gbps"] * 1e9) * 1e3
        ratio = step["decode_step_ms_median"] / floor_ms
        floor = {"weight_bytes": wbytes, "bandwidth_gbps": bandwidth["bandwidth_gbps"],
                 "floor_ms": floor_ms, "step_ms": step["decode_step_ms_median"], "step_vs_floor": ratio}
        targets.append({"name": "batch-1 decode step vs bandwidth floor",
                        "target": f"<= {TARGET_STEP_VS_FLOOR:g}x", "value": ratio,
                        "met": ratio <= TARGET_STEP_VS_FLOOR})
    return {"ratios": ratios, "floor": floor, "targets": targets}


def _notes(res: dict) -> list[str]:
    """The lines under the systems table: baselines' caveats, the step vs the floor, sanity, load."""
    systems, lines, notes = res["systems"], [], []
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
        lines += [""] + md_table(["target", "goal", "measured", "verdict"],
                                 ([t["name"], t["target"], f"{t['value']:.2f}x", "met" if t["met"] else "MISSED"]
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
    cfg, systems = res["config"], res["systems"]
    kv_tps = systems.get("kvmesh", {}).get("tok_per_s")
    title = "Engine throughput" + (" (SMOKE run: numbers are not meaningful)" if res["smoke"] else "")
    lines = [
        f"# {title}",
        "",
        (f"{res['date']} · {res['model']} float32 · torch {res['torch_version']} · "
         f"transformers {res['transformers_version']} · {cfg['threads']} thread(s) · {res['cpu']}"),
        "",
        (f"Workload: {cfg['num_requests']} requests, prompts {cfg['prompt_len_range'][0]}-"
         f"{cfg['prompt_len_range'][1]} tokens ({res['workload']['total_prompt_tokens']} total), outputs "
         f"{cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} tokens "
         f"({res['workload']['total_output_tokens']} total), seed {cfg['seed']}, greedy, EOS ignored. "
         f"Prompt text: {res['workload']['source']}."),
        f"The big workload ran {cfg['repeats']} time(s) per system"
        + (" (median wall time)." if cfg["repeats"] > 1 else "."),
        "",
    ]
    rows = ([s["label"], s["useful_output_tokens"], f"{s['wall_s']:.2f}", f"{s['tok_per_s']:.1f}",
             "—" if key == "kvmesh" or kv_tps is None else f"{kv_tps / s['tok_per_s']:.2f}x"]
            for key, s in systems.items())
    lines += md_table(["system", "useful output tokens", "wall s", "tok/s", "kvmesh speedup vs it"], rows, "lrrrr")
    return "\n".join(lines + _notes(res)) + "\n"


def plot(plt, res: dict):
    systems = res["systems"]
    keys = list(systems)
    labels = [systems[k]["label"].replace(" (", "\n(").replace("transformers ", "transformers\n") for k in keys]
    tps = [systems[k]["tok_per_s"] for k in keys]
    colors = ["tab:orange" if k == "kvmesh" else "tab:gray" for k in keys]
    kv_tps = systems.get("kvmesh", {}).get("tok_per_s")

    fig, ax = plt.subplots(figsize=(9, 5.2))
    bars = ax.bar(range(len(keys)), tps, color=colors, edgecolor="black", linewidth=0.6)
    top = max(tps)
    for bar, k, v in zip(bars, keys, tps):
        text = f"{v:.1f} tok/s"
        if k != "kvmesh" and kv_tps:
            text += f"\nkvmesh = {kv_tps / v:.1f}x"
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + top * 0.015, text,
                ha="center", va="bottom", fontsize=9, fontweight="bold" if k == "kvmesh" else "normal")
    ax.set_xticks(range(len(keys)), labels, fontsize=9)
    ax.set_ylabel("useful output tokens / s")
    ax.set_ylim(0, top * 1.25)
    cfg = res["config"]
    title = (f"{res['model']} float32, {cfg['num_requests']} requests, {cfg['threads']} thread(s)"
             + ("  [SMOKE]" if res["smoke"] else ""))
    ax.set_title(title, fontsize=11)
    fl = res["summary"]["floor"]
    if fl:
        fig.text(0.5, 0.01, f"kvmesh batch-1 decode step {fl['step_ms']:.1f} ms vs bandwidth floor "
                 f"{fl['floor_ms']:.1f} ms ({fl['step_vs_floor']:.2f}x; {fl['bandwidth_gbps']:.1f} GB/s copy)",
                 ha="center", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig
