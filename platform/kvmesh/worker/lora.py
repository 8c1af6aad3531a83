"""The worker's LoRA adapters: PEFT folders read into host memory, and device slots.

`LoRAManager` is the engine's `LoRAHost` (engine/lora.py). Adapters live at two levels:

- host memory: an LRU of up to `LoRAConfig.cpu_capacity` adapters read from disk (`read`
  runs off the step loop; `add` holds the result). An adapter with requests waiting or
  running is never evicted.
- device slots: `max_loras` adapters resident in every adapted layer's `LoRASlots`
  (layers/lora.py). `prepare` (on the step thread, before a step's forward) gives each
  adapter of the step a slot, refilling the least recently used other one if needed: the
  scheduler never batches more than `max_loras` distinct adapters.

Checkpoints are what `peft` writes: `adapter_config.json` (peft_type LORA, r, lora_alpha,
use_rslora, rank_pattern / alpha_pattern) and `adapter_model.safetensors` (or `.bin`) with
`base_model.model.<module>.lora_A.weight` (r, in) / `lora_B.weight` (out, r) per adapted
module. q/k/v and gate/up adapters land in their shard of the fused projection. The
attention and MLP projections are served; adapters of embeddings, the LM head or MoE
experts, DoRA, LoRA biases and `modules_to_save` are refused by name.

Tensor / pipeline parallel ranks (worker/parallel.py ParallelLoRA): `read` checks an adapter
against `template`, the whole model built on the meta device, so rank 0 refuses a bad
adapter for every stage before any rank holds it; `add` keeps this rank's part: the
adapters of its stage's layers, cut as the layer's weight is (layers/linear.py
`local_slice`): lora_B's rows for a column-parallel layer (each rank's heads / MLP columns;
replicated KV heads take their replica's rows), lora_A's columns for a row-parallel one
(each rank's partial x_r A_r^T B^T is summed by the layer's all-reduce, with the base
partials). Every rank then holds, evicts and slots the same adapters in the same order:
rank 0 decides evictions (`plan_add`) and the others follow, and slots are chosen by a
step counter and adapter name, never by time or set order, so every rank lays a step's
rows out alike.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from kvmesh.config import LoRAConfig
from kvmesh.engine.lora import LoRAInfo
from kvmesh.errors import InvalidRequestError
from kvmesh.layers import native
from kvmesh.layers.lora import LoRASlots
from kvmesh.layers.triton_runtime import can_run as triton_can_run

logger = logging.getLogger(__name__)

# The projections an adapter may adapt (checkpoint names, before q/k/v and gate/up fuse).
SERVED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass
class LoadedAdapter:
    """An adapter read from disk: per kvmesh module, (shard index | None, A, scaled B), the
    whole model's tensors (`LoRAManager.add` keeps a rank's part)."""

    path: str
    rank: int
    key: str
    parts: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]]
    nbytes: int = 0

    def to_bytes(self) -> bytes:
        """The adapter as one safetensors blob (to send to other ranks, any transport)."""
        from safetensors.torch import save

        tensors, layout = {}, []
        for target, pairs in self.parts.items():
            for i, (shard, a, b) in enumerate(pairs):
                tensors[f"{target}/{i}/A"], tensors[f"{target}/{i}/B"] = a.contiguous(), b.contiguous()
                layout.append([target, i, shard])
        meta = {"path": self.path, "rank": str(self.rank), "key": self.key, "layout": json.dumps(layout)}
        return save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, blob: bytes) -> "LoadedAdapter":
        from safetensors.torch import load

        tensors = load(blob)
        # the metadata sits in the blob's JSON header (safetensors: an 8-byte length, then JSON)
        meta = json.loads(blob[8: 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
        parts: dict[str, list] = {}
        for target, i, shard in json.loads(meta["layout"]):
            parts.setdefault(target, []).append((shard, tensors[f"{target}/{i}/A"], tensors[f"{target}/{i}/B"]))
        return cls(meta["path"], int(meta["rank"]), meta["key"], parts, _nbytes(parts))


def _nbytes(parts: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]]) -> int:
    return sum(t.numel() * t.element_size() for pairs in parts.values() for _, a, b in pairs for t in (a, b))


@dataclass
class _Held:
    name: str
    adapter: LoadedAdapter
    slot: int | None = None


def _shards(module: nn.Module) -> dict[str, tuple[int, int]]:
    """A fused layer's {shard: (output start, size)}; {"": (0, N)} for a plain one."""
    shards = getattr(module, "offsets", None) or getattr(module, "shards", None)
    return dict(shards) if shards else {"": (0, module.out_features)}


def _served(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in SERVED_MODULES and hasattr(m, "set_delta")}


def _full_out(layer: nn.Module, shard: str | None) -> int:
    """The whole model's output rows of `layer` (of one shard of a fused layer)."""
    if shard is None:
        return getattr(layer, "full_out_features", layer.out_features)
    sizes = getattr(layer, "full_sizes", None) or {k: size for k, (_, size) in _shards(layer).items()}
    return sizes[shard]


def _local_pair(layer: nn.Module, shard: str | None, a: torch.Tensor, b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of a whole-model pair, cut as the layer's weight is (see the module docstring)."""
    parallel = getattr(layer, "parallel", "replicated")
    if parallel == "row":
        return layer.local_slice(a).contiguous(), b
    if parallel == "column":
        return a, layer.local_slice(b, shard).contiguous()
    return a, b


def _sgmv_backend(module: nn.Module, device: torch.device) -> str:
    """The SGMV kernels a layer's slots run (layers/lora_kernels.py): the native CPU op where
    the layer's own context runs kvmesh's kernels, Triton on CUDA, else PyTorch."""
    if device.type == "cpu":
        ctx = getattr(module, "ctx", None)
        on = ctx.native if ctx is not None else getattr(module, "native_gemm", False) and native.load()
        return "cpu" if on and native.loaded() else "torch"
    return "triton" if triton_can_run(device) else "torch"


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """peft's rank_pattern / alpha_pattern lookup: the first key matching the module path's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class LoRAManager:
    """See the module docstring. Construct once per model (it installs no deltas until an
    adapter adapting a layer is first loaded)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype,
                 template: nn.Module | None = None):
        """`template`: the whole model (meta tensors will do) to check adapters against, for a
        rank of a parallel group whose `model` holds a shard or a stage of it."""
        if getattr(model, "cfg", None) is not None and getattr(model.cfg, "moe_layers", None):
            logger.info("LoRA on a MoE model: attention projections only (expert adapters are refused)")
        self.model = model
        self.config = config
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.capacity = config.cpu_capacity
        self.device, self.dtype = device, dtype
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._slot_owner: list[str | None] = [None] * self.max_loras
        self._slot_used: list[int] = [0] * self.max_loras
        self._tick = 0  # prepare() calls: slots' use order (the same on every rank)
        self._layers: dict[str, LoRASlots] = {}
        self._modules = _served(model)
        self._whole = self._modules if template is None else _served(template)
        self.loads = 0  # slot fills (an adapter copied to the device), for stats and tests

    # -- reading (any thread) -------------------------------------------------

    def read(self, name: str, path: str) -> LoadedAdapter:
        folder = Path(path)
        if not (folder / "adapter_config.json").is_file():
            raise InvalidRequestError("lora_path", f"{path!r} is not a PEFT adapter folder (no adapter_config.json)")
        raw_config = (folder / "adapter_config.json").read_bytes()
        try:
            cfg = json.loads(raw_config)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("lora_path", f"{path}/adapter_config.json is not JSON: {exc}") from None
        self._check_config(cfg, path)
        tensors = self._read_tensors(folder)
        digest = hashlib.sha256(raw_config)
        for key in sorted(tensors):
            t = tensors[key]
            digest.update(key.encode())
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16
                          else t.float().numpy().tobytes())
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise InvalidRequestError("lora_path", f"{path}: tensor {key!r} is not a LoRA A/B weight "
                                          "(embedding adapters, LoRA biases and modules_to_save are not served)")
            pairs.setdefault(m["module"], {})[m["ab"]] = t
        if not pairs:
            raise InvalidRequestError("lora_path", f"{path}: the adapter has no LoRA weights")
        r_default = int(cfg.get("r", 8))
        alpha_default = float(cfg.get("lora_alpha", r_default))
        parts: dict[str, list] = {}
        rank, nbytes = 0, 0
        for module, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise InvalidRequestError("lora_path", f"{path}: {module} has lora_{''.join(ab)} but not both A and B")
            a, b = ab["A"], ab["B"]
            r = a.shape[0]
            if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
                raise InvalidRequestError("lora_path", f"{path}: {module}: lora_A {tuple(a.shape)} and lora_B "
                                          f"{tuple(b.shape)} are not a rank-r pair")
            if r > self.max_rank:
                raise InvalidRequestError("lora_path", f"{path}: {module} has rank {r}, above this server's "
                                          f"max_lora_rank={self.max_rank}; restart it with --max-lora-rank {r}")
            alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, alpha_default)
            scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            target, shard = self._target(module, path)
            layer = self._whole[target]
            inputs = getattr(layer, "full_in_features", layer.in_features)
            if a.shape[1] != inputs:
                raise InvalidRequestError("lora_path", f"{path}: {module}.lora_A has {a.shape[1]} inputs; this "
                                          f"model's layer has {inputs}: the adapter is for another base")
            index = None if shard is None else list(_shards(layer)).index(shard)
            want = _full_out(layer, shard)
            if b.shape[0] != want:
                raise InvalidRequestError("lora_path", f"{path}: {module}.lora_B has {b.shape[0]} outputs; this "
                                          f"model's layer has {want}: the adapter is for another base")
            a_t = a.to(self.dtype).contiguous()
            b_t = (b.float() * scale).to(self.dtype).contiguous()
            parts.setdefault(target, []).append((index, a_t, b_t))
            rank = max(rank, r)
            nbytes += a_t.numel() * a_t.element_size() + b_t.numel() * b_t.element_size()
        return LoadedAdapter(str(path), rank, digest.hexdigest()[:16], parts, nbytes)

    def _check_config(self, cfg: dict, path: str) -> None:
        def bad(what: str) -> InvalidRequestError:
            return InvalidRequestError("lora_path", f"{path}: {what}")

        if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
            raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("use_dora"):
            raise bad("DoRA adapters (use_dora) are not served; merge the adapter or train plain LoRA")
        if cfg.get("bias", "none") not in ("none", None):
            raise bad(f"bias={cfg['bias']!r}: LoRA biases are not served; train with bias='none'")
        if cfg.get("modules_to_save"):
            raise bad(f"modules_to_save={cfg['modules_to_save']}: full-module copies are not served")
        if cfg.get("layers_to_transform") is not None and cfg.get("layers_pattern") not in (None, "layers", ["layers"]):
            raise bad("layers_pattern other than 'layers' is not served")

    def _read_tensors(self, folder: Path) -> dict[str, torch.Tensor]:
        st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
        try:
            if st.is_file():
                from safetensors.torch import load_file

                return load_file(str(st))
            if binary.is_file():
                return torch.load(str(binary), map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: say which
            raise InvalidRequestError("lora_path", f"{folder}: cannot read the adapter weights: {exc}") from None
        raise InvalidRequestError("lora_path", f"{folder} has no adapter_model.safetensors (or adapter_model.bin)")

    def _target(self, module: str, path: str) -> tuple[str, str | None]:
        """A peft module path -> (this model's module path, shard of a fused layer | None)."""
        name = module
        for old, new in getattr(self.model, "renamed_modules", {}).items():
            name = name.replace(old, new)
        leaf = name.rsplit(".", 1)[-1]
        if ".experts." in name or leaf not in SERVED_MODULES:
            raise InvalidRequestError("lora_path", f"{path}: it adapts {module!r}; served are the attention and "
                                      f"MLP projections ({', '.join(SERVED_MODULES[:7])}), not embeddings, the "
                                      "LM head or MoE experts")
        shard = None
        packed = getattr(self.model, "packed_modules", {})
        if leaf in packed:
            fused, shard = packed[leaf]
            name = name[: -len(leaf)] + fused
        if name not in self._whole:
            raise InvalidRequestError("lora_path", f"{path}: it adapts {module!r}, which this model does not have "
                                      "(an adapter of another architecture, or of MoE expert layers)")
        return name, shard

    # -- host memory (step thread) --------------------------------------------

    def plan_add(self, name: str, busy: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """The adapters `add` evicts to hold `name`: the least recently used ones not in
        `busy`, while host memory is full. InvalidRequestError if every one is busy."""
        held = [n for n in self._held if n != name]
        over = len(held) + 1 - self.capacity
        victims = [n for n in held if n not in busy][: max(0, over)]
        if len(victims) < over:
            raise InvalidRequestError("lora", f"host memory holds max_cpu_loras={self.capacity} adapters, all "
                                      "with requests in flight; retry later or raise --max-cpu-loras")
        return victims

    def add(self, name: str, path: str, loaded: LoadedAdapter, busy: frozenset[str] | set[str] = frozenset(),
            evict: list[str] | None = None) -> LoRAInfo:
        """Hold `loaded` (this rank's part of it) under `name`, replacing an idle adapter of
        that name and evicting `evict` (default: `plan_add`'s choice)."""
        victims = self.plan_add(name, busy) if evict is None else evict
        if name in self._held:
            self._drop(name)
        for victim in victims:
            logger.info("LoRA: evicting adapter %r from host memory (LRU)", victim)
            self._drop(victim)
        self._held[name] = _Held(name, self._local(loaded))
        return self._info(self._held[name])

    def _local(self, loaded: LoadedAdapter) -> LoadedAdapter:
        """This rank's part of a whole-model adapter: its stage's layers, its slices of them
        (on one rank: the adapter as it is)."""
        parts: dict[str, list] = {}
        for target, pairs in loaded.parts.items():
            layer = self._modules.get(target)
            if layer is None:
                continue  # another pipeline stage's layer
            names = list(_shards(layer))
            parts[target] = [(i, *_local_pair(layer, None if i is None else names[i], a, b)) for i, a, b in pairs]
        return replace(loaded, parts=parts, nbytes=_nbytes(parts))

    def remove(self, name: str) -> bool:
        if name not in self._held:
            return False
        self._drop(name)
        return True

    def _drop(self, name: str) -> None:
        held = self._held.pop(name)
        if held.slot is not None:
            for layer in self._layers.values():
                layer.clear(held.slot)
            self._slot_owner[held.slot] = None

    def get(self, name: str) -> LoRAInfo | None:
        held = self._held.get(name)
        return None if held is None else self._info(held)

    def adapters(self) -> list[LoRAInfo]:
        return [self._info(h) for h in self._held.values()]

    def _info(self, held: _Held) -> LoRAInfo:
        a = held.adapter
        return LoRAInfo(held.name, a.path, a.rank, a.key, loaded=True, resident=held.slot is not None)

    def touch(self, name: str) -> None:
        """Mark an adapter used (host LRU order)."""
        if name in self._held:
            self._held.move_to_end(name)

    # -- device slots (step thread) -------------------------------------------

    def prepare(self, names: set[str] | list[str]) -> dict[str, int]:
        """Slots for this step's adapters (at most max_loras, which the scheduler keeps),
        filling the ones not resident into the least recently used other slots."""
        names = set(names)
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step batches {len(names)} adapters, more than max_loras={self.max_loras}")
        self._tick += 1
        now = self._tick
        slots: dict[str, int] = {}
        # (by name, not set order: the ranks of a parallel group must choose the same slots)
        for name in sorted(names, key=lambda n: (n not in self._held or self._held[n].slot is None, n)):
            held = self._held.get(name)
            if held is None:
                raise RuntimeError(f"adapter {name!r} is not in host memory")
            if held.slot is None:
                free = [s for s in range(self.max_loras) if self._slot_owner[s] not in names]
                slot = min(free, key=lambda s: (self._slot_owner[s] is not None, self._slot_used[s]))
                self._fill(slot, held)
            slots[name] = held.slot
            self._slot_used[held.slot] = now
            self._held.move_to_end(name)
        return slots

    def _fill(self, slot: int, held: _Held) -> None:
        owner = self._slot_owner[slot]
        if owner is not None and owner in self._held:
            self._held[owner].slot = None
        for target in held.adapter.parts:
            if target not in self._layers:
                self._install(target)
        for target, layer in self._layers.items():
            parts = held.adapter.parts.get(target)
            if parts:
                layer.fill(slot, parts)
            else:
                layer.clear(slot)
        self._slot_owner[slot] = held.name
        held.slot = slot
        self.loads += 1

    @torch.inference_mode()
    def _install(self, target: str) -> None:
        module = self._modules[target]
        slots = LoRASlots(module.in_features, list(_shards(module).values()), self.max_loras, self.max_rank,
                          self.dtype, self.device, _sgmv_backend(module, self.device))
        module.set_delta(slots)
        self._layers[target] = slots

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._layers.values() for t in (s.a, s.b))
