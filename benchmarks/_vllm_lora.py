"""lora_throughput's vLLM runner: the same token ids through ``vllm.LLM.generate``, base-only with
LoRA off, then under 1 / 4 / 16 adapters (round-robin over the requests) with LoRA on. Run with
the vLLM venv's interpreter; imports only the standard library and vLLM.

    VENV/bin/python _vllm_lora.py --in spec.json --out result.json

Input: {"model", "prompts": [[ids]], "max_tokens", "rounds", "max_model_len", "adapters": [[name, path]],
"mixes": [0, 1, 4, 16], "max_lora_rank"}. Output: {"vllm_version", "walls": {mix: [wall_s per round]},
"tokens": {mix: n}, "load_s": [first-use seconds per adapter]}.
"""

from __future__ import annotations

import argparse
import json
import time


def _requests(LoRARequest, adapters, mix: int, n: int):
    if mix == 0:
        return None
    return [LoRARequest(adapters[i % mix][0], 1 + i % mix, adapters[i % mix][1]) for i in range(n)]


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    res = {"vllm_version": vllm.__version__, "walls": {}, "tokens": {}, "load_s": []}
    common = dict(dtype="float32", max_model_len=spec["max_model_len"], enforce_eager=True,
                  enable_prefix_caching=False)
    mixes = spec["mixes"]
    adapters = spec["adapters"]
    base = LLM(spec["model"], **common)
    base.generate(prompts, params, use_tqdm=False)  # warm-up
    for _ in range(spec["rounds"]):
        t0 = time.perf_counter()
        outs = base.generate(prompts, params, use_tqdm=False)
        res["walls"].setdefault("0", []).append(time.perf_counter() - t0)
        res["tokens"]["0"] = sum(len(o.outputs[0].token_ids) for o in outs)
    # The LoRA engine is built after the base runs, so the two KV caches never compete.
    del base
    import gc

    gc.collect()
    lora = LLM(spec["model"], enable_lora=True, max_loras=max(mixes), max_lora_rank=spec["max_lora_rank"],
               max_cpu_loras=max(mixes), **common)
    one = [TokensPrompt(prompt_token_ids=spec["prompts"][0])]
    short = SamplingParams(temperature=0, max_tokens=1)
    for i, (name, path) in enumerate(adapters[: max(mixes)]):
        t0 = time.perf_counter()
        lora.generate(one, short, lora_request=LoRARequest(name, i + 1, path), use_tqdm=False)
        res["load_s"].append(time.perf_counter() - t0)
    for mix in [m for m in mixes if m]:
        lora.generate(prompts, params, lora_request=_requests(LoRARequest, adapters, mix, len(prompts)),
                      use_tqdm=False)  # warm-up
    for _ in range(spec["rounds"]):
        for mix in [m for m in mixes if m]:
            reqs = _requests(LoRARequest, adapters, mix, len(prompts))
            t0 = time.perf_counter()
            outs = lora.generate(prompts, params, lora_request=reqs, use_tqdm=False)
            res["walls"].setdefault(str(mix), []).append(time.perf_counter() - t0)
            res["tokens"][str(mix)] = sum(len(o.outputs[0].token_ids) for o in outs)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--in", dest="inp", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.inp) as f:
        spec = json.load(f)
    with open(a.out, "w") as f:
        json.dump(run(spec), f)
