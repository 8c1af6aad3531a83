"""Pipeline parallelism, one stage's part: the step's flat batch cut into micro-batches that
flow through the stages, so that while stage s runs micro-batch i, stage s-1 already runs
micro-batch i+1.

Stage r of `size` holds a contiguous run of the decoder layers (layers/op.py PipelineStage)
and the KV caches of those layers only; stage 0 also holds the embedding, the final norm and
the LM head, and lives in the engine's process: it embeds, runs its layers, and sends each
micro-batch's hidden states to stage 1; the last stage sends its output back to stage 0,
which computes the logits and samples, as a TP=1 runner does. Holding the LM head on
stage 0 (vLLM holds it on the last stage) keeps the sampler and its per-request state in
the engine's process, keeps one copy of tied embeddings, and makes the return trip a
(T, hidden) tensor instead of (rows, vocab) logits.

Micro-batches are cut by tokens, not by requests: the flat batch's T tokens split into
`size` near-equal runs, a prefill chunk cut where a boundary falls into it. Each stage runs
the micro-batches in order, so at every layer the first part of a cut chunk has written its
keys and values to the paged cache before the second part attends to them: the second part
is a chunked-prefill continuation (start_pos past the first part). Every stage derives the
same cut from the same SchedulerOutput (ModelRunner.execute sorts and lays out the batch
deterministically), so only hidden states travel, point to point over gloo, tagged by
micro-batch.

Within a step this is GPipe's schedule: with m micro-batches over p stages the bubble is
(p - 1) / (m + p - 1) of the stages' time. Between steps the stages wait for stage 0 to
sample and schedule (no cross-step micro-batches: the engine loop runs one step at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.layers.attention import SeqSpan
from kvmesh.layers.lora import LoRABatch, lora_batch
from kvmesh.layers.op import COMM

KV_TAG = 1 << 20  # tags of KV block transfers (read_blocks / write_blocks), apart from micro-batch tags


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's place in a pipeline: stage `rank` of `size`, over a gloo process group in
    which stage s is rank `peers[s]` (with tensor parallelism too, the ranks of the same
    tensor rank in every stage: worker/groups.py)."""

    rank: int
    size: int
    group: Any  # torch.distributed ProcessGroup
    peers: tuple[int, ...] = ()

    def _peer(self, stage: int) -> int:
        return self.peers[stage] if self.peers else stage

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def send(self, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending `tensor` to stage `dst` (keep it alive and unchanged until the
        returned work's wait())."""
        return self.group.send([tensor], self._peer(dst), tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int):
        """Start receiving into `tensor` from stage `src`; wait() on the returned work before reading it."""
        return self.group.recv([tensor], self._peer(src), tag)


@dataclass
class MicroBatch:
    tokens: slice  # its rows of the step's flat batch
    spans: list[SeqSpan]  # its sequences (or parts of them), q_start from 0
    num_decodes: int  # the decodes among them come first, as in the flat batch

    @property
    def num_tokens(self) -> int:
        return self.tokens.stop - self.tokens.start


def split_microbatches(spans: list[SeqSpan], num_decodes: int, count: int) -> list[MicroBatch]:
    """The flat batch `spans` (decodes first) cut into at most `count` micro-batches of
    near-equal token counts, in order; a span that a cut falls into is split in two, its second
    part starting where the first ends (start_pos advanced)."""
    total = spans[-1].q_start + spans[-1].q_len if spans else 0
    count = max(1, min(count, total))
    cuts = [round(i * total / count) for i in range(count + 1)]
    out: list[MicroBatch] = []
    for lo, hi in zip(cuts, cuts[1:]):
        parts, decodes = [], 0
        for i, s in enumerate(spans):
            a, b = max(lo, s.q_start), min(hi, s.q_start + s.q_len)
            if a >= b:
                continue
            offset = a - s.q_start
            parts.append(SeqSpan(a - lo, b - a, s.start_pos + offset, s.block_ids))
            decodes += i < num_decodes
        out.append(MicroBatch(slice(lo, hi), parts, decodes))
    return out


Forward = Callable[..., torch.Tensor]


class PipelineForward:
    """One stage's forward of a step, micro-batch by micro-batch (ModelRunner.execute calls it
    in place of the model's forward). Stage 0 returns the step's final hidden states (T,
    hidden) once the last stage has sent them all back; later stages return None."""

    def __init__(self, group: PipelineGroup, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.group, self.hidden_size, self.dtype, self.device = group, hidden_size, dtype, device

    def __call__(self, model: Forward, spans: list[SeqSpan], num_decodes: int, input_ids: torch.Tensor,
                 positions: torch.Tensor, kv_caches: list, backend, lora: LoRABatch | None = None
                 ) -> torch.Tensor | None:
        """`lora`: the step's adapter rows (each micro-batch runs under its window of them)."""
        g = self.group
        mbs = split_microbatches(spans, num_decodes, g.size)
        returned: list[tuple[Any, torch.Tensor]] = []
        if g.first:  # post the receives of the last stage's outputs up front
            for i, mb in enumerate(mbs):
                buf = self._buffer(mb.num_tokens)
                returned.append((g.recv(buf, g.size - 1, i), buf))
        sending: list[tuple[Any, torch.Tensor]] = []
        for i, mb in enumerate(mbs):
            meta = backend.build_metadata(mb.spans, mb.num_decodes)
            rows = None if lora is None else lora.window(mb.tokens.start, mb.tokens.stop)
            if g.first:
                with lora_batch(rows):
                    h = model(input_ids[mb.tokens], positions[mb.tokens], kv_caches, meta, backend)
            else:
                h = self._buffer(mb.num_tokens)
                with COMM.timed("pp_wait", h):
                    g.recv(h, g.rank - 1, i).wait()
                with lora_batch(rows):
                    h = model(None, positions[mb.tokens], kv_caches, meta, backend, hidden=h)
            # A copy: the next micro-batch may reuse the buffer a fast path returned this one in.
            h = h.clone()
            if COMM.enabled:
                COMM.add("pp_send", h.nbytes)
            sending.append((g.send(h, 0 if g.last else g.rank + 1, i), h))
        with COMM.timed("pp_wait", h, 0):
            for work, _ in sending:
                work.wait()
            if g.first:
                for work, _ in returned:
                    work.wait()
        if not g.first:
            return None
        return torch.cat([buf for _, buf in returned]) if len(returned) > 1 else returned[0][1]

    def _buffer(self, tokens: int) -> torch.Tensor:
        return torch.empty((tokens, self.hidden_size), dtype=self.dtype, device=self.device)
