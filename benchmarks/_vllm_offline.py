"""engine_throughput's vLLM CPU runner: one offline workload through ``vllm.LLM.generate``.

Run by ``_peer_procs.run_vllm`` with the vLLM venv's interpreter (vLLM lives in a venv of
its own, ``scripts/install_vllm_cpu.sh``); it imports only the standard library and
vLLM, never kvmesh. Usage::

    VENV/bin/python _vllm_offline.py --in workload.json --out result.json

Input JSON: ``{"model": HF folder, "prompts": [[ids]], "output_lens": [n], "max_model_len": int,
"warmup_passes": int, "repeats": int}``; with ``"control_fds": [r, w]`` (inherited pipe ends) the
timed passes alternate with the parent's engine: after the warm-up the child writes ``ready``
on ``w``, then runs one timed pass per ``go`` line read from ``r`` and answers each with a JSON
line (``{"wall_s": ...}``), so the parent can time its own pass between two of vLLM's while vLLM
sits idle, loaded and warm. Protocol: build the ``LLM`` (float32), run the whole
workload ``warmup_passes`` times untimed (the first full pass is ~30% slower: allocator and
oneDNN warm-up), then ``repeats`` timed passes; the prefix cache is reset before every pass so
no pass reuses another's prompts. Output JSON: wall time per pass, the generated token ids of
the last pass, prefix-cache hits per pass (should be 0), vLLM's version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _reset_prefix_cache(llm) -> bool:
    """Drop cached prefixes before a pass; False (recorded) where vLLM refuses or lacks the call."""
    try:
        return bool(llm.reset_prefix_cache())
    except Exception as e:  # other vLLM versions' APIs: recorded, not fatal
        print(f"vllm: reset_prefix_cache failed: {e}", file=sys.stderr)
        return False


class _Control:
    """The alternation pipe: `ready` once warm, then a `go` line before every timed pass."""

    def __init__(self, read_fd: int, write_fd: int):
        self.r, self.w = os.fdopen(read_fd, "r"), os.fdopen(write_fd, "w")

    def say(self, msg) -> None:
        self.w.write(json.dumps(msg) + "\n")
        self.w.flush()

    def wait_turn(self, first: bool) -> None:
        if first:
            self.say("ready")
        if self.r.readline().strip() != "go":
            raise SystemExit("vllm: the parent closed the control pipe")


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in spec["output_lens"]]

    def one_pass() -> tuple[float, list, bool]:
        reset = _reset_prefix_cache(llm)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, outs, reset

    control = _Control(*spec["control_fds"]) if spec.get("control_fds") else None
    warm_walls, walls, hits, resets, outs = [], [], [], [], []
    passes = [("warmup", i) for i in range(spec["warmup_passes"])] + [("timed", i) for i in range(spec["repeats"])]
    for kind, i in passes:
        if control is not None and kind == "timed":
            control.wait_turn(first=i == 0)
        wall, outs, reset = one_pass()
        if control is not None and kind == "timed":
            control.say({"pass": i, "wall_s": wall})
        (warm_walls if kind == "warmup" else walls).append(wall)
        resets.append(reset)
        hits.append(sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs))
        print(f"vllm {kind} pass {i + 1}: {wall:.2f} s", file=sys.stderr, flush=True)
    return {
        "vllm_version": vllm.__version__,
        "load_s": load_s,
        "warmup_wall_s": warm_walls,
        "wall_s_all": walls,
        "prefix_cache_reset": all(resets),
        "prefix_hit_tokens_per_pass": hits,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k.startswith("OMP_")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="inp", required=True, help="workload JSON")
    p.add_argument("--out", required=True, help="result JSON")
    args = p.parse_args()
    with open(args.inp) as f:
        spec = json.load(f)
    res = run(spec)
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
