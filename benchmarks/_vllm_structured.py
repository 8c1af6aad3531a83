"""structured_outputs' vLLM runner: the same chat prompts through ``vllm.LLM.generate``, free and
under one JSON schema. Run with the vLLM venv's interpreter; imports only the standard library
and vLLM (0.1x-0.3x: ``StructuredOutputsParams`` in newer releases, ``GuidedDecodingParams``
before them).

    VENV/bin/python _vllm_structured.py --in spec.json --out result.json

Input: {"model", "prompts": [[ids]], "max_tokens", "schema", "rounds", "max_model_len"}. Output:
{"free": [wall_s per round], "json": [...], "free_tokens": [...], "json_tokens": [...], "json_texts": [...],
"vllm_version"}.
"""

from __future__ import annotations

import argparse
import json
import time


def _constrained(SamplingParams, schema: dict, max_tokens: int):
    try:
        from vllm.sampling_params import StructuredOutputsParams

        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema))
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return SamplingParams(temperature=0, max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(json=schema))


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(spec["model"], dtype="float32", max_model_len=spec["max_model_len"], enforce_eager=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    free = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
    cons = _constrained(SamplingParams, spec["schema"], spec["max_tokens"])
    res = {"vllm_version": vllm.__version__, "free": [], "json": [], "free_tokens": [], "json_tokens": []}
    for name, params in (("free", free), ("json", cons)):
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the schema's compile)
        for _ in range(spec["rounds"]):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            res[name].append(time.perf_counter() - t0)
        res[f"{name}_tokens"].append(sum(len(o.outputs[0].token_ids) for o in outs))
        if name == "json":
            res["json_texts"] = [o.outputs[0].text for o in outs]
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
