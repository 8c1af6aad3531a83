"""Helpers every benchmark shares: machine state, timing, engine driving, result files.

Scripts run as ``python benchmarks/NAME.py``, which puts this folder on ``sys.path``, so
they import this file as the sibling module ``_common``. It imports neither torch nor
kvmesh at module level: ``--help`` and the result rendering stay cheap.

Result files (``write_results``): ``NAME.json`` holds every raw number and is the
source of truth; ``NAME.md`` (a summary table) and ``NAME.png`` (a chart) are drawn
from that same data, so a results file can be re-rendered without rerunning.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The full Mooncake conversation trace (12,031 requests, 3 MB) lives outside the repository, in the
# shared folder next to it; benchmarks/data/ holds a 200-request sample of it.
FULL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_200.jsonl"
# 1-minute load average above which the machine counts as busy (before our own threads).
IDLE_LOAD = 0.5
# /proc/cpuinfo flags worth recording beside CPU timings: they pick the kernels.
CPU_FLAGS = {"avx2": "avx2", "avx512f": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_tile"}


# -- machine state ------------------------------------------------------------


def loadavg() -> list[float]:
    """The kernel's load averages [1, 5, 15 min]; NaNs where /proc/loadavg is missing."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return [float("nan")] * 3


def load_snapshot() -> dict:
    """The load averages as {"1min", "5min", "15min", "time"} (engine_throughput's format)."""
    one, five, fifteen = loadavg()
    return {"1min": one, "5min": five, "15min": fifteen, "time": time.time()}


def cpu_busy(interval_s: float = 1.0) -> float:
    """Cores busy over the next `interval_s` (from /proc/stat; NaN without it): unlike the
    load average, which trails a finished run by a minute, this says what runs now."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(interval_s)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    total = t1 - t0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / total) if total > 0 else 0.0


def wait_cores_quiet(max_wait_s: float = 60.0, busy_cores: float = 0.25) -> tuple[float, float]:
    """Between two systems of one run: wait until fewer than `busy_cores` cores are busy (the
    last one's processes have exited, its page cache writes are done) or `max_wait_s`;
    returns (seconds waited, cores busy at the end)."""
    t0 = time.monotonic()
    busy = cpu_busy()
    while not busy < busy_cores and time.monotonic() - t0 < max_wait_s:
        busy = cpu_busy()
    return time.monotonic() - t0, busy


def is_idle(load_1min: float, own_threads: int = 0) -> bool:
    """Whether nobody else is using the cores.

    A load taken while this run's `own_threads` are busy (at the end of a run, between
    phases) counts them as allowed load; NaN (no /proc) counts as busy.
    """
    return load_1min <= IDLE_LOAD + own_threads


def check_idle(threads: int, load_1min: float | None = None) -> bool:
    """Print the load beside the core and thread counts; warn loudly when the machine is busy."""
    load = loadavg()[0] if load_1min is None else load_1min
    cores = os.cpu_count()
    print(f"load average (1 min): {load:.2f}  | cores: {cores}  | torch threads: {threads}", flush=True)
    idle = is_idle(load)
    if not idle:
        bar = "!" * 78
        print(f"\n{bar}\n!! WARNING: 1-minute load average {load:.2f} > {IDLE_LOAD}: the machine is busy.\n"
              f"!! Timings will be slower and noisier than on idle cores; do not quote them.\n{bar}\n",
              file=sys.stderr, flush=True)
    if cores and threads > cores:
        print(f"WARNING: --threads {threads} exceeds the {cores} cores", file=sys.stderr)
    return idle


def wait_for_idle(max_wait_s: float, poll_s: float = 5.0) -> float:
    """Sleep until the 1-minute load is idle or `max_wait_s` passed; returns the seconds waited.

    Call it before starting any threads of the run: the load then is other people's.
    """
    waited = 0.0
    while not is_idle(loadavg()[0]) and waited < max_wait_s:
        time.sleep(poll_s)
        waited += poll_s
    return waited


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_flags() -> dict[str, bool]:
    """Which of CPU_FLAGS the first CPU reports (all False where /proc/cpuinfo is missing)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return {name: flag in flags for name, flag in CPU_FLAGS.items()}


def require_trace(path: str | Path) -> Path:
    """`path` if it is a file; else exit with what to pass instead (--trace)."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"trace not found: {path}\n  pass --trace PATH: the full Mooncake conversation trace "
                         f"(kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl), or the "
                         f"200-request sample {SAMPLE_TRACE} for a short run")
    return path


# -- timing -------------------------------------------------------------------


def median(samples: Iterable[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    return statistics.median(list(samples))


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `repeats` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# -- driving a kvmesh engine (duck-typed: step / has_unfinished) ---------------


def drain(engine) -> None:
    """Step until every request has finished."""
    while engine.has_unfinished():
        engine.step()


def first_output(engine, request_id: str):
    """Step until the first output of `request_id` (its first token) and return that output."""
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return out


def decode_tok_s(engine) -> float:
    """Decode tokens/s of the queued requests: one prefill step untimed, then the rest.

    The prompts must fit one step's token budget, so the steps timed are all decode.
    """
    engine.step()
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


# -- result files -------------------------------------------------------------


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """Markdown table lines; `align` has one letter per column, "l" (default) or "r"."""
    align = align.ljust(len(header), "l")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return None
    return plt


def write_results(name: str, data: dict, markdown: str, plot: Callable[[Any, dict], Any] | None = None,
                  out_dir: Path | str = RESULTS_DIR, dpi: int = 120) -> list[Path]:
    """Write out_dir/NAME.json (`data`), NAME.md (`markdown`) and NAME.png; returns the paths.

    `plot(plt, data)` draws the chart from the same data and returns its figure; the PNG
    is skipped when `plot` is None or matplotlib is missing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(data, indent=2, default=str) + "\n")
    paths[1].write_text(markdown)
    plt = pyplot() if plot is not None else None
    if plt is not None:
        fig = plot(plt, data)
        fig.savefig(out / f"{name}.png", dpi=dpi)
        plt.close(fig)
        paths.append(out / f"{name}.png")
    return paths
