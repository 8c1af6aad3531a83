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


def plot(plt, data: dict):
    """Hit rate and goodput per policy; replicas vs load when an autoscaling timeline is present."""
    runs = data["runs"]
    timeline = data.get("autoscale", {}).get("timeline")
    fig, axes = plt.subplots(1, 3 if timeline else 2, figsize=(15 if timeline else 10, 4))
    names = [r["policy"] for r in runs]
    axes[0].bar(names, [r["cache_hit_rate"] for r in runs])
    axes[0].set_title("prefix-cache hit rate")
    axes[1].bar(names, [r["goodput_rps"] for r in runs])
    axes[1].set_title(f"goodput at SLO (req/s); TTFT<={runs[0]['slo']['ttft_s']}s, TPOT<={runs[0]['slo']['tpot_s']}s")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=30)
    if timeline:
        ax = axes[2]
        t = [p["t"] for p in timeline]
        ax.plot(t, [p["replicas"] for p in timeline], label="replicas")
        ax2 = ax.twinx()
        ax2.plot(t, [p["arrival_rps"] for p in timeline], color="gray", alpha=0.5, label="arrivals/s")
        ax.set_xlabel("simulated s")
        ax.set_title("autoscaling: replicas vs load")
        ax.legend(loc="upper left")
        ax2.legend(loc="upper right")
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
