"""Per-request records of a benchmark run and what is computed from them: percentiles,
throughput, and goodput under an SLO.

Definitions (vLLM's `bench serve`): TTFT is send -> first streamed token; ITL is one gap
between consecutive streamed messages (a message may carry several tokens); TPOT is
(E2E - TTFT) / (output tokens - 1), the mean time per token after the first; E2E is send
-> last message. Goodput counts the requests that meet every SLO given (TTFT, TPOT, E2E),
per second of the run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
# --goodput keys -> the RequestRecord attribute each bounds (seconds); e2el is vLLM's spelling.
SLO_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s", "e2e": "e2e_s"}


@dataclass
class RequestRecord:
    """What one request did, as the client saw it (times in seconds from its send)."""

    ok: bool = False
    prompt_tokens: int = 0  # the server's count (usage) when it gives one, else the tokens sent
    output_tokens: int = 0  # the server's count (usage) when it gives one, else the tokens streamed
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # send time, seconds from the start of the run
    expected_output_tokens: int = 0
    text: str = ""  # the generated text
    token_ids: list[int] | None = None  # generated ids, where the protocol streams them (gRPC)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; 0 for a one-token answer."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default method); NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution(xs: Iterable[float], scale: float = 1.0, ps: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """{"mean", "std", "p50", "p90", "p99", "max"} of `xs` times `scale` (1e3: seconds -> ms)."""
    v = [x * scale for x in xs]
    nan = float("nan")
    out = {"mean": statistics.fmean(v) if v else nan, "std": statistics.pstdev(v) if v else nan}
    out.update({f"p{p:g}": percentile(v, p) for p in ps})
    out["max"] = max(v) if v else nan
    return out


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` (milliseconds, vLLM's --goodput) -> {"ttft": 0.5, "tpot": 0.05} seconds."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME one of {sorted(SLO_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos["e2el" if name == "e2e" else name] = ms / 1e3
    return slos


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a finished request is within every SLO (a failed one never is)."""
    return r.ok and all(getattr(r, SLO_METRICS[name]) <= limit for name, limit in slos.items())


def summarize(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """The report of a run: counts, token totals, throughput, goodput, and the latency
    distributions in milliseconds (over the successful requests)."""
    ok = [r for r in records if r.ok]
    slos = slos or {}
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    inp, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    good = sum(meets_slos(r, slos) for r in ok) if slos else len(ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out),
        "total_token_throughput": per_s(inp + out),
        "slos_ms": {k: v * 1e3 for k, v in slos.items()},
        "goodput": per_s(good),
        "slo_attainment": good / len(records) if records else 0.0,
        "ttft_ms": distribution((r.ttft_s for r in ok), 1e3),
        "tpot_ms": distribution((r.tpot_s for r in ok if r.output_tokens > 1), 1e3),
        "itl_ms": distribution((x for r in ok for x in r.itl_s), 1e3),
        "e2e_ms": distribution((r.e2e_s for r in ok), 1e3),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
    }
