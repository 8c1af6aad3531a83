"""Runs one scheduled step: flat batch in, sampled tokens out.

All scheduled tokens of all sequences are packed into one (T,) batch with no padding;
each token's K/V is written to its slot in the paged cache, attention reads each
sequence's blocks through its block table, and logits are computed only for the last
token of sequences that sample this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.config import KernelConfig
from kvmesh.engine.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from kvmesh.layers import kv_cache as kvq
from kvmesh.layers.attention import SeqSpan, get_attention_backend
from kvmesh.layers.linear import prepack_linears
from kvmesh.layers.lora import LoRABatch, lora_batch
from kvmesh.models.arch import ArchConfig
from kvmesh.worker.cuda_graphs import DecodeGraphs, GraphRecorder
from kvmesh.worker.host_memory import keep_freed_memory
from kvmesh.worker.kv_memory import populate, populate_in_background, zeroed_tensor
from kvmesh.worker.lora import LoRAManager
from kvmesh.worker.pipeline import PipelineForward
from kvmesh.worker.prompt_logprobs import compute_prompt_logprobs
from kvmesh.worker.sampler import ban_tokens, sample
from kvmesh.worker.spec_decode import verify
from kvmesh.worker.structured import GrammarMasks

# EngineConfig.model.dtype -> torch dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
logger = logging.getLogger(__name__)


@dataclass
class KVCacheSpec:
    """The KV cache's geometry and storage. `dtype` is the model's; `quant` names an 8-bit
    cache ("int8", "fp8_e4m3": layers/kv_cache.py), None stores K/V in `dtype`.

    Blocks leave the cache (`read_blocks`: the KV store, P/D transfer) as one tensor of
    (num_layers, 2, n, *block_shape) in `wire_dtype`, split and joined along the block axis:
    for a float cache (num_layers, 2, n, block_size, kv_heads, head_dim) in `dtype`; for an
    8-bit one, bytes: per (layer, K or V, block) its block_size x kv_heads x head_dim values,
    then their block_size x kv_heads float32 scales."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    quant: str | None = None

    @property
    def kv_dtype_name(self) -> str:
        """What the cache stores, as the wire layout and the store codec name it."""
        return self.quant or DTYPE_NAMES[self.dtype]

    @property
    def storage_dtype(self) -> torch.dtype:
        return kvq.QUANTIZED[self.quant][0] if self.quant else self.dtype

    @property
    def bytes_per_block(self) -> int:
        per_token = kvq.bytes_per_token(self.num_kv_heads, self.head_dim, self.dtype, self.quant)
        return self.num_layers * self.block_size * per_token

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quant else self.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.quant:
            return (self.block_size * self.num_kv_heads * (self.head_dim + kvq.SCALE_BYTES),)
        return (self.block_size, self.num_kv_heads, self.head_dim)


class ModelRunner:
    def __init__(self, model, arch: ArchConfig, block_size: int, num_blocks: int,
                 device: torch.device, seed: int = 0, attention_backend: str = "auto",
                 cuda_graph_max_batch: int = 0, max_model_len: int = 0, graph_recorder: GraphRecorder | None = None,
                 kernels: KernelConfig | None = None, grammar: GrammarMasks | None = None,
                 lora: LoRAManager | None = None, kv_quant: str | None = None, num_kv_heads: int | None = None,
                 driver: bool = True, pipeline: PipelineForward | None = None, num_layers: int | None = None,
                 kv_populate: str = "background"):
        """`cuda_graph_max_batch` > 0 captures decode graphs up to that batch (CUDA, or any
        device with a `graph_recorder`, for tests); `max_model_len` bounds their contexts.
        `grammar` masks the logits of requests with structured outputs (worker/structured.py);
        None ignores their specs (a draft model's runner: its drafts are checked by the target).
        `lora`: the adapters of a multi-LoRA engine (worker/lora.py); rows of a step run under
        their request's adapter (layers/lora.py). `kv_quant`: an 8-bit KV cache ("int8",
        "fp8_e4m3"; layers/kv_cache.py), None: K/V in the model's dtype.

        Tensor parallel (worker/parallel.py): `num_kv_heads` is this rank's share of the KV
        heads (default: all of the model's); a rank that is not the `driver` runs every step's
        forward and logits (their collectives must match the driver's call for call) but
        samples nothing: the driver samples once, on the gathered full logits.

        Pipeline parallel (worker/pipeline.py): `pipeline` runs each step's forward through the
        stages micro-batch by micro-batch; this stage's cache holds `num_layers` layers (its own).
        A stage other than the driver (stage 0) stops after its part of the forward."""
        self.model = model
        if device.type == "cpu" and (kernels is None or kernels.keep_host_memory):
            keep_freed_memory()  # activations stay mapped between steps (worker/host_memory.py)
        prepack_linears(model)  # oneDNN's weight layout now, not on the first long prompt
        self.arch = arch
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.driver, self.pipeline = driver, pipeline
        self.spec = KVCacheSpec(num_layers or arch.num_layers, block_size, num_kv_heads or arch.num_kv_heads,
                                arch.head_dim, self.dtype, kv_quant)
        self.kv_caches = self._allocate_kv(num_blocks, device)
        self.kv_populate = None  # the background populate thread, if any
        if device.type == "cpu":
            kv_tensors = [t for kv in self.kv_caches for t in kv]
            if kv_populate == "startup":
                populate(kv_tensors)
            else:
                self.kv_populate = populate_in_background(kv_tensors)
        self.backend = get_attention_backend(attention_backend, block_size, device, kernels)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._req_generators: dict[str, torch.Generator] = {}
        self.grammar = grammar
        self.lora = lora
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch and (device.type == "cuda" or graph_recorder is not None):
            self._capture_graphs(cuda_graph_max_batch, max_model_len, graph_recorder)

    def _allocate_kv(self, num_blocks: int, device: torch.device) -> list:
        """One (K, V) pair per layer, or one QuantizedKV for an 8-bit cache. Zero-filled so
        padded reads of the null block are finite (they are masked, but NaN * 0 would still
        poison the output); a zero scale dequantizes to zero. Zero pages mapped in the
        background, not written up front (worker/kv_memory.py)."""
        spec = self.spec
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

        def pair():
            return (zeroed_tensor(shape, spec.storage_dtype, device), zeroed_tensor(shape, spec.storage_dtype, device))

        if spec.quant is None:
            return [pair() for _ in range(spec.num_layers)]
        return [kvq.QuantizedKV(*pair(), zeroed_tensor(shape[:3], torch.float32, device),
                                zeroed_tensor(shape[:3], torch.float32, device)) for _ in range(spec.num_layers)]

    @torch.inference_mode()
    def _capture_graphs(self, max_batch: int, max_model_len: int, recorder: GraphRecorder | None) -> None:
        if not getattr(self.backend, "supports_cuda_graphs", False):
            logger.warning("CUDA graphs need the triton attention backend; %s runs every step eagerly",
                           type(self.backend).__name__)
            return
        self.graphs = DecodeGraphs(lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta, self.backend),
                                   self.backend, max_batch, max_model_len, self.block_size, self.device, recorder)
        seconds = self.graphs.capture()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.2f s", self.graphs.sizes, seconds)

    def _generator_for(self, seq: ScheduledSeq) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None or seq.sampling_params.greedy:
            return None
        g = self._req_generators.get(seq.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self._req_generators[seq.request_id] = g
        return g

    def forget(self, request_id: str) -> None:
        self._req_generators.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.forget(request_id)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, return_logits: bool = False, return_probs: bool = False,
                draft_probs: dict[str, torch.Tensor | None] | None = None) -> ModelRunnerOutput:
        """Run the step. `return_logits` (tests, debugging) fills the output's `logits`
        with {request_id: (V,) float32 tensor}; `return_probs` fills `probs` with the
        distributions sampling rows were drawn from (draft models). Sequences with
        spec_token_ids are verified (see spec_decode.verify) with `draft_probs`."""
        for rid in sched.finished_req_ids:
            self.forget(rid)
        if sched.is_empty:
            return ModelRunnerOutput({}, logits={} if return_logits else None)
        # Decodes first: the backend batches them as one attention call; within each kind,
        # the rows of one LoRA adapter side by side (one segment per adapter).
        slots = self._lora_slots(sched)
        if slots:
            seqs = sorted(sched.seqs, key=lambda s: (s.num_tokens != 1, slots.get(s.lora_name, -1)))
            batch = LoRABatch.from_rows([(s.num_tokens, slots.get(s.lora_name, -1)) for s in seqs])
        else:
            seqs = sorted(sched.seqs, key=lambda s: s.num_tokens != 1)
            batch = None
        num_decodes = sum(1 for s in seqs if s.num_tokens == 1)
        spans, ids, pos = [], [], []
        q_start = 0
        for s in seqs:
            spans.append(SeqSpan(q_start, s.num_tokens, s.start_pos, s.block_ids))
            ids.extend(s.token_ids)
            pos.append(np.arange(s.start_pos, s.start_pos + s.num_tokens))
            q_start += s.num_tokens
        sampling = [(i, s) for i, s in enumerate(seqs) if s.sample and not s.spec_token_ids]
        speculating = [(i, s) for i, s in enumerate(seqs) if s.sample and s.spec_token_ids]
        # The grammar masks are filled on their own thread while the forward pass runs.
        masks = None if self.grammar is None else self.grammar.start([s for _, s in speculating],
                                                                     [s for _, s in sampling])
        if batch is None and self.graphs is not None and self.graphs.can_run(spans, num_decodes):
            hidden = self.graphs.run(spans, ids)  # graphs hold the base model: no adapter rows
        elif self.pipeline is not None:
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.from_numpy(np.concatenate(pos)).to(self.device)
            hidden = self.pipeline(self.model, spans, num_decodes, input_ids, positions, self.kv_caches, self.backend,
                                   batch)
            if hidden is None:  # a later stage: its layers ran; stage 0 computes logits and samples
                return ModelRunnerOutput({}, logits={} if return_logits else None)
        else:
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.from_numpy(np.concatenate(pos)).to(self.device)
            meta = self.backend.build_metadata(spans, num_decodes)
            with lora_batch(batch):
                hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        out = ModelRunnerOutput({}, logits={} if return_logits else None)
        if any(s.sampling_params.prompt_logprobs is not None for s in seqs):
            out.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, spans, seqs)
        if speculating:
            # logits at the last k + 1 positions: they predict draft_1..draft_k and the bonus
            idx = torch.cat([torch.arange(spans[i].q_start + spans[i].q_len - len(s.spec_token_ids) - 1,
                                          spans[i].q_start + spans[i].q_len) for i, s in speculating])
            spec_logits = self.model.compute_logits(hidden[idx.to(self.device)])
            if not self.driver:
                speculating = []
            if masks is not None:
                masks.apply_spec(spec_logits)
            row = 0
            for _, s in speculating:
                k = len(s.spec_token_ids)
                q = (draft_probs or {}).get(s.request_id)
                out.sampled_token_ids[s.request_id] = verify(
                    spec_logits[row : row + k + 1], s.spec_token_ids, q, s.sampling_params, self._generator_for(s))
                row += k + 1
        if not sampling:
            return out
        last = torch.tensor([spans[i].q_start + spans[i].q_len - 1 for i, _ in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        if not self.driver:
            return out
        raw = logits.clone() if return_logits else None
        if masks is not None:
            masks.apply_sample(logits)
        rows = [s for _, s in sampling]
        if any(s.banned_token_ids for s in rows):
            ban_tokens(logits, [s.banned_token_ids for s in rows])
        tokens, logprobs, probs = sample(
            logits,
            [s.sampling_params for s in rows],
            [self._generator_for(s) for s in rows],
            self.generator,
            [(s.prompt_token_ids, s.output_token_ids) for s in rows],
            return_probs=return_probs,
        )
        out.sampled_token_ids.update({s.request_id: [t] for s, t in zip(rows, tokens)})
        out.logprobs = {s.request_id: lp for s, lp in zip(rows, logprobs) if lp is not None}
        if return_logits:
            out.logits = {s.request_id: raw[i] for i, s in enumerate(rows)}
        if return_probs and probs is not None:
            out.probs = {s.request_id: probs[i] for i, s in enumerate(rows) if not s.sampling_params.greedy}
        return out

    def _lora_slots(self, sched: SchedulerOutput) -> dict[str, int]:
        """{adapter: device slot} for this step's adapters (filled now if not resident)."""
        if self.lora is None:
            return {}
        names = {s.lora_name for s in sched.seqs if s.lora_name is not None}
        return self.lora.prepare(names) if names else {}

    # -- KV block I/O (prefix store, P/D transfer) --------------------------

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the KV of `block_ids`: (num_layers, 2, n, *spec.block_shape) in
        spec.wire_dtype (for a float cache (num_layers, 2, n, block_size, kv_heads, head_dim))."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        if self.spec.quant is None:
            return torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                                for k, v in self.kv_caches])
        n = len(block_ids)

        def packed(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # (n, block bytes)
            return torch.cat((values.index_select(0, idx).view(torch.uint8).view(n, -1),
                              scales.index_select(0, idx).view(torch.uint8).view(n, -1)), dim=1)

        return torch.stack([torch.stack((packed(kv.k, kv.k_scale), packed(kv.v, kv.v_scale)))
                            for kv in self.kv_caches])

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of read_blocks: data (num_layers, 2, n, *spec.block_shape)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        data = data.to(device=self.device, dtype=self.spec.wire_dtype)
        if self.spec.quant is None:
            for layer, (k, v) in enumerate(self.kv_caches):
                k.index_copy_(0, idx, data[layer, 0])
                v.index_copy_(0, idx, data[layer, 1])
            return
        spec, n = self.spec, len(block_ids)
        split = spec.block_size * spec.num_kv_heads * spec.head_dim  # value bytes, then the scales
        for layer, kv in enumerate(self.kv_caches):
            for side, values, scales in ((0, kv.k, kv.k_scale), (1, kv.v, kv.v_scale)):
                raw = data[layer, side]
                values.index_copy_(0, idx, raw[:, :split].contiguous().view(values.dtype).view(n, *values.shape[1:]))
                scales.index_copy_(0, idx, raw[:, split:].contiguous().view(torch.float32).view(n, *scales.shape[1:]))
