"""Random multi-LoRA SGMV cases and a per-row dense oracle, shared by the CPU kernel tests
(tests/layers/test_lora_kernels.py) and the Triton ones (tests/gpu/test_triton_lora.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Segments as (start, length, slot): slot -1 runs the base model, a length 0 is empty.
Segments = list[tuple[int, int, int]]


@dataclass
class Case:
    y: torch.Tensor  # (T, N) the base output before the delta
    x: torch.Tensor  # (T, K)
    a: torch.Tensor  # (L, S, R, K)
    b: torch.Tensor  # (S, R, N), rank-major
    segments: Segments
    offsets: list[int]  # L + 1 column offsets

    def seg_tensors(self, index_dtype: torch.dtype = torch.int64,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cols = list(zip(*self.segments)) if self.segments else [(), (), ()]
        return tuple(torch.tensor(c, dtype=index_dtype, device=device) for c in cols)

    def covered(self) -> torch.Tensor:
        """(T,) bool: rows some adapter segment (slot >= 0) changes."""
        mask = torch.zeros(self.y.shape[0], dtype=torch.bool)
        for start, n, s in self.segments:
            if s >= 0:
                mask[start:start + n] = True
        return mask


def make_case(seed: int, t: int, k: int, widths: list[int], r: int, slots: int, dtype: torch.dtype,
              segments: Segments, ranks: list[int] | None = None) -> Case:
    """Random tensors; slot s uses ranks[s] <= r (the rest of its rank rows zero in a and b)."""
    g = torch.Generator().manual_seed(seed)
    n, num_shards = sum(widths), len(widths)
    a = torch.randn(num_shards, slots, r, k, generator=g) * k ** -0.5
    b = torch.randn(slots, r, n, generator=g) * r ** -0.5
    for s, rank in enumerate(ranks or [r] * slots):
        a[:, s, rank:] = 0
        b[s, rank:] = 0
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    return Case(y.to(dtype), x.to(dtype), a.to(dtype), b.to(dtype), segments, offsets)


def naive_delta(case: Case) -> torch.Tensor:
    """y + delta in float64, row by row, through each slot's dense (N_l, K) weight B_l A_l."""
    out = case.y.double().clone()
    for start, n, s in case.segments:
        if s < 0:
            continue
        for shard, (lo, hi) in enumerate(zip(case.offsets, case.offsets[1:])):
            dense = case.b[s, :, lo:hi].double().T @ case.a[shard, s].double()  # (N_l, K)
            for row in range(start, start + n):
                out[row, lo:hi] += dense @ case.x[row].double()
    return out


def random_segments(g: torch.Generator, t: int, slots: int) -> Segments:
    """Cuts [0, t) into runs (some empty, some base-model, a gap left uncovered now and then),
    at least one of them an adapter's."""
    segments: Segments = []
    row = 0
    while row < t:
        n = int(torch.randint(0, min(t - row, 20) + 1, (1,), generator=g))
        slot = int(torch.randint(-1, slots, (1,), generator=g))
        if int(torch.randint(0, 6, (1,), generator=g)) == 0:
            row += max(n, 1)  # a gap: rows in no segment
            continue
        segments.append((row, n, slot))
        row += n
    if not any(n and s >= 0 for _, n, s in segments):  # at least one adapter row
        segments = [(0, t, slots - 1)]
    return segments


# (T, K, shard widths, R, slots, ranks): plain, fused q/k/v with GQA-unequal widths, gate/up;
# K and widths off the vector width (kernel tails), T past the 16-row blocks.
SHAPES = [
    (1, 64, [48], 16, 2, None),
    (7, 40, [32, 8, 8], 8, 3, [8, 4, 2]),
    (37, 96, [64, 16, 16], 16, 4, [16, 5, 8, 1]),
    (70, 33, [24, 24], 32, 3, [32, 7, 12]),
    (20, 128, [130], 64, 2, [64, 9]),
]
