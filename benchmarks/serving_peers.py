"""Served performance against the peer: `kvmesh serve` (Ray), `kvmesh serve --local`,
`vllm serve` (vLLM's CPU build) and the offline kvmesh engine, on the same requests.

Every server is driven by `kvmesh bench serve`'s library (kvmesh.bench: open-loop OpenAI
streaming, the same token-id prompts for every server, token counts from the servers'
usage records) on three workloads built by kvmesh.bench.datasets:

- random:  prompts 128-384 tokens, outputs 64-192, Poisson arrivals at --rate;
- prefix:  4 shared --prefix-tokens (512) prefixes + 64-token suffixes, 64 outputs, Poisson --rate;
- burst:   --burst-requests random requests sent at once.

Servers never share the cores: each is started, warmed up, run on every workload and
stopped before the next starts. That sequence repeats for --rounds (3) rounds, the order
of the servers rotated each round, so slow drifts of the machine (other tenants, thermal)
fall on every server alike. Reported per server and workload: the median over rounds of
output tok/s, TTFT / TPOT / ITL / E2E p50 and p99, goodput and SLO attainment; per kvmesh
server, its ratio to vLLM per metric as the median of the per-round ratios with their
min-max spread. Every request is greedy (temperature 0, EOS ignored), so the generated
texts of kvmesh and vLLM on the same prompts must agree: the report counts the equal ones
per workload, as engine_throughput.py does offline.

The Poisson rate is a load, not a constant: machines of this pool differ 4x in speed, so a
fixed rate that keeps one near saturation overloads another, and TTFT then measures the
backlog. `--rate auto` (the default) runs the offline engine first and gives each Poisson
workload `--load` (0.6) times the request rate the offline engine sustains on that
workload's requests on this machine; `--rate R` fixes it.

An A/B of a kvmesh setting rides the same alternating run: `kvmesh-local-b` is
`kvmesh-local` plus the flags in --kvmesh-args-b (say `--servers
kvmesh-local,kvmesh-local-b,vllm --kvmesh-args-b "--max-num-batched-tokens 2048"`), so
both variants and vLLM see the same machine drift.

JSON + markdown + PNG into benchmarks/results/serving_peers.*; the load average is stored
beside every run. vLLM is skipped (with a note) when its venv is missing; install it with
scripts/install_vllm_cpu.sh /tmp/vllm-cpu.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvmesh.bench import ServeConfig, parse_goodput, prefix_samples, random_samples, run_serve

from _common import RESULTS_DIR, check_idle, load_snapshot, md_table, wait_cores_quiet, wait_for_idle, write_results

SERVERS = ("kvmesh-ray", "kvmesh-local", "kvmesh-local-b", "vllm")
KVMESH_SERVERS = SERVERS[:3]
WORKLOADS = ("random", "prefix", "burst")
VLLM_INSTALL = "scripts/install_vllm_cpu.sh /tmp/vllm-cpu"
# (summary path, label, higher is better): the metrics reported per server and as ratios to vLLM.
METRICS = (("output_throughput", "out tok/s", True), ("ttft_ms.p50", "TTFT p50 ms", False),
           ("ttft_ms.p99", "TTFT p99 ms", False), ("tpot_ms.p50", "TPOT p50 ms", False),
           ("tpot_ms.p99", "TPOT p99 ms", False), ("itl_ms.p50", "ITL p50 ms", False),
           ("e2e_ms.p50", "E2E p50 ms", False), ("goodput", "goodput req/s", True))


def metric(summary: dict, path: str) -> float:
    out = summary
    for part in path.split("."):
        out = out[part]
    return float(out)


# -- workloads --------------------------------------------------------------------------


def make_workload(name: str, args, tokenizer, seed: int = 0) -> tuple[list, float | None]:
    """(samples, arrival rate) of one workload; rate None = set from the offline engine."""
    rate = None if args.rate == "auto" else float(args.rate)
    if name == "random":
        return random_samples(tokenizer, args.num_requests, 256, 128, range_ratio=0.5, seed=seed), rate
    if name == "prefix":
        return prefix_samples(tokenizer, args.num_requests, 4, args.prefix_tokens, 64, 64, seed=seed + 1), rate
    if name == "burst":
        return random_samples(tokenizer, args.burst_requests, 256, 128, range_ratio=0.5, seed=seed + 2), float("inf")
    raise ValueError(name)


# -- servers ----------------------------------------------------------------------------


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200 and json.loads(r.read()).get("data"):
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


def server_cmd(name: str, model_dir: Path, port: int, grpc_port: int, args) -> tuple[list[str], dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    kvmesh = [sys.executable, "-m", "kvmesh.cli", "serve", "--model", str(model_dir), "--http-port", str(port),
              "--port", str(grpc_port), *shlex.split(args.kvmesh_args)]
    if name == "kvmesh-ray":
        return kvmesh, env
    if name in ("kvmesh-local", "kvmesh-local-b"):  # -b: the B side of an A/B, plus --kvmesh-args-b
        b = shlex.split(args.kvmesh_args_b) if name == "kvmesh-local-b" else []
        return kvmesh[:4] + ["--local", "--prefill-replicas", "0"] + kvmesh[4:] + b, env
    if name == "vllm":
        env.update(VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
        return [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", str(model_dir), "--served-model-name", "kvmesh",
                "--dtype", "float32", "--port", str(port), "--max-model-len", "2048"], env
    raise ValueError(name)


def start_server(name: str, model_dir: Path, port: int, grpc_port: int, log: Path, args) -> subprocess.Popen:
    cmd, env = server_cmd(name, model_dir, port, grpc_port, args)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}", proc, args.start_timeout)
    except (RuntimeError, TimeoutError):
        stop_server(proc)
        raise
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server and everything it started (its process group: vLLM's engine core, kvmesh's
    workers), then wait for the cores to go quiet, so the next server's round does not share
    them with this one's exit (the load average cannot tell: it trails by a minute)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if "ray" in " ".join(proc.args):  # a Ray instance can outlive an interrupted driver
        subprocess.run(["ray", "stop", "--force"], capture_output=True)
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    waited, busy = wait_cores_quiet()
    print(f"   stopped; cores quiet after {waited:.1f} s ({busy:.2f} busy)", flush=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- runs -------------------------------------------------------------------------------


def run_served(name: str, model_dir: Path, workloads: dict, args, rnd: int) -> tuple[dict, dict]:
    """One round of one server on every workload: (summaries by workload, generated texts by workload)."""
    port, grpc_port = 8400, 50400
    log = Path(args.log_dir) / f"{name}-round{rnd}.log"
    print(f"== round {rnd + 1}, {name}: starting (log {log})", flush=True)
    t0 = time.perf_counter()
    proc = start_server(name, model_dir, port, grpc_port, log, args)
    out, texts = {"round": rnd, "start_s": time.perf_counter() - t0}, {}
    try:
        url, slos = f"http://127.0.0.1:{port}", parse_goodput(args.goodput)
        warm = next(iter(workloads.values()))[0][:4]
        run_serve(ServeConfig(target=url, model="kvmesh", progress=False), warm)
        for wl, (samples, rate) in workloads.items():
            load = load_snapshot()
            cfg = ServeConfig(target=url, model="kvmesh", request_rate=rate, seed=1, slos=slos,
                              label=f"r{rnd + 1} {name}/{wl}")
            res = run_serve(cfg, samples)
            s = {**res.summary, "load_before": load, "load_after": load_snapshot(),
                 "ttft_all_ms": sorted(r.ttft_s * 1e3 for r in res.records if r.ok)}
            out[wl], texts[wl] = s, [r.text if r.ok else None for r in res.records]
            print(f"   {wl}: {s['output_throughput']:.1f} out tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                  f"TPOT p50 {s['tpot_ms']['p50']:.0f} ms, failed {s['failed']}, load {load['1min']:.2f}", flush=True)
    finally:
        stop_server(proc)
    return out, texts


def run_offline(model_dir: Path, workloads: dict) -> dict:
    """The offline engine on each workload's requests, all at once: the served ceiling."""
    from kvmesh import LLM, SamplingParams

    llm = LLM(str(model_dir), progress=False)
    llm.generate([list(range(200, 264))] * 4, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    out = {}
    for wl, (samples, _) in workloads.items():
        load = load_snapshot()
        params = [SamplingParams(max_tokens=s.output_len, temperature=0, ignore_eos=True) for s in samples]
        t0 = time.perf_counter()
        outs = llm.generate([s.prompt_ids for s in samples], params)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[wl] = {"output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
                   "req_s": len(samples) / wall, "load_before": load}
        print(f"== offline/{wl}: {tokens / wall:.1f} out tok/s, {len(samples) / wall:.2f} req/s "
              f"(load {load['1min']:.2f})", flush=True)
    return out


def calibrate_rates(workloads: dict, offline: dict, load: float) -> dict[str, float]:
    """`--rate auto`: each Poisson workload arrives at `load` x the request rate the offline
    engine sustained on its requests (all at once, so at saturation) on this machine."""
    rates = {}
    for wl, (reqs, rate) in list(workloads.items()):
        if rate is None:
            rates[wl] = round(load * offline[wl]["req_s"], 3)
            workloads[wl] = (reqs, rates[wl])
            print(f"== {wl}: Poisson rate {rates[wl]:.3f} req/s = {load:g} x the offline engine's "
                  f"{offline[wl]['req_s']:.3f} req/s", flush=True)
    return rates


def round_order(servers: list[str], rnd: int) -> list[str]:
    """The servers of round `rnd`, rotated by one each round (who runs first alternates)."""
    k = rnd % len(servers) if servers else 0
    return servers[k:] + servers[:k]


# -- comparison -------------------------------------------------------------------------


def ratio_spread(ours: dict[int, dict], theirs: dict[int, dict], path: str) -> dict | None:
    """Per-round ratios ours / theirs of one metric (summaries by round, paired by round):
    median, min, max."""
    ratios = [metric(ours[k], path) / metric(theirs[k], path) for k in sorted(ours.keys() & theirs.keys())
              if metric(theirs[k], path) > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def compare_texts(ours: dict[int, list], theirs: dict[int, list]) -> dict:
    """Equal greedy outputs, request by request in every round both ran (None: a failed
    request); each mismatch with the character where it starts and the texts from there."""
    pairs = [(k, i, a, b) for k in sorted(ours.keys() & theirs.keys())
             for i, (a, b) in enumerate(zip(ours[k], theirs[k])) if a is not None and b is not None]
    mismatches = []
    for k, i, a, b in pairs:
        if a != b:
            n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"round": k, "request": i, "first_mismatch_char": n, "chars": [len(a), len(b)],
                               "ours": a[n:n + 24], "theirs": b[n:n + 24]})
    return {"compared": len(pairs), "equal": len(pairs) - len(mismatches), "mismatches": mismatches}


def compare(data: dict, texts: dict) -> dict:
    """data["vs_vllm"][server][workload]: ratio spreads per metric and the output match."""
    res, out = data["results"], {}
    vl = res.get("vllm", {}).get("rounds") or []
    for name in KVMESH_SERVERS:
        km = res.get(name, {}).get("rounds") or []
        if not km or not vl:
            continue
        out[name] = {}
        for wl in data["workloads"]:
            a, b = ({r["round"]: r[wl] for r in rounds if wl in r} for rounds in (km, vl))
            out[name][wl] = {"ratios": {p: ratio_spread(a, b, p) for p, _, _ in METRICS},
                             "outputs": compare_texts(texts.get(name, {}).get(wl, {}),
                                                      texts.get("vllm", {}).get(wl, {}))}
    return out


# -- report -----------------------------------------------------------------------------


def median_summary(rounds: list[dict], wl: str) -> dict | None:
    """The median over rounds of every reported metric of one workload."""
    runs = [r[wl] for r in rounds if wl in r]
    if not runs:
        return None
    return {p: statistics.median(metric(s, p) for s in runs) for p, _, _ in METRICS} | {
        "failed": sum(s["failed"] for s in runs), "rounds": len(runs),
        "load": statistics.median(s["load_before"]["1min"] for s in runs)}


def _fmt(x: float) -> str:
    return "-" if x != x else (f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}")


def render(data: dict) -> str:
    lines = [f"# Served performance vs vLLM ({data['date']})", "",
             f"CPU: {data['cpu']}; model {data['model']}, float32; {data['args'].get('rounds', 1)} rounds, server "
             f"order rotated each round; goodput SLOs {data.get('slos_ms') or '-'} (ms); load (1 min) at start "
             f"{data['load_start']['1min']:.2f}.", ""]
    rates = data.get("rates") or {}
    if rates:
        lines += ["Poisson arrival rates, " + (f"{data['args']['load']:g} x the offline engine's request rate on this "
                  "machine (--rate auto): " if data["args"].get("rate") == "auto" else "fixed (--rate): ")
                  + ", ".join(f"{wl} {r:.3f} req/s" for wl, r in rates.items()) + ".", ""]
    for wl in data["workloads"]:
        lines += [f"## {wl}", "", "Medians over rounds:", ""]
        rows = []
        for name in SERVERS:
            m = median_summary(data["results"].get(name, {}).get("rounds") or [], wl)
            if m:
                rows.append([name, *(_fmt(m[p]) for p, _, _ in METRICS), m["failed"], m["rounds"], f"{m['load']:.2f}"])
        off = data["results"].get("offline", {}).get(wl)
        if off:
            rows.append(["offline engine", _fmt(off["output_tok_s"]), *["-"] * (len(METRICS) - 1), "-", 1,
                         f"{off['load_before']['1min']:.2f}"])
        lines += md_table(["server", *(label for _, label, _ in METRICS), "failed", "rounds", "load"], rows,
                          "l" + "r" * (len(METRICS) + 3))
        for name, per_wl in (data.get("vs_vllm") or {}).items():
            c = per_wl.get(wl)
            if not c:
                continue
            cells = [f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-"
                     for r in (c["ratios"][p] for p, _, _ in METRICS)]
            o = c["outputs"]
            lines += ["", f"{name} / vllm, median of per-round ratios (min-max); greedy outputs equal: "
                          f"{o['equal']}/{o['compared']}", ""]
            lines += md_table([label for _, label, _ in METRICS], [cells], "r" * len(METRICS))
        lines.append("")
    return "\n".join(lines)


def plot(plt, data: dict):
    wls = data["workloads"]
    fig, axes = plt.subplots(2, len(wls), figsize=(5 * len(wls), 8), squeeze=False)
    for j, wl in enumerate(wls):
        ax = axes[0][j]
        for name in SERVERS:
            xs = sorted(x for r in data["results"].get(name, {}).get("rounds") or [] for x in r.get(wl, {}).get(
                "ttft_all_ms", []))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        ax.set_title(f"{wl}: TTFT CDF (all rounds)")
        ax.set_xlabel("ms")
        ax.legend()
        ax = axes[1][j]
        names, mids, errs = [], [], [[], []]
        for name in SERVERS:
            runs = [r[wl]["output_throughput"] for r in data["results"].get(name, {}).get("rounds") or [] if wl in r]
            if runs:
                med = statistics.median(runs)
                names.append(name), mids.append(med), errs[0].append(med - min(runs)), errs[1].append(max(runs) - med)
        ax.bar(names, mids, yerr=errs, capsize=4)
        ax.set_title(f"{wl}: output tok/s (median, min-max)")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    return fig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded model's folder)")
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ",".join(SERVERS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3, help="rounds of every server, order rotated (default 3)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--burst-requests", type=int, default=64)
    p.add_argument("--rate", default="auto",
                   help="Poisson arrival rate (random, prefix) in requests/s, or 'auto': --load x the offline "
                        "engine's request rate on each workload on this machine (the default)")
    p.add_argument("--load", type=float, default=0.6, help="with --rate auto: offered load as a fraction of the "
                                                           "offline engine's saturated request rate (0.6)")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="NAME:MS",
                   help="SLOs for goodput, as `kvmesh bench serve --goodput` (default ttft:2000 tpot:200)")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--kvmesh-args", default="", help="extra `kvmesh serve` flags for every kvmesh server")
    p.add_argument("--kvmesh-args-b", default="",
                   help="flags added for the kvmesh-local-b server only: an A/B of two settings in one alternating run "
                        "(--servers kvmesh-local,kvmesh-local-b,vllm)")
    p.add_argument("--vllm-venv", default="/tmp/vllm-cpu", help=f"vLLM CPU venv (install: {VLLM_INSTALL})")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--wait-idle", type=float, default=0, help="wait up to this many seconds for an idle machine")
    p.add_argument("--log-dir", default="/tmp/kvmesh-serving-peers")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--name", default="serving_peers")
    args = p.parse_args(argv)
    if args.rate != "auto":
        try:
            float(args.rate)
        except ValueError:
            p.error(f"--rate must be a number of requests/s or 'auto', got {args.rate!r}")
    if args.rate == "auto" and args.no_offline:
        p.error("--rate auto sets the rates from the offline engine: drop --no-offline or give --rate R")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if "kvmesh-local-b" in args.servers.split(",") and not args.kvmesh_args_b:
        p.error("kvmesh-local-b is kvmesh-local plus --kvmesh-args-b: give the flags to compare")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path

    from _common import cpu_model

    model_dir = resolve_model_path(args.model)
    servers = [s for s in args.servers.split(",") if s]
    if "vllm" in servers and not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        print(f"== vllm: skipped, no venv at {args.vllm_venv} (install it: {VLLM_INSTALL})")
        servers.remove("vllm")
    if args.wait_idle:
        wait_for_idle(args.wait_idle)
    check_idle(os.cpu_count() or 1)
    wls = [w for w in args.workloads.split(",") if w]
    tokenizer = load_tokenizer(model_dir)
    workloads = {w: make_workload(w, args, tokenizer) for w in wls}
    data = {"date": time.strftime("%Y-%m-%dT%H:%M"), "cpu": cpu_model(), "model": str(model_dir),
            "load_start": load_snapshot(), "workloads": wls, "slos_ms": {k: v * 1e3 for k, v in
                                                                          parse_goodput(args.goodput).items()},
            "args": vars(args), "results": {}}
    if not args.no_offline:  # first: --rate auto reads it, and it runs on cool cores
        data["results"]["offline"] = run_offline(model_dir, workloads)
        gc.collect()  # the offline engine's weights and KV cache go before the servers start
    calibrate_rates(workloads, data["results"].get("offline", {}), args.load)
    data["rates"] = {wl: r for wl, (_, r) in workloads.items() if r != float("inf")}  # the Poisson ones
    texts: dict[str, dict[str, dict[int, list]]] = {}  # server -> workload -> round -> texts
    for rnd in range(args.rounds):
        for name in round_order(servers, rnd):
            entry = data["results"].setdefault(name, {"rounds": [], "errors": []})
            try:
                summary, out = run_served(name, model_dir, workloads, args, rnd)
            except (RuntimeError, TimeoutError) as exc:
                print(f"== {name}: failed: {exc}", file=sys.stderr)
                entry["errors"].append(f"round {rnd + 1}: {exc}")
                continue
            entry["rounds"].append(summary)
            for wl, t in out.items():
                texts.setdefault(name, {}).setdefault(wl, {})[rnd] = t
    data["vs_vllm"] = compare(data, texts)
    data["load_end"] = load_snapshot()
    paths = write_results(args.name, data, render(data), plot, args.out_dir)
    print(render(data))
    print("wrote", ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
