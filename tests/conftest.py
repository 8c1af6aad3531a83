"""Shared fixtures: tiny random Llama-family checkpoints built in the tests.

Each checkpoint folder is written with transformers' own `save_pretrained` (so the
layout is the real HF one) plus a small byte-level BPE tokenizer trained on the fly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Keep test runs deterministic and polite on a 2-core machine.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU, Triton kernels (tests/gpu) run interpreted on CPU tensors; triton reads
# the flag when the kernels are defined, i.e. when kvmesh.layers is first imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import build_tiny_model, build_tokenizer  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Build (and cache per argument set) tiny random checkpoints."""
    cache: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp("tiny"), **kwargs)
        return cache[key]

    return make


@pytest.fixture
def stack_calls(monkeypatch):
    """Counts the forward passes that ran as one decode_stack call."""
    from kvmesh.layers.decode_stack import DecodeStack

    calls = []
    original = DecodeStack.step_args

    def spy(self, h, meta, backend):
        args = original(self, h, meta, backend)
        calls.append(args is not None)
        return args

    monkeypatch.setattr(DecodeStack, "step_args", spy)
    return calls
