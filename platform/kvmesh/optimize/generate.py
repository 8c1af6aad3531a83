"""Teacher-generated chat data for distillation (sequence-level, on-policy for the teacher).

A draft model for speculative decoding is only useful where it predicts what the
*target* will say, and in serving the target answers chat prompts. So the draft is
best distilled on the teacher's own replies (DistillSpec, Zhou et al. 2023: on-policy
data is what aligns a draft with its target), not only on documentation prose. Here
the teacher (served by kvmesh's engine, batched, greedy) answers `chat_prompts` built
from a corpus split; each conversation (chat template + reply + EOS) is packed into
fixed-length windows, and the usual logit distillation runs over them.
Generation is deterministic (greedy), so the data is a pure function of the teacher
and the settings, and is cached beside the run's checkpoint for --resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.llm import LLM
from kvmesh.optimize.corpus import chat_prompts, pack_windows


def chat_data_key(teacher_path: Path, split: str, num_prompts: int, max_tokens: int, seq_len: int) -> str:
    raw = json.dumps([str(teacher_path.resolve()), split, num_prompts, max_tokens, seq_len])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def teacher_chat_windows(teacher_path: Path, *, num_prompts: int, max_tokens: int, seq_len: int,
                         split: str = "train", cache: Path | None = None, threads: int | None = None,
                         progress: bool = True) -> list[list[int]]:
    """seq_len-token windows of the teacher's greedy replies to `num_prompts` chat prompts."""
    key = chat_data_key(teacher_path, split, num_prompts, max_tokens, seq_len)
    if cache is not None and cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return data["windows"]
    import torch

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model=str(teacher_path), progress=progress, dtype="float32")
    eng = llm.engine
    tok = eng.tokenizer
    if not getattr(tok, "chat_template", None):
        # A base model: the instruction as plain text, the continuation as the reply.
        prompts = [eng.encode(p) for p in chat_prompts(split, num_prompts)]
    else:
        prompts = [eng.encode_chat([{"role": "user", "content": p}]) for p in chat_prompts(split, num_prompts)]
    room = eng.max_model_len - max_tokens
    if room < 1:
        raise ValueError(f"chat_max_tokens: {max_tokens} leaves no room for a prompt in the teacher's "
                         f"{eng.max_model_len}-token context")
    prompts = [p[-room:] for p in prompts]  # an over-long instruction keeps its end (the chat turn)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=progress)
    stream: list[int] = []
    for prompt, out in zip(prompts, outs):
        stream += [*prompt, *out.outputs[0].token_ids]
        if tok.eos_token_id is not None and (not stream or stream[-1] != tok.eos_token_id):
            stream.append(tok.eos_token_id)
    windows = pack_windows(stream, seq_len, tok.bos_token_id, what="teacher chat replies")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "windows": windows}))
        os.replace(tmp, cache)
    return windows
