"""Perplexity of an engine's model on a token sequence (the quality check of quantization).

Runs the model directly over the sequence in chunks (chunked prefill of one
sequence), with KV blocks borrowed from the engine's pool and given back, so the
engine stays usable and its free-block count is unchanged afterwards.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvmesh.layers.attention import SeqSpan


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int = 512) -> float:
    """exp(mean NLL) of token_ids[1:] given their prefixes, teacher-forced."""
    runner, pool = engine.executor.runner, engine.kv_manager.pool
    bs, device = runner.block_size, runner.device
    n = len(token_ids)
    if n < 2:
        raise ValueError("token_ids: need at least 2 tokens")
    blocks = pool.get_new_blocks(math.ceil(n / bs))
    block_ids = [b.block_id for b in blocks]
    nll = 0.0
    try:
        for start in range(0, n - 1, chunk):
            ids = token_ids[start:min(start + chunk, n - 1)]
            span = SeqSpan(0, len(ids), start, block_ids[: math.ceil((start + len(ids)) / bs)])
            meta = runner.backend.build_metadata([span], 0)
            hidden = runner.model(torch.tensor(ids, device=device),
                                  torch.arange(start, start + len(ids), device=device),
                                  runner.kv_caches, meta, runner.backend)
            logp = F.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            targets = torch.tensor(token_ids[start + 1:start + 1 + len(ids)], device=device)
            nll -= logp.gather(1, targets[:, None]).sum().item()
    finally:
        pool.free_blocks(blocks)
    return math.exp(nll / (n - 1))


# The fixed English text of the quality checks: CPython's own LICENSE.txt (the history
# of the software and the PSF license), which ships with every Python installation.
def license_text() -> tuple[str, str]:
    """(text, where it came from)."""
    import sysconfig
    from pathlib import Path

    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    return path.read_text(encoding="utf-8"), f"CPython {path}"


def eval_tokens(tokenizer, max_tokens: int = 1024) -> tuple[list[int], str]:
    """The first `max_tokens` tokens of license_text(), with a BOS when the model has one."""
    text, source = license_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    return ids, f"{source}, first {len(ids)} tokens"
