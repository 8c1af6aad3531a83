"""Simulation results as a markdown table and a chart (the shape of
benchmarks/_common.write_results: JSON is the source of truth, md and PNG are drawn
from it)."""

from __future__ import annotations

import json
from pathlib import Path


def _row(s: dict, base: dict | None, oracle: dict | None) -> list[str]:
    f = lambda x, d=2: "nan" if x != x else f"{x:.{d}f}"  # noqa: E731 (NaN-safe)
    rel_good = f(s["goodput_rps"] / base["goodput_rps"]) + "x" if base and base["goodput_rps"] else "-"
    rel_hit = f"{s['cache_hit_rate'] / oracle['cache_hit_rate']:.0%}" if oracle and oracle["cache_hit_rate"] else "-"
    busy = [w["busy_fraction"] for w in s["workers"]]
    return [s["policy"], f"{s['cache_hit_rate']:.3f}", rel_hit, f(s["ttft_s"]["p50"]), f(s["ttft_s"]["p90"]),
            f(s["tpot_s"]["p90"], 3), f(s["e2e_s"]["p90"]), f"{s['slo_attainment']:.1%}", f(s["goodput_rps"]),
            rel_good, f"{min(busy):.2f}-{max(busy):.2f}" if busy else "-", str(s["preemptions"])]


HEADER = ["policy", "hit rate", "vs oracle", "TTFT p50 s", "TTFT p90 s", "TPOT p90 s", "E2E p90 s", "SLO met",
          "goodput req/s", "vs round robin", "worker busy", "preempt"]


def markdown(summaries: list[dict], title: str, notes: list[str] = ()) -> str:
    """One row per policy; goodput relative to round_robin, hit rate relative to oracle_load."""
    by = {s["policy"]: s for s in summaries}
    base, oracle = by.get("round_robin"), by.get("oracle_load")
    lines = [f"# {title}", "", *[f"- {n}" for n in notes], "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_row(s, base, oracle)) + " |" for s in summaries]
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def sweep_markdown(sweep: dict) -> str:
    """Goodput (x round robin, SLO met) per policy per arrival-rate multiplier."""
    policies = list(dict.fromkeys(r["policy"] for r in sweep["rows"]))
    cell = {(r["multiplier"], r["policy"]): r for r in sweep["rows"]}
    rows = []
    for m in sweep["multipliers"]:
        row = [f"{m:g}x"]
        for p in policies:
            r = cell[(m, p)]
            rel = f"{r['vs_round_robin']:.2f}x, " if r["vs_round_robin"] is not None and p != "round_robin" else ""
            row.append(f"{r['goodput_rps']:.2f} ({rel}{r['slo_attainment']:.0%})")
        rows.append(row)
    peak = ["peak"] + [f"{sweep['peak'][p]['goodput_rps']:.2f} at {sweep['peak'][p]['multiplier']:g}x" for p in policies]
    return "\n".join(_table(["load", *policies], [*rows, peak])) + "\n"


def routers_markdown(rows: list[dict]) -> str:
    """Hit rate, TTFT, SLO met and goodput per router count and policy."""
    one = {r["policy"]: r for r in rows if r["routers"] == 1}
    out = []
    for r in rows:
        base = one.get(r["policy"])
        rel = f"{r['goodput_rps'] / base['goodput_rps']:.2f}x" if base and base["goodput_rps"] else "-"
        out.append([str(r["routers"]), r["policy"], f"{r['cache_hit_rate']:.3f}", f"{r['ttft_s']['p50']:.2f}",
                    f"{r['ttft_s']['p90']:.2f}", f"{r['slo_attainment']:.1%}", f"{r['goodput_rps']:.2f}", rel])
    return "\n".join(_table(["routers", "policy", "hit rate", "TTFT p50 s", "TTFT p90 s", "SLO met",
                              "goodput req/s", "vs 1 router"], out)) + "\n"


def autoscale_markdown(auto: dict, slo_target: float) -> str:
    """The autoscaled fleet beside fixed fleets: SLO met, worker-seconds, goodput."""
    rows = [[r["policy"], f"{r['slo_attainment']:.1%}", "yes" if r["slo_attainment"] >= slo_target else "no",
             f"{r['worker_seconds']:.0f}", f"{r['goodput_rps']:.2f}", f"{r['ttft_s']['p90']:.2f}"]
            for r in auto["rows"]]
    return "\n".join(_table(["fleet", "SLO met", f">= {slo_target:.0%}", "worker-seconds", "goodput req/s",
                              "TTFT p90 s"], rows)) + "\n"


def _bars(ax, runs: list[dict], key: str, title: str) -> None:
    ax.bar([r["policy"] for r in runs], [r[key] for r in runs])
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=30)


def _sweep(ax, sweep: dict) -> None:
    for p in dict.fromkeys(r["policy"] for r in sweep["rows"]):
        pts = [r for r in sweep["rows"] if r["policy"] == p]
        ax.plot([r["multiplier"] for r in pts], [r["goodput_rps"] for r in pts], marker="o", label=p)
    ax.set_xlabel("arrival rate (x the trace's)")
    ax.set_title("goodput at SLO vs load (req/s)")
    ax.legend(fontsize=8)


def _routers(ax, rows: list[dict]) -> None:
    for p, load in dict.fromkeys((r["policy"], r.get("load")) for r in rows):
        pts = [r for r in rows if r["policy"] == p and r.get("load") == load]
        label = p if load is None else f"{p} at {load:g}x load"
        ax.plot([r["routers"] for r in pts], [r["cache_hit_rate"] for r in pts], marker="o", label=label)
    ax.set_xlabel("router replicas")
    ax.set_xticks(sorted({r["routers"] for r in rows}))
    ax.set_title("prefix-cache hit rate vs router replicas")
    ax.legend(fontsize=8)


def _timeline(ax, timeline: list[dict]) -> None:
    t = [p["t"] for p in timeline]
    ax.plot(t, [p["replicas"] for p in timeline], label="replicas")
    ax2 = ax.twinx()
    ax2.plot(t, [p["arrival_rps"] for p in timeline], color="gray", alpha=0.5, label="arrivals/s")
    ax.set_xlabel("simulated s")
    ax.set_title("autoscaling: replicas vs load")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")


def plot(plt, data: dict):
    """Hit rate and goodput per policy, then whichever of goodput vs load, hit rate vs
    router replicas and replicas vs load (autoscaling) the data holds."""
    runs = data["runs"]
    panels = [lambda ax: _bars(ax, runs, "cache_hit_rate", "prefix-cache hit rate"),
              lambda ax: _bars(ax, runs, "goodput_rps", f"goodput at SLO (req/s); TTFT<={runs[0]['slo']['ttft_s']}s, "
                                                        f"TPOT<={runs[0]['slo']['tpot_s']}s")]
    if data.get("load_sweep"):
        panels.append(lambda ax: _sweep(ax, data["load_sweep"]))
    if data.get("routers"):
        panels.append(lambda ax: _routers(ax, data["routers"]["rows"]))
    if data.get("autoscale", {}).get("timeline"):
        panels.append(lambda ax: _timeline(ax, data["autoscale"]["timeline"]))
    cols = min(len(panels), 3)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, draw in zip(axes.flat, panels):
        draw(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def write(name: str, data: dict, md: str, out_dir: str | Path) -> list[Path]:
    """NAME.json, NAME.md and (when matplotlib is installed) NAME.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(data, indent=2, default=str) + "\n")
    paths[1].write_text(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig = plot(plt, data)
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)
    return [*paths, out / f"{name}.png"]
