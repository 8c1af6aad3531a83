"""Vocabulary-parallel token embedding and LM head (Megatron's / vLLM's layout).

Over `OpContext.tp` (world size 1 by default: no sharding, no communication, and exactly
`nn.Embedding` / a replicated `Linear`), the vocabulary is padded up to a multiple of the
tensor parallel size and rank r holds rows [r V'/tp, (r+1) V'/tp) of the (V', H) matrix:

- embedding: each rank looks up the ids in its range (the others read row 0 and are
  zeroed), then one all-reduce sums the ranks' rows: every id is found on exactly one rank,
  so the sum is the unsharded lookup, bit for bit;
- LM head: a column-parallel Linear over the padded vocabulary; `gather_vocab` joins the
  ranks' logit slices (an all-gather) and drops the padding, so every rank holds the full
  (T, V) logits and sampling needs no communication. Tied embeddings share the shard: both
  matrices hold the same rows.

Padded rows are zero (never loaded from a checkpoint): their logits are cut before anyone
sees them, and no id reaches them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.layers.linear import Linear
from kvmesh.layers.op import COMM, OpContext, TPGroup


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of `tp_size` (each rank holds a 1/tp share)."""
    return -(-vocab_size // tp_size) * tp_size


def vocab_shard(loaded: torch.Tensor, out: torch.Tensor, start: int) -> None:
    """Copy rows [start, start + len(out)) of a full (V, H) checkpoint tensor into `out`,
    zero-filling what lies past V (the padding)."""
    rows = max(0, min(out.shape[0], loaded.shape[0] - start))
    out[:rows].copy_(loaded.narrow(0, start, rows))
    out[rows:].zero_()


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding(num_embeddings, embedding_dim) with its rows split over the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: OpContext | None = None):
        super().__init__()
        self.tp = (ctx or OpContext()).tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_local = padded_vocab(num_embeddings, self.tp.size) // self.tp.size
        self.vocab_start = self.tp.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim))
        if not self.weight.is_meta:  # nn.Embedding's init; on meta (where loaders build models) normal_
            nn.init.normal_(self.weight)  # runs a Python reference that imports torch._dynamo (1.5 s)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of the full (V, H) checkpoint embedding."""
        if loaded.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs embedding "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        with torch.no_grad():
            vocab_shard(loaded, param.data, self.vocab_start)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
                f"{self.vocab_start + self.num_local}) of rank {self.tp.rank}/{self.tp.size}")


class ParallelLMHead(Linear):
    """The output projection (H -> V), column-parallel over the padded vocabulary. Its output
    is this rank's logit slice: models pass it through `gather_vocab`."""

    def __init__(self, hidden_size: int, vocab_size: int, ctx: OpContext | None = None):
        ctx = ctx or OpContext()
        super().__init__(hidden_size, padded_vocab(vocab_size, ctx.tp.size), bias=False, ctx=ctx,
                         parallel="column" if ctx.tp.size > 1 else "replicated")
        self.vocab_size = vocab_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if loaded.shape != (self.vocab_size, self.in_features):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs lm_head "
                             f"({self.vocab_size}, {self.in_features})")
        with torch.no_grad():
            vocab_shard(loaded, param.data, self.ctx.tp.rank * self.out_features)
        self.invalidate()


def gather_vocab(logits: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor:
    """(T, V'/tp) logit slices of every rank -> the full (T, V) logits on every rank."""
    if tp.size == 1:
        return logits
    if tp.shm is not None and logits.device.type == "cpu":
        with COMM.timed("all_gather", logits, logits.nbytes * tp.size):
            parts = tp.shm.all_gather(logits).unbind(0)
    else:
        parts = [torch.empty_like(logits) for _ in range(tp.size)]
        with COMM.timed("all_gather", logits, logits.nbytes * tp.size):
            torch.distributed.all_gather(parts, logits.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]
