"""Result files of `kvmesh bench`: NAME.json (every number, the source of truth),
NAME.md (the summary table) and NAME.png (latency CDFs), the last two drawn from the JSON's
data only, so a result can be re-rendered without rerunning."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _f(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"  # NaN (no samples) -> "-"


def serve_markdown(data: dict) -> str:
    """The `bench serve` summary: counts, throughput, goodput, latency percentiles."""
    s = data["summary"]
    lines = [f"# kvmesh bench serve: {data.get('backend', '')} {data.get('target', '')}", "",
             f"model {data.get('model', '')}, dataset {data.get('dataset', '')}, request rate "
             f"{data.get('request_rate', '')}, burstiness {data.get('burstiness', '')}, max concurrency "
             f"{data.get('max_concurrency') or '-'}", "",
             "| | |", "|---|---:|",
             f"| successful requests | {s['completed']} / {s['num_requests']} |",
             f"| duration (s) | {_f(s['duration_s'])} |",
             f"| input tokens | {s['total_input_tokens']} |",
             f"| output tokens | {s['total_output_tokens']} |",
             f"| request throughput (req/s) | {_f(s['request_throughput'], 3)} |",
             f"| output throughput (tok/s) | {_f(s['output_throughput'])} |",
             f"| total token throughput (tok/s) | {_f(s['total_token_throughput'])} |"]
    if s["slos_ms"]:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slos_ms"].items())
        lines += [f"| goodput (req/s, {slo}) | {_f(s['goodput'], 3)} |",
                  f"| SLO attainment | {100 * s['slo_attainment']:.1f}% |"]
    lines += ["", "| metric (ms) | mean | p50 | p90 | p99 | max |", "|---|---:|---:|---:|---:|---:|"]
    for key, name in METRICS:
        d = s[key]
        lines.append(f"| {name} | " + " | ".join(_f(d[k]) for k in ("mean", "p50", "p90", "p99", "max")) + " |")
    if s["errors"]:
        lines += ["", "Errors: " + "; ".join(s["errors"])]
    return "\n".join(lines) + "\n"


def serve_plot(plt, data: dict):
    """CDFs of TTFT, TPOT, ITL and E2E from the JSON's per-request records."""
    reqs = [r for r in data.get("requests", []) if r["ok"]]
    series = {"TTFT": [r["ttft_s"] * 1e3 for r in reqs], "TPOT": [r["tpot_s"] * 1e3 for r in reqs
                                                                  if r["output_tokens"] > 1],
              "ITL": [x * 1e3 for r in reqs for x in r["itl_s"]], "E2E": [r["e2e_s"] * 1e3 for r in reqs]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, xs) in zip(axes, series.items()):
        xs = sorted(xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(f"kvmesh bench serve: {data.get('backend', '')}, {data['summary']['completed']} requests")
    fig.tight_layout()
    return fig


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def write_results(out_dir: str | Path, name: str, data: dict, markdown: str,
                  plot: Callable[[Any, dict], Any] | None = None) -> list[Path]:
    """Write out_dir/NAME.json, NAME.md and (when `plot` is given and matplotlib is
    installed) NAME.png; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(data, indent=2, default=str) + "\n")
    paths[1].write_text(markdown)
    plt = pyplot() if plot is not None else None
    if plt is not None:
        fig = plot(plt, data)
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        paths.append(out / f"{name}.png")
    return paths
