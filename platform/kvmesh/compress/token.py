"""Token-level compression (LLMLingua-style): drop the words a small causal LM finds
most predictable.

The self-information of a token is -log p(token | the document before it) under the
LM (the embedded SmolLM2-135M by default), computed over each context document in
chunks that carry the KV cache forward. A word's score is the mean self-information
of its LM tokens (information per token, so a greedy fill of the token budget keeps
the most information); whole words are kept or dropped, never parts of one.
"""

from __future__ import annotations

import bisect
import math
import os
from pathlib import Path

from kvmesh.checkpoint.files import load_tokenizer, resolve_model_path
from kvmesh.compress.options import CompressionOptions
from kvmesh.compress.text import Span, word_spans


class TokenCompressor:
    """Scores words by LM self-information. Loads the LM once (construction is slow)."""

    name = "token"
    min_keep = 0

    def __init__(self, model_path: Path | None = None, chunk_tokens: int = 512, window_tokens: int = 4096):
        import torch
        from transformers import AutoModelForCausalLM

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.path = resolve_model_path(None if model_path is None else str(model_path), progress=False)
        self.tokenizer = load_tokenizer(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32).eval()
        self.chunk_tokens = chunk_tokens
        # Past this many tokens the KV cache restarts (bounded memory, and the model's
        # positions): later tokens are conditioned on the current window only.
        self.window_tokens = window_tokens

    def units(self, contexts: list[str], options: CompressionOptions) -> list[list[Span]]:
        return [word_spans(c) for c in contexts]

    def score(self, contexts: list[str], units: list[list[Span]], question: str) -> list[list[float]]:
        return [self._word_scores(c, u) for c, u in zip(contexts, units)]

    def self_information(self, text: str) -> tuple[list[float], list[Span]]:
        """(-log p of each LM token of `text` in nats, its character span)."""
        import torch
        import torch.nn.functional as F

        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        bos = self.tokenizer.bos_token_id
        seq = ([bos] if bos is not None else []) + ids
        first = len(seq) - len(ids)  # index in seq of the first text token
        info = [math.nan] * len(seq)
        past, past_len = None, 0
        with torch.inference_mode():
            for start in range(0, len(seq), self.chunk_tokens):
                if past_len >= self.window_tokens:
                    past, past_len = None, 0
                chunk = seq[start:start + self.chunk_tokens]
                out = self.model(input_ids=torch.tensor([chunk]), past_key_values=past, use_cache=True)
                past, past_len = out.past_key_values, past_len + len(chunk)
                logp = F.log_softmax(out.logits[0].float(), dim=-1)  # (T, V): predicts seq[start+1 : start+T+1]
                targets = torch.tensor(seq[start + 1:start + 1 + len(chunk)])
                nll = -logp[: len(targets)].gather(1, targets[:, None])[:, 0]
                info[start + 1:start + 1 + len(targets)] = nll.tolist()
        # Without a BOS the first token has no prediction: give it the mean (neutral).
        known = [v for v in info[first:] if not math.isnan(v)]
        fill = sum(known) / len(known) if known else 0.0
        return [fill if math.isnan(v) else v for v in info[first:]], offsets

    def _word_scores(self, text: str, words: list[Span]) -> list[float]:
        if not words:
            return []
        info, offsets = self.self_information(text)
        starts = [s for s, _ in words]
        total, count = [0.0] * len(words), [0] * len(words)
        for v, (ts, te) in zip(info, offsets):
            if te <= ts:
                continue
            i = bisect.bisect_right(starts, te - 1) - 1  # the word holding the token's last character
            if i >= 0 and te - 1 < words[i][1]:
                total[i] += v
                count[i] += 1
        return [t / c if c else 0.0 for t, c in zip(total, count)]
