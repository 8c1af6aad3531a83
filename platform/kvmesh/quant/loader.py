"""Build a quantized model: swap modules for quantized ones, then route checkpoint tensors.

Three sources, one path:

- a checkpoint already quantized (config.json `quantization_config`: kvmesh, gptq,
  awq): which modules are quantized is read from the tensor names (a module is
  quantized iff `<module>.qweight` exists), and its tensors are converted by the
  format's reader (formats.py);
- a float checkpoint plus `--quantization METHOD`: the method's offline pass runs on
  the tensor stream as it is read, producing kvmesh-format tensors;
- `--quantization gguf`: the GGUF file the folder was converted from, its Q4_0 / Q4_1 /
  Q8_0 tensors streamed as kvmesh-format tensors without a float round trip
  (gguf_weights.py).

Order: build on meta -> swap modules (quantized ones allocate on first load) ->
materialize the rest -> stream: float tensors go through the model's own
`load_weights`, quantized ones are collected (a module's tensors may sit in
different files) and loaded per module at the end -> cast float parameters to the
model dtype -> finalize quantized modules (their buffers keep their own dtypes).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvmesh.checkpoint.files import iter_safetensors
from kvmesh.config import KernelConfig
from kvmesh.errors import ConfigError
from kvmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding, vocab_shard
from kvmesh.layers.linear import Linear
from kvmesh.layers.moe import FusedMoE, expert_tensor
from kvmesh.layers.op import PipelineStage, TPGroup, fast_paths_changed
from kvmesh.models.loader import load_arch_config, load_float_model, op_context, stage_weights
from kvmesh.models.registry import model_class
from kvmesh.quant import gguf_weights
from kvmesh.quant.formats import CheckpointFormat, KVMeshFormat, format_from_config
from kvmesh.quant.methods import EMBED_NAME, HEAD_NAME, LINEAR_NAMES, QuantMethod, get_method
from kvmesh.quant.modules import QuantEmbedding, QuantLinear
from kvmesh.quant.moe import QuantFusedMoE


def read_quantization_config(path: Path) -> dict[str, Any] | None:
    """config.json's `quantization_config`, or None for a float checkpoint."""
    with open(path / "config.json") as f:
        qc = json.load(f).get("quantization_config")
    return dict(qc) if qc else None


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str | None = None, group_size: int | None = None, kernels: KernelConfig | None = None,
               tp: TPGroup | None = None, pp: PipelineStage | None = None):
    """Build the model for `path` and load its weights; returns (model, ArchConfig).

    `quantization` ("int8" / "int4") quantizes a float checkpoint while loading, "gguf"
    loads the GGUF the folder came from kept quantized; a checkpoint whose config.json has
    a `quantization_config` (kvmesh, GPTQ, AWQ) is loaded quantized as stored; anything
    else loads float weights. `tp`: this rank's tensor-parallel group; the model holds this
    rank's shard (None: one rank, everything). `pp`: this rank's pipeline stage; the model
    holds its layers (None: all of them).
    """
    if quantization is None and read_quantization_config(path) is None:
        return load_float_model(path, dtype, device, max_positions, kernels, tp, pp)
    return load_quantized_model(path, load_arch_config(path), dtype, device, max_positions, quantization, group_size,
                                kernels, tp, pp)


def quantization_id(path: Path, quantization: str | None, group_size: int | None) -> dict[str, Any] | None:
    """The model fingerprint's "quantization" entry (None: float weights)."""
    qc = read_quantization_config(path)
    if qc is not None:
        return {"checkpoint": qc}
    if quantization == gguf_weights.METHOD:
        _check_gguf_args(group_size)
        return gguf_weights.fingerprint(path)
    if quantization is None:
        if group_size is not None:
            raise ConfigError("model.quantization_group_size: set only together with model.quantization")
        return None
    return get_method(quantization, group_size).fingerprint()


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def _target(model: nn.Module, prefix: str) -> tuple[str, str | None]:
    """HF module path -> (kvmesh module path, shard) through the model's fused mapping."""
    for ckpt, (fused, shard) in model.packed_modules.items():
        if prefix.endswith(f".{ckpt}"):
            return prefix[: -len(ckpt)] + fused, shard
    return prefix, None


def _plan_from_keys(keys: Iterable[str], fmt: CheckpointFormat) -> dict[str, str]:
    """{HF module path: scheme} for every module stored quantized."""
    suffixes: dict[str, set[str]] = defaultdict(set)
    for key in keys:
        prefix, _, suffix = key.rpartition(".")
        if suffix in fmt.suffixes:
            suffixes[prefix].add(suffix)
    return {p: fmt.scheme(s) for p, s in suffixes.items() if "qweight" in s}


def _check_gguf_args(group_size: int | None) -> None:
    if group_size is not None:
        raise ConfigError("model.quantization_group_size: GGUF blocks are 32 columns; drop it with quantization=gguf")


def _plan_from_method(model: nn.Module, method: QuantMethod, tied: bool) -> dict[str, str]:
    plan = {}
    if model.holds(f"{EMBED_NAME}.weight"):  # on pipeline stage 0 only, like the LM head
        plan[EMBED_NAME] = method.embedding_scheme()
        if not tied:
            plan[HEAD_NAME] = method.embedding_scheme()
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            # Expand fused modules back to their HF shards: the stream has HF names.
            shards = [c for c, (f, _) in model.packed_modules.items() if name.endswith(f)] or [name.rsplit(".", 1)[-1]]
            parent = name.rsplit(".", 1)[0]
            for shard in shards:
                plan[f"{parent}.{shard}"] = method.linear_scheme()
    return plan


def _swap(model: nn.Module, plan: dict[str, str], tied: bool, device: torch.device,
          kernels: KernelConfig) -> dict[str, tuple[nn.Module, str | None]]:
    """Replace planned modules; returns {HF module path: (quantized module, shard)}."""
    by_target: dict[str, set[str]] = defaultdict(set)
    for prefix, scheme in plan.items():
        by_target[_target(model, prefix)[0]].add(scheme)
    new: dict[str, nn.Module] = {}
    for target, schemes in by_target.items():
        if len(schemes) != 1:
            raise ValueError(f"checkpoint: the shards of {target} are quantized differently ({sorted(schemes)}); "
                             "kvmesh fuses them into one module, so they need one scheme (int8 or int4)")
        scheme = schemes.pop()
        old = model.get_submodule(target)
        if target == EMBED_NAME:
            module = QuantEmbedding(old.num_embeddings, old.embedding_dim, device, scheme,
                                    native_gemm=kernels.cpu_kernels and kernels.quantized_cpu_gemm, tp=old.tp)
        elif isinstance(old, Linear):
            if target == HEAD_NAME and tied:
                raise ValueError("checkpoint: lm_head is quantized but tied to a float embedding")
            module = QuantLinear.like(scheme, old, device)
        else:
            raise ValueError(f"checkpoint: {target} is stored quantized but is not a linear layer")
        parent, _, child = target.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
        new[target] = module
    fast_paths_changed()  # the model's layers are no longer the float ones its fast paths gathered
    if tied and isinstance(new.get(EMBED_NAME), QuantEmbedding):
        model.lm_head = new[EMBED_NAME].head
    routes = {}
    for prefix in plan:
        target, shard = _target(model, prefix)
        module = new[target]
        routes[prefix] = (module.head if isinstance(module, QuantEmbedding) else module, shard)
    return routes


def _tp_slicers(model: nn.Module, plan: dict[str, str]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """{HF module path: cut one of its full float tensors (weight or bias) to this rank's part}
    for every planned module of a tensor-parallel model, read off the float layers' layouts
    before they are swapped: tensors are sharded first, then quantized, so each rank's
    scales are its own rows' (int8 per row) or groups' (int4, within its columns)."""
    slicers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for prefix in plan:
        target, shard = _target(model, prefix)
        module = model.get_submodule(target)
        if isinstance(module, VocabParallelEmbedding):
            slicers[prefix] = partial(_vocab_rows, start=module.vocab_start, rows=module.num_local)
        elif isinstance(module, ParallelLMHead):
            slicers[prefix] = partial(_vocab_rows, start=module.ctx.tp.rank * module.out_features,
                                      rows=module.out_features)
        elif isinstance(module, Linear):
            slicers[prefix] = partial(module.local_slice, shard=shard)
    return slicers


Cut = Callable[[str, torch.Tensor], torch.Tensor]


def _tp_stored_slicers(model: nn.Module, plan: dict[str, str]) -> dict[str, Cut]:
    """{HF module path: cut(tensor name, tensor)}: this rank's part of a stored quantized module,
    cut from its canonical tensors (quant/formats.py: one row per output feature, the input
    dim packed or grouped along dim 1) by the float layer's layout, read before the swap.
    Column-parallel: rows, as the float weight's. Row-parallel: the columns of this rank's
    input slice; per-row int8 scales stay whole (a row's scale applies to each rank's
    partial sum alike), and the bias stays whole (added once, after the reduce)."""
    slicers: dict[str, Cut] = {}
    for prefix in plan:
        target, shard = _target(model, prefix)
        module = model.get_submodule(target)
        if isinstance(module, VocabParallelEmbedding):
            slicers[prefix] = lambda name, t, m=module: _vocab_rows(t, m.vocab_start, m.num_local)
        elif isinstance(module, ParallelLMHead):
            rows, start = module.out_features, module.ctx.tp.rank * module.out_features
            slicers[prefix] = lambda name, t, s=start, r=rows: _vocab_rows(t, s, r)
        elif isinstance(module, Linear):
            slicers[prefix] = partial(_stored_local, module, shard, prefix)
    return slicers


def _stored_local(module: Linear, shard: str | None, prefix: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if name == "perm":  # act-order: a permutation of the whole input
        if module.parallel == "row" and module.ctx.tp.size > 1:
            raise ConfigError(f"model.quantization: {prefix} is stored with act-order (desc_act) and is "
                              "row-parallel: its input groups cannot be cut per rank; use a checkpoint without "
                              "desc_act, or tensor_parallel_size=1")
        return t
    if module.parallel != "row":
        return module.local_slice(t, shard).contiguous()
    if name == "bias" or t.dim() < 2:
        return t
    full, local = module.full_in_features, module.in_features
    if (t.shape[1] * local) % full:
        raise ConfigError(f"model.quantization: {prefix}'s {name} ({t.shape[1]} columns for {full} inputs) cannot "
                          f"be cut into {module.ctx.tp.size} slices of {local} inputs: its quantization groups "
                          "straddle the ranks' boundaries; use a smaller tensor_parallel_size")
    width = t.shape[1] * local // full
    return t.narrow(1, module.ctx.tp.rank * width, width).contiguous()


def _vocab_rows(tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    vocab_shard(tensor, out, start)
    return out


def _shard_stream(weights: Iterable[tuple[str, torch.Tensor]],
                  slicers: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        cut = slicers.get(prefix) if suffix in ("weight", "bias") else None
        yield name, (tensor if cut is None else cut(tensor).contiguous())


def _layer_key(path: str) -> str:
    """`model.layers.3.mlp.experts` -> `model.layers.3`: experts are matched to checkpoint names by
    their decoder layer, whatever the MoE block is called (block_sparse_moe / mlp)."""
    m = re.match(r"^(.*\.layers\.\d+)\.", path)
    return m.group(1) if m else path


def _swap_experts(model: nn.Module, method: QuantMethod, device: torch.device) -> dict[str, QuantFusedMoE]:
    """Replace every FusedMoE by a QuantFusedMoE of the method's linear scheme; returns them
    by decoder layer (see _layer_key). The router gates stay float Linears."""
    new: dict[str, QuantFusedMoE] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, FusedMoE):
            quantized = QuantFusedMoE.like(method.linear_scheme(), module, method.quantize_linear, device)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, quantized)
            if _layer_key(name) in new:
                raise ValueError(f"{_layer_key(name)} has more than one FusedMoE; quantized loading expects one")
            new[_layer_key(name)] = quantized
    if new:
        fast_paths_changed()  # the model's layers are no longer the float ones its fast paths gathered
    return new


def _route_experts(weights: Iterable[tuple[str, torch.Tensor]],
                   experts: dict[str, QuantFusedMoE]) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantize expert tensors into their QuantFusedMoE as they stream by; yield the rest."""
    for name, tensor in weights:
        hit = expert_tensor(name) if experts else None
        module = experts.get(_layer_key(hit[0])) if hit else None
        if module is None:
            yield name, tensor
        else:
            module.weight_loader(None, tensor, hit[1], hit[2])


def load_quantized_model(path: Path, cfg, dtype: torch.dtype, device: torch.device, max_positions: int,
                         quantization: str | None = None, group_size: int | None = None,
                         kernels: KernelConfig | None = None, tp: TPGroup | None = None,
                         pp: PipelineStage | None = None):
    """Like models.loader.load_float_model, for quantized checkpoints or `--quantization`."""
    qc = read_quantization_config(path)
    pp = pp or PipelineStage()
    tied = cfg.tie_word_embeddings and pp.first  # a later pipeline stage holds neither
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions, op_context(device, dtype, kernels, tp, pp))
    weights: Iterable[tuple[str, torch.Tensor]] = stage_weights(model, iter_safetensors(path))
    if qc is not None or quantization == gguf_weights.METHOD:
        if any(isinstance(m, FusedMoE) for m in model.modules()):
            raise ConfigError("model.quantization: quantized MoE checkpoints (GPTQ / AWQ / kvmesh / GGUF) are not "
                              "supported yet; load the float checkpoint with quantization int8 or int4")
    experts: dict[str, QuantFusedMoE] = {}
    if qc is not None:
        if quantization is not None:
            raise ConfigError(f"model.quantization: {path} is already quantized "
                              f"({qc.get('quant_method')}); drop --quantization")
        fmt = format_from_config(qc)
        plan = _plan_from_keys(_safetensors_keys(path), fmt)
    elif quantization == gguf_weights.METHOD:
        _check_gguf_args(group_size)
        fmt = KVMeshFormat()
        plan, weights = gguf_weights.read_gguf(gguf_weights.find_gguf(path), cfg)
        weights = stage_weights(model, weights)
    else:
        method = get_method(quantization, group_size)
        fmt = KVMeshFormat()
        plan = _plan_from_method(model, method, tied)
        if tp is not None and tp.size > 1:
            weights = _shard_stream(weights, _tp_slicers(model, plan))
        experts = _swap_experts(model, method, device)  # (experts cut their own shards: layers/moe.py shard_sources)
        weights = method.quantize_state_dict(_route_experts(weights, experts), tied)
    # A pipeline stage quantizes / loads its own modules only (stored formats keep whole modules).
    plan = {prefix: scheme for prefix, scheme in plan.items() if model.holds(f"{prefix}.weight")}
    # Stored formats at TP > 1: each rank cuts its part of every module's converted tensors.
    stored_cuts = (_tp_stored_slicers(model, plan) if tp is not None and tp.size > 1
                   and (qc is not None or quantization == gguf_weights.METHOD) else {})
    routes = _swap(model, plan, tied, device, kernels or KernelConfig())
    model = model.to_empty(device=device)
    if tied and isinstance(model.lm_head, Linear):
        model.lm_head.weight = model.model.embed_tokens.weight

    pending: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    biases: dict[str, torch.Tensor] = {}

    def float_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(".")
            if prefix in routes and suffix in fmt.suffixes:
                pending[prefix][suffix] = tensor
            elif prefix in routes and suffix == "bias":
                biases[prefix] = tensor
            else:
                yield name, tensor

    model.load_weights(float_tensors())
    for prefix, (module, shard) in routes.items():
        if prefix not in pending:
            raise ValueError(f"checkpoint: no quantized tensors for {prefix}")
        tensors = fmt.convert(prefix, pending.pop(prefix))
        cut = stored_cuts.get(prefix)
        if cut is not None:
            tensors = {name: cut(name, t) for name, t in tensors.items()}
        module.load(tensors, shard)
    for prefix, bias in biases.items():
        module, shard = routes[prefix]
        cut = stored_cuts.get(prefix)
        module.load_bias(bias if cut is None else cut("bias", bias), shard)

    for param in model.parameters():
        param.data = param.data.to(dtype)
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding, QuantFusedMoE)):
            module.finalize(dtype)
    model.init_rotary(device)
    model.eval()
    return model, cfg


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all weights (parameters and quantized buffers), each shared tensor once."""
    persistent = model.state_dict(keep_vars=True)
    # non-persistent buffers (the RoPE tables) are not weights
    seen = {b.data_ptr() for name, b in model.named_buffers() if name not in persistent}
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen or not (t.is_floating_point() or t.dtype in (torch.int8, torch.uint8)):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


__all__ = ["LINEAR_NAMES", "load_quantized_model", "quantization_id", "read_quantization_config", "weight_bytes"]
