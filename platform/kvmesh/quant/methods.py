"""Quantization methods: an interface and a registry by name ("int8", "int4").

A method is an offline pass over an HF-named state dict: every linear projection
weight `P.weight` becomes kvmesh's canonical quantized tensors `P.qweight`,
`P.scales` (and `P.zeros`). The same pass quantizes at load time (`--quantization`),
streaming tensor by tensor, so a float checkpoint is never fully held twice.

Which weights: the seven Llama projections (q/k/v/o, gate/up/down) use the method's
scheme, and so do the token embedding and the lm_head (`embedding_scheme`). With
tied embeddings (SmolLM2) the vocabulary matrix is both the embedding and the
lm_head, 21% of the 135M model's bytes and read whole at every decode step; one
quantized copy serves both the gather (rows dequantized on lookup) and the matmul.
int8 keeps it int8 per row. int4 quantizes it int4 in groups of 32 (whatever the
projections' group size): at int8 it alone held int4-g32's total at 0.177x the float32
bytes; at int4 g32 the model is 0.156x, for +4.8% perplexity on the quality text
(int4-g32 with the int8 embedding: -0.2%; see benchmarks/quant.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvmesh.quant.primitives import INT4_GROUP_SIZES, pack_int4, quantize_int4, quantize_int8

# HF linear module names; Phi-3 checkpoints store qkv_proj and gate_up_proj fused
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
EMBED_NAME = "model.embed_tokens"
HEAD_NAME = "lm_head"


def module_kind(prefix: str) -> str | None:
    """"linear", "embed", "head" or None for an HF module path."""
    if prefix == EMBED_NAME:
        return "embed"
    if prefix == HEAD_NAME:
        return "head"
    return "linear" if prefix.rsplit(".", 1)[-1] in LINEAR_NAMES else None


class QuantMethod(ABC):
    """A weight-only quantization method (see module doc)."""

    name: str

    @abstractmethod
    def linear_scheme(self) -> str:
        """The scheme ("int8" / "int4") of the linear projections."""

    @abstractmethod
    def quantize_linear(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """(out, in) float weight -> canonical tensors by suffix."""

    def embedding_scheme(self) -> str:
        """The scheme of the token embedding and the lm_head (int8 per row by default)."""
        return "int8"

    def quantize_embedding(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """(vocab, hidden) float embedding / lm_head -> canonical tensors by suffix."""
        return _int8(w)

    def config(self) -> dict[str, Any]:
        """The config.json `quantization_config` of a checkpoint quantized with this method."""
        return {"quant_method": "kvmesh", "method": self.name}

    def fingerprint(self) -> dict[str, Any]:
        """What goes into the model fingerprint: KV from different methods never mixes."""
        return {"method": self.name}

    def quantize_state_dict(self, weights: Iterable[tuple[str, torch.Tensor]],
                            tie_word_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream an HF state dict, replacing quantizable weights with canonical tensors."""
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            kind = module_kind(prefix)
            if suffix != "weight" or kind is None:
                yield name, tensor
                continue
            if kind == "head" and tie_word_embeddings:
                continue  # the embedding's quantized copy is the head
            parts = self.quantize_linear(tensor) if kind == "linear" else self.quantize_embedding(tensor)
            for key, value in parts.items():
                yield f"{prefix}.{key}", value


def _int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, s = quantize_int8(w)
    return {"qweight": q, "scales": s}


class Int8Method(QuantMethod):
    """Per-output-channel symmetric int8 weights."""

    name = "int8"

    def __init__(self, group_size: int | None = None):
        if group_size is not None:
            raise ValueError("group_size: int8 is per output channel and takes no group size; drop --group-size")

    def linear_scheme(self) -> str:
        return "int8"

    def quantize_linear(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return _int8(w)


class Int4Method(QuantMethod):
    """Group-wise asymmetric int4 weights (min/max per group of `group_size` inputs).

    A layer whose in_features the group size does not divide uses the largest of
    128 / 64 / 32 that does (SmolLM2's hidden size 576 is 4.5 x 128: its q/k/v/gate/up
    projections get groups of 64 under group_size=128).
    """

    name = "int4"

    def __init__(self, group_size: int | None = None):
        group_size = 32 if group_size is None else group_size
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size: {group_size} is not supported for int4; use one of {list(INT4_GROUP_SIZES)}")
        self.group_size = group_size

    def linear_scheme(self) -> str:
        return "int4"

    def group_for(self, in_features: int) -> int:
        for g in sorted((g for g in INT4_GROUP_SIZES if g <= self.group_size), reverse=True):
            if in_features % g == 0:
                return g
        raise ValueError(f"group_size: no int4 group size in {list(INT4_GROUP_SIZES)} divides in_features={in_features}")

    def quantize_linear(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s, z = quantize_int4(w, self.group_for(w.shape[1]))
        return {"qweight": pack_int4(q), "scales": s, "zeros": z}

    def embedding_scheme(self) -> str:
        return "int4"

    def quantize_embedding(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        # Groups of 32 whatever `group_size`: the vocabulary matrix is the most sensitive
        # layer (at g64 it alone added ~12 points of perplexity over g32 on the quality text).
        q, s, z = quantize_int4(w, 32)
        return {"qweight": pack_int4(q), "scales": s, "zeros": z}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "group_size": self.group_size}

    def fingerprint(self) -> dict[str, Any]:
        return {"method": self.name, "group_size": self.group_size, "embedding": "int4-g32"}


QUANT_METHODS: dict[str, type[QuantMethod]] = {}


def register_method(cls: type[QuantMethod]) -> type[QuantMethod]:
    QUANT_METHODS[cls.name] = cls
    return cls


register_method(Int8Method)
register_method(Int4Method)


def get_method(name: str, group_size: int | None = None) -> QuantMethod:
    """The registered method `name`; errors list the valid names."""
    cls = QUANT_METHODS.get(name)
    if cls is None:
        raise ValueError(f"quantization: unknown method {name!r}; valid: {sorted(QUANT_METHODS)}")
    return cls(group_size)
