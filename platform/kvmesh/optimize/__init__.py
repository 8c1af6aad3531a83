"""Offline model optimization: structured pruning and knowledge distillation.

* ``prune``: drop decoder layers (block influence), GQA head groups and MLP channels
  (activation-weighted magnitude) using calibration text; writes an HF folder.
* ``distill``: train a pruned or truncated student on its teacher's logits (CPU,
  resumable); writes an HF folder usable as a speculative-decoding draft.
* ``corpus``: the offline text (shipped with CPython) split into calibration /
  train / eval sets that do not overlap.
* ``cli``: ``kvmesh optimize prune | distill``.
"""
