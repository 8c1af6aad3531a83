"""SLO autoscaling for real: `kvmesh serve` on Ray Serve under a low -> high -> low load ramp.

* **Serving**: `kvmesh serve --config` (a local Ray instance) of one `unified` worker
  deployment (the single-worker shape of `kvmesh serve`: every replica prefills and
  decodes) autoscaling between 1 and 2 replicas on kvmesh's own signals
  (`KvmeshAutoscalingPolicy`: queue depth, KV usage, batch slot usage, TTFT / TPOT p90
  and the oldest request's wait for its first token against `slo`, and the engine's
  busy fraction against `--busy-high`: a one-thread CPU replica runs out of compute
  before its batch slots fill), with
  Ray's timing knobs shortened so the ramp plays out in minutes (`--upscale-delay-s`,
  `--downscale-delay-s`, `--look-back-s`, `--metrics-interval-s`, `--slo-window-s`).
* **Why the queue decides**: each replica runs `--max-num-seqs` requests at a time on
  `--threads` torch threads; beyond that, requests wait in the engine's queue and TTFT
  grows with the queue. TPOT's target is left loose (`--tpot-slo`): on 2 shared cores a
  second replica relieves the queue (and the TTFT it causes), not the per-token time.
* **Load**: open-loop Poisson arrivals through the OpenAI HTTP API
  (benchmarks/_loadgen.py) whose rate is `--low-rate` for `--phase-s`, rises linearly to
  `--high-rate` over `--ramp-s`, holds it for `--phase-s`, falls back over `--ramp-s` and
  holds `--low-rate` for `--phase-s` (`--ramp-s 0`: a step, low -> high -> low); distinct
  random prompts (no prefix-cache hits).
* **Observed**: Ray Serve's replica states of the deployment (`serve.status()`) and the
  router's registered workers every `--sample-s`; per `--window-s` window of arrivals the
  offered rate, TTFT p90 against `--ttft-slo`, and failures.

    python benchmarks/autoscale_ramp.py                  # embedded SmolLM2-135M, ~5 minutes
    python benchmarks/autoscale_ramp.py --smoke --out-dir /tmp/ramp   # tiny random model, short phases

Results: benchmarks/results/autoscale_ramp.{json,md,png} (autoscale_ramp_smoke.* with --smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import ray
import yaml
from ray import serve
from tqdm import tqdm

from kvmesh.checkpoint.files import resolve_model_path
from kvmesh.models.loader import load_arch_config
from kvmesh.rpc import free_port

from _common import check_idle, loadavg, md_table, write_results
from _loadgen import Request, run_load

ROOT = Path(__file__).resolve().parents[1]
ROLE = "unified"
_READY = re.compile(r"KVMESH_SERVE_READY grpc=(\S+) http=(\S+)")


def tiny_model() -> Path:
    """The tests' tiny random Llama (tests/tiny_models.py)."""
    spec = importlib.util.spec_from_file_location("kvmesh_tiny_models", ROOT / "tests" / "tiny_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_model(Path(tempfile.mkdtemp(prefix="kvmesh-ramp-tiny-")), max_position_embeddings=1024)


def serving_config(args, model: str | None) -> dict:
    return {
        "name": "kvmesh-ramp",
        "engine": {"model": {"model": model, "max_model_len": args.prompt_tokens + args.max_tokens + 16},
                   "scheduler": {"max_num_seqs": args.max_num_seqs}, "num_threads": args.threads},
        "router": {"resources": {"num_cpus": 0.1}, "config": {"stats_interval_s": 0.25}},
        "decode": {"resources": {"num_cpus": 0.5},
                   "autoscaling": {"min_replicas": 1, "max_replicas": args.max_replicas,
                                   "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
                                   "look_back_period_s": args.look_back_s, "metrics_interval_s": args.metrics_interval_s,
                                   "busy_high": args.busy_high if args.busy_high > 0 else None}},
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo, "window_s": args.slo_window_s},
        "registry_ttl_s": 5,
    }


def start_serve(cfg_path: Path, log: Path, timeout_s: float = 600.0) -> tuple[subprocess.Popen, str, str]:
    """`kvmesh serve --config` as its own process group; (process, grpc, http) once READY."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "serve", "--config", str(cfg_path), "--port",
                                 str(free_port()), "--http-port", str(free_port())],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        m = _READY.search(log.read_text())
        if m:
            return proc, m.group(1), m.group(2)
        time.sleep(0.5)
    stop_serve(proc)
    raise SystemExit(f"kvmesh serve did not become ready; log:\n{log.read_text()[-4000:]}")


def stop_serve(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # kvmesh serve deletes the app and stops its Ray instance
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def watch(app: str, period_s: float) -> int:
    """`--watch APP`: print the deployment's Ray Serve replica states as JSON lines until killed.

    A process of its own: a Ray driver dies with the cluster it joined, so the benchmark
    itself never joins the Ray instance that `kvmesh serve` stops at the end."""
    ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    while True:
        try:
            dep = serve.status().applications[app].deployments[ROLE]
            states = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()}
            print(json.dumps({"time": time.time(), **states}), flush=True)
        except Exception as exc:  # a missed sample is a gap in the plot, not a failed run
            print(json.dumps({"time": time.time(), "error": repr(exc)}), flush=True)
        time.sleep(period_s)


class ReplicaSampler(threading.Thread):
    """Replica states from a `--watch` process, beside the router's registered workers."""

    def __init__(self, app: str, http: str, period_s: float):
        super().__init__(daemon=True, name="replica-sampler")
        self.http = http
        self.t0 = time.time()
        self.samples: list[dict] = []
        self._proc = subprocess.Popen([sys.executable, __file__, "--watch", app, "--sample-s", str(period_s)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def run(self) -> None:
        for line in self._proc.stdout:
            try:
                states = json.loads(line)
                with urllib.request.urlopen(f"{self.http}/kvmesh/workers", timeout=5) as r:
                    workers = json.loads(r.read())["workers"]
            except (ValueError, OSError) as exc:
                print(f"replica sample failed: {exc!r}", file=sys.stderr)
                continue
            if "error" in states:
                continue
            self.samples.append({
                "t_s": round(states["time"] - self.t0, 2), "running": states.get("RUNNING", 0),
                "starting": states.get("STARTING", 0), "stopping": states.get("STOPPING", 0),
                "router_workers": sum(w["role"] == ROLE and w["healthy"] for w in workers),
                "in_flight": sum(w["in_flight"] for w in workers)})

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(30)
        self.join(10)


def load_phases(args) -> list[tuple[float, float, float, float]]:
    """(start, end, rate at start, rate at end) of each phase: low, a linear rise over
    `--ramp-s`, high, a linear fall, low. `--ramp-s 0` is a step (no rise or fall phase)."""
    shape = [(args.phase_s, args.low_rate, args.low_rate), (args.ramp_s, args.low_rate, args.high_rate),
             (args.phase_s, args.high_rate, args.high_rate), (args.ramp_s, args.high_rate, args.low_rate),
             (args.phase_s, args.low_rate, args.low_rate)]
    phases, t = [], 0.0
    for length, r0, r1 in shape:
        if length > 0:
            phases.append((t, t + length, r0, r1))
            t += length
    return phases


def rate_at(phases, t: float) -> float:
    for start, end, r0, r1 in phases:
        if start <= t < end:
            return r0 + (r1 - r0) * (t - start) / (end - start)
    return 0.0


def ramp(args, vocab: int) -> tuple[list[Request], list[float], list[tuple[float, float, float, float]]]:
    """Poisson arrivals whose rate follows `load_phases` (thinning: candidates at the peak
    rate, each kept with probability rate(t) / peak); (requests, arrival seconds, phases)."""
    rng = random.Random(args.seed)
    phases = load_phases(args)
    peak = max(max(r0, r1) for _, _, r0, r1 in phases)
    arrivals: list[float] = []
    a = rng.expovariate(peak)
    while a < phases[-1][1]:
        if rng.random() * peak < rate_at(phases, a):
            arrivals.append(a)
        a += rng.expovariate(peak)
    arrivals = [0.0] + arrivals[1:] if arrivals else arrivals  # the load generator sends the first at once
    reqs = [Request([rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)], args.max_tokens)
            for _ in arrivals]
    return reqs, arrivals, phases


def p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(0.9 * len(s)) - 1))]


def windows(arrivals: list[float], results, end_s: float, window_s: float) -> list[dict]:
    """Per window of arrival time: offered req/s, TTFT p90 and p50 of its requests, failures."""
    out = []
    for k in range(int(math.ceil(end_s / window_s))):
        lo, hi = k * window_s, (k + 1) * window_s
        rs = [r for a, r in zip(arrivals, results) if lo <= a < hi]
        ttft = [r.ttft_s for r in rs if r.ok]
        out.append({"t_s": lo, "offered_req_s": len(rs) / window_s, "requests": len(rs),
                    "failed": sum(not r.ok for r in rs), "ttft_p90_s": p90(ttft),
                    "ttft_p50_s": sorted(ttft)[len(ttft) // 2] if ttft else None})
    return out


def scale_events(samples: list[dict]) -> list[dict]:
    """Changes of the Ray Serve RUNNING replica count."""
    events, last = [], None
    for s in samples:
        if s["running"] != last:
            events.append({"t_s": s["t_s"], "running": s["running"]})
            last = s["running"]
    return events


def markdown(r: dict) -> str:
    c, s = r["config"], r["summary"]
    lines = [f"# SLO autoscaling under Ray Serve: a load ramp ({r['date']})", "",
             f"`kvmesh serve` with one `{ROLE}` deployment, 1..{c['max_replicas']} replicas on kvmesh's policy; "
             f"model {c['model']}, {c['threads']} torch thread(s) and max_num_seqs {c['max_num_seqs']} per replica, "
             f"prompts {c['prompt_tokens']} tokens, {c['max_tokens']} output tokens. SLO: TTFT p90 <= "
             f"{c['ttft_slo']} s (TPOT {c['tpot_slo']} s, loose); busy_high {c['busy_high']}. Ray knobs: upscale delay {c['upscale_delay_s']} s, "
             f"downscale delay {c['downscale_delay_s']} s, look-back {c['look_back_s']} s, metrics every "
             f"{c['metrics_interval_s']} s; latency window {c['slo_window_s']} s.", "",
             f"Load average at start {r['loadavg_start'][0]:.2f} (1 min), at end {r['loadavg_end'][0]:.2f}; "
             f"{os.cpu_count()} cores.", "", "## Phases", ""]
    rows = [(f"{p['start_s']:.0f}-{p['end_s']:.0f}", _rates(p), p["requests"], p["failed"],
             _s(p["ttft_p50_s"]), _s(p["ttft_p90_s"]), f"{p['replicas_min']}-{p['replicas_max']}") for p in r["phases"]]
    lines += md_table(["seconds", "offered req/s", "requests", "failed", "TTFT p50", "TTFT p90", "replicas"],
                      rows, "lrrrrrr")
    lines += ["", "## Replica changes (Ray Serve RUNNING)", ""]
    lines += md_table(["t (s)", "running"], [(e["t_s"], e["running"]) for e in s["scale_events"]], "rr")
    lines += ["", "## Verdict", "",
              f"- replicas: 1 -> {s['max_running']} -> {s['final_running']} "
              f"({'met' if s['went_up_and_down'] else 'NOT met'}); first at 2 at {_s(s['first_up_s'])}, "
              f"back to 1 at {_s(s['back_down_s'])}",
              f"- failed requests: {s['failed']} of {s['requests']}",
              f"- TTFT p90 <= SLO in {s['windows_within_slo']} of {s['windows']} {c['window_s']:.0f}-s windows; "
              f"worst window {_s(s['worst_window_ttft_p90_s'])}; whole run p90 {_s(s['ttft_p90_s'])}", ""]
    return "\n".join(lines) + "\n"


def _rates(p: dict) -> str:
    return f"{p['rate']:.2f}" if p["rate"] == p["rate_end"] else f"{p['rate']:.2f} -> {p['rate_end']:.2f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s" if isinstance(x, float) else str(x)


def plot(plt, r: dict):
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    ws = r["windows"]
    ax1.step([w["t_s"] for w in ws], [w["offered_req_s"] for w in ws], where="post", color="tab:gray",
             label="offered load (req/s)")
    ax1.set_ylabel("offered req/s")
    ax1b = ax1.twinx()
    sm = r["samples"]
    ax1b.step([x["t_s"] for x in sm], [x["running"] for x in sm], where="post", color="tab:blue", lw=2,
              label="replicas RUNNING (Ray Serve)")
    ax1b.step([x["t_s"] for x in sm], [x["running"] + x["starting"] for x in sm], where="post", color="tab:blue",
              ls=":", label="+ STARTING")
    ax1b.set_ylabel("replicas")
    ax1b.set_ylim(0, r["config"]["max_replicas"] + 0.5)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax1b.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax1.set_title("kvmesh SLO autoscaling under Ray Serve: replicas follow the load")
    xs = [w["t_s"] + r["config"]["window_s"] / 2 for w in ws if w["ttft_p90_s"] is not None]
    ax2.plot(xs, [w["ttft_p90_s"] for w in ws if w["ttft_p90_s"] is not None], "o-", color="tab:red",
             label="TTFT p90 (by arrival window)")
    ax2.axhline(r["config"]["ttft_slo"], color="black", ls="--", label="TTFT SLO")
    ax2.set_ylabel("seconds")
    ax2.set_xlabel("seconds since the ramp started")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def summarize(args, results, arrivals, phases, samples) -> tuple[list[dict], list[dict], dict]:
    end_s = phases[-1][1]
    ws = windows(arrivals, results, end_s, args.window_s)
    per_phase = []
    for start, end, rate, rate_end in phases:
        rs = [r for a, r in zip(arrivals, results) if start <= a < end]
        ttft = [r.ttft_s for r in rs if r.ok]
        running = [x["running"] for x in samples if start <= x["t_s"] < end] or [0]
        per_phase.append({"start_s": start, "end_s": end, "rate": rate, "rate_end": rate_end, "requests": len(rs),
                          "failed": sum(not r.ok for r in rs), "ttft_p90_s": p90(ttft),
                          "ttft_p50_s": sorted(ttft)[len(ttft) // 2] if ttft else None,
                          "replicas_min": min(running), "replicas_max": max(running)})
    running = [x["running"] for x in samples]
    first_up = next((x["t_s"] for x in samples if x["running"] >= 2), None)
    back = next((x["t_s"] for x in samples if first_up is not None and x["t_s"] > first_up and x["running"] == 1),
                None)
    measured = [w for w in ws if w["ttft_p90_s"] is not None]
    ok_ttft = [r.ttft_s for r in results if r.ok]
    summary = {"requests": len(results), "failed": sum(not r.ok for r in results),
               "errors": sorted({r.error for r in results if not r.ok})[:3],
               "max_running": max(running, default=0), "final_running": running[-1] if running else 0,
               "went_up_and_down": first_up is not None and back is not None, "first_up_s": first_up,
               "back_down_s": back, "scale_events": scale_events(samples), "windows": len(measured),
               "windows_within_slo": sum(w["ttft_p90_s"] <= args.ttft_slo for w in measured),
               "worst_window_ttft_p90_s": max((w["ttft_p90_s"] for w in measured), default=None),
               "ttft_p90_s": p90(ok_ttft)}
    return ws, per_phase, summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded SmolLM2; --smoke: tiny random)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, 20-s phases: checks the pipeline only")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker replica")
    p.add_argument("--max-num-seqs", type=int, default=4, help="requests one replica runs at a time")
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--low-rate", type=float, default=0.4, help="req/s of the first and last phase")
    p.add_argument("--high-rate", type=float, default=3.0, help="req/s of the middle phase (above one replica's capacity)")
    p.add_argument("--phase-s", type=float, default=45.0, help="seconds of each low and high phase")
    p.add_argument("--ramp-s", type=float, default=45.0,
                   help="seconds of the linear rise (low -> high) and fall (high -> low); 0: a step")
    p.add_argument("--tail-s", type=float, default=60.0, help="after the ramp, watch at most this long for 1 replica")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT p90 target, seconds")
    p.add_argument("--tpot-slo", type=float, default=1.0, help="TPOT p90 target, seconds (loose: the queue decides)")
    p.add_argument("--slo-window-s", type=float, default=6.0, help="seconds of finished requests a worker's p90 covers")
    p.add_argument("--busy-high", type=float, default=0.8,
                   help="add a replica above this busy fraction (autoscaling.busy_high; <= 0: busy is no signal)")
    p.add_argument("--upscale-delay-s", type=float, default=2.0)
    p.add_argument("--downscale-delay-s", type=float, default=15.0)
    p.add_argument("--look-back-s", type=float, default=4.0, help="Ray's look_back_period_s")
    p.add_argument("--metrics-interval-s", type=float, default=1.0, help="Ray's metrics_interval_s")
    p.add_argument("--window-s", type=float, default=10.0, help="report window of arrivals, seconds")
    p.add_argument("--sample-s", type=float, default=1.0, help="replica sampling period, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--watch", metavar="APP", default=None, help=argparse.SUPPRESS)  # the sampler process
    args = p.parse_args(argv)
    if args.smoke:
        args.phase_s, args.ramp_s, args.tail_s, args.low_rate, args.high_rate = 20.0, 10.0, 40.0, 1.0, 8.0
        args.max_num_seqs, args.max_tokens, args.prompt_tokens, args.window_s = 1, 128, 32, 5.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.watch:
        return watch(args.watch, args.sample_s)
    load_start = loadavg()
    idle = check_idle(args.threads * args.max_replicas, load_start[0])
    model = args.model or (str(tiny_model()) if args.smoke else None)
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-ramp-"))
    cfg_path = tmp / "serving.yaml"
    cfg = serving_config(args, model)
    cfg_path.write_text(yaml.safe_dump(cfg))
    print(f"starting kvmesh serve (log {tmp / 'serve.log'})...", flush=True)
    proc, _, http = start_serve(cfg_path, tmp / "serve.log")
    sampler = None
    try:
        vocab = load_arch_config(resolve_model_path(model, progress=False)).vocab_size
        reqs, arrivals, phases = ramp(args, vocab)
        base = f"{http}/v1"
        sampler = ReplicaSampler(cfg["name"], http, args.sample_s)
        sampler.start()
        asyncio.run(run_load(base, "kvmesh", reqs[:2], rate=math.inf))  # warm-up, not counted
        deadline = time.monotonic() + 60
        while not sampler.samples and time.monotonic() < deadline:  # the watcher has joined Ray
            time.sleep(0.5)
        sampler.t0 = time.time()
        print(f"ramp: {len(reqs)} requests, {args.low_rate} -> {args.high_rate} -> {args.low_rate} req/s: "
              f"{args.phase_s:.0f} s phases, {args.ramp_s:.0f} s rise and fall", flush=True)
        with tqdm(total=len(reqs), desc="ramp requests") as bar:
            results, wall = asyncio.run(run_load(base, "kvmesh", reqs, rate=0.0, arrivals_s=arrivals, progress=bar))
        deadline = time.monotonic() + args.tail_s
        while time.monotonic() < deadline and not (sampler.samples and sampler.samples[-1]["running"] == 1
                                                   and sampler.samples[-1]["stopping"] == 0):
            time.sleep(args.sample_s)
    finally:
        if sampler is not None:
            sampler.stop()
        stop_serve(proc)
    samples = [x for x in sampler.samples if x["t_s"] >= 0]  # from the ramp's start
    ws, per_phase, summary = summarize(args, results, arrivals, phases, samples)
    report = {"date": dt.datetime.now().isoformat(timespec="seconds"), "loadavg_start": load_start,
              "loadavg_end": loadavg(), "idle_at_start": idle, "cores": os.cpu_count(), "wall_s": wall,
              "config": {**vars(args), "model": model or "embedded SmolLM2-135M"}, "serving_config": cfg,
              "summary": summary, "phases": per_phase, "windows": ws, "samples": samples}
    md = markdown(report)
    for path in write_results("autoscale_ramp_smoke" if args.smoke else "autoscale_ramp", report, md, plot,
                              args.out_dir):
        print(f"wrote {path}")
    print(md)
    print(f"load average now: {loadavg()[0]:.2f}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
