"""Typed engine configuration, shared by the CLI, the offline `LLM` API and (later) the
serving config and the LLMService CRD. Every field is documented and validated when
the object is built; errors say which field to change.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Base):
    model: str | None = Field(
        None,
        description="Local folder with config.json + *.safetensors (HF layout); a *.gguf file, or a folder "
        "holding one (llama / gemma3, converted once into the kvmesh cache); or a packaged model's name "
        "(`kvmesh models`: gemma-3-270m, google/gemma-3-270m). None serves the embedded "
        "SmolLM2-135M-Instruct. Nothing is downloaded.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder; defaults to the model folder.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype. auto: bfloat16 on CUDA, float32 elsewhere "
        "(float32 is exact against transformers)."
    )
    device: str = Field("cpu", description="torch device: 'cpu' or 'cuda' / 'cuda:N'.")
    max_model_len: int | None = Field(
        None, ge=2, description="Max prompt + output tokens per request; defaults to the model's limit."
    )
    seed: int = Field(0, description="Seed of the engine-wide generator used by unseeded requests.")
    quantization: Literal["int8", "int4", "gguf"] | None = Field(
        None,
        description="Quantize a float checkpoint's weights at load (kvmesh.quant): int8 per output "
        "channel or int4 per group (embedding / lm_head included). 'gguf' instead loads the GGUF the "
        "folder was converted from (the embedded model's Q4_1 file, or the one *.gguf beside "
        "config.json) with its Q4_0 / Q4_1 / Q8_0 tensors kept quantized as shipped. Checkpoints "
        "saved quantized (kvmesh quantize, GPTQ, AWQ) load quantized without it.",
    )
    quantization_group_size: int | None = Field(
        None, description="int4 group size: 32 (default), 64 or 128. Only with quantization=int4."
    )


class CacheConfig(_Base):
    block_size: int = Field(16, ge=1, le=512, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        None, ge=2, description="Number of KV blocks; overrides the memory-based sizing."
    )
    kv_cache_memory_gb: float = Field(
        2.0, gt=0, description="KV cache size in GiB when num_blocks is not set (CPU)."
    )
    kv_cache_populate: Literal["background", "startup"] = Field(
        "background",
        description="When the CPU KV cache's memory is mapped (worker/kv_memory.py). background: the worker "
        "is ready at once and a low-priority thread maps the pages (a busy worker maps the rest as its steps "
        "first write them, a few % of throughput until every block has been used once). startup: all of it "
        "before the engine is ready, as vLLM's zeroed cache (2 GiB: ~0.3-5 s, longest on a fresh VM). The "
        "offline LLM class defaults to startup.",
    )
    kv_cache_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="Fraction of free accelerator memory for KV (CUDA)."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1,
        description="vLLM's flag, mapped onto the KV budget. CUDA: the fraction of the memory free once the "
        "weights are loaded that the KV cache takes (it replaces kv_cache_memory_fraction; vLLM takes the "
        "fraction of the whole GPU and subtracts weights and activations, so the same number gives about the "
        "same cache and leaves the rest of the free memory to activations and CUDA graphs). CPU: a fraction of "
        "kv_cache_memory_gb (kvmesh never sizes a CPU cache from host memory, which weights, activations and "
        "other replicas share; set kv_cache_memory_gb for an absolute size). Unused with num_blocks.",
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="KV cache storage (vLLM's --kv-cache-dtype). auto: the model's dtype. int8: one byte per "
        "value plus a float32 scale per token and KV head, dequantized inside the attention kernels: "
        "~3.8x the tokens of a float32 cache (~1.9x of bfloat16) in the same memory, at a small cost in "
        "accuracy (layers/kv_cache.py). fp8 / fp8_e4m3: the same scheme in float8 e4m3, CUDA only (on "
        "CPU use int8).",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse cached full blocks across requests.")
    max_pinned_fraction: float = Field(
        0.5, ge=0, le=1,
        description="Pinned prompts (cache_prompt, prompt_cache) may hold at most this fraction of the usable "
        "KV blocks; a pin over it is refused at once with RESOURCE_EXHAUSTED. Pins always leave room for one "
        "max_model_len request, whatever the fraction.",
    )


class SchedulerConfig(_Base):
    max_num_seqs: int = Field(64, ge=1, description="Max requests running in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget per step; longer prompts are prefilled in chunks. 2048 is vLLM's "
        "default too: on a 2-vCPU Zen 4 at 2 req/s it gave served TTFT p50 -10% against 1024, TPOT -4%, the same "
        "throughput (benchmarks/results/serving_ab_zen4_budget2048.md)."
    )
    max_deferred_decode_steps: int = Field(
        0, ge=0,
        description="0 (default): every step carries all running decodes plus prompt chunks in the rest of the "
        "budget (vLLM's mixed steps). N > 0: prefill-first steps (SGLang's default): while prompts wait, a step "
        "runs prompt chunks only and the running decodes sit it out, for at most N steps in a row. A new "
        "request's first token pays for no decode rows (lower TTFT under load) and the streams pay one extra "
        "decode step per prompt (higher TPOT; on a 2-vCPU Zen 4 at 2 req/s, N=4 gave TTFT p50 -5..-10% for "
        "TPOT +12% and throughput -3%).",
    )
    step_timeout_s: float = Field(
        120.0, gt=0,
        description="Step watchdog: a serving engine whose step runs longer than this is reported unhealthy "
        "(gRPC health NOT_SERVING, Ray health check failing) so a supervisor replaces it.",
    )


class ParallelConfig(_Base):
    """How one engine's model is split over ranks (vLLM's names): tensor parallel shards every
    layer's weights over `tensor_parallel_size` ranks (an all-reduce per attention and MLP
    block), pipeline parallel splits the layers over `pipeline_parallel_size` stages. One
    engine (scheduler, block tables, prefix hashes) drives all ranks; the router sees one worker."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks each layer's weights are sharded over (column-parallel QKV / gate-up, "
        "row-parallel output / down, vocab-parallel embedding and LM head). 1: no sharding.",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline stages the decoder layers are split over. 1: no pipeline.",
    )
    distributed_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend between ranks: auto = nccl on CUDA, gloo on CPU.",
    )
    shm_all_reduce: bool = Field(
        True, description="CPU tensor parallel: sum the row-parallel outputs through a shared-memory segment "
        "between ranks on one machine (layers/shm_allreduce.py; microseconds where a gloo all-reduce over "
        "loopback takes ~1 ms), as vLLM's CPU backend. Ranks that cannot all map it (other machines, no /dev/shm) "
        "keep gloo; off: gloo always.",
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class SpeculativeConfig(_Base):
    """Speculative decoding: a proposer drafts tokens, the target verifies them losslessly."""

    method: Literal["ngram", "draft"] = Field(..., description="ngram (prompt lookup) or draft (a model).")
    model: str | None = Field(
        None, description="Draft checkpoint folder (same tokenizer as the target), or 'self' to "
        "draft with the target itself (every draft accepted: a correctness check).",
    )
    quantization: str | None = Field(None, description="Quantize the draft model at load (see quant).")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Draft tokens per step (k).")
    ngram_min: int = Field(1, ge=1, description="Shortest n-gram to match (ngram method).")
    ngram_max: int = Field(4, ge=1, description="Longest n-gram to match (ngram method).")
    max_batch_size: int = Field(
        8, ge=1,
        description="Speculate only while at most this many requests run: at larger batches the "
        "step is compute-bound and verifying drafts costs more than it saves.",
    )

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method == "draft" and not self.model:
            raise ValueError("speculative.model: the draft method needs a draft checkpoint folder (or 'self')")
        if self.ngram_min > self.ngram_max:
            raise ValueError("speculative.ngram_min must be <= ngram_max")
        return self


class LoRAModule(_Base):
    """One adapter served from start-up: `--lora-modules name=path`."""

    name: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$",
                      description="The OpenAI `model` name that selects the adapter.")
    path: str = Field(..., min_length=1, description="A PEFT adapter folder (adapter_config.json + "
                      "adapter_model.safetensors) the worker can read.")


class LoRAConfig(_Base):
    """Multi-LoRA serving: requests for different adapters of one base model share each step;
    deltas are applied per row segment (layers/lora.py). None on EngineConfig = LoRA off."""

    modules: list[LoRAModule] = Field(default_factory=list, description="Adapters known from start-up "
                                      "(loaded on first use, or at start-up on the workers).")
    max_loras: int = Field(4, ge=1, le=256, description="Adapters resident on the device at once: the "
                           "most distinct adapters one step can batch.")
    max_lora_rank: int = Field(16, ge=1, le=256, description="The largest adapter rank accepted; the "
                               "device slots are sized for it.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters kept in host memory (an LRU); "
                                      "None = max(max_loras, number of modules).")

    @model_validator(mode="after")
    def _check(self) -> "LoRAConfig":
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError("lora.modules: adapter names must be unique")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("lora.max_cpu_loras must be >= max_loras")
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.modules))


class PromptCacheEntry(_Base):
    """A prompt whose KV is computed at startup and pinned (see LLMEngine.cache_prompt)."""

    name: str = Field(..., min_length=1)
    text: str | None = Field(None, description="Prompt text (tokenized with the model's tokenizer).")
    token_ids: list[int] | None = Field(None, description="Or the prompt as token ids.")
    ttl_s: float | None = Field(None, gt=0, description="Unpin after this many seconds; None = until uncached.")

    @model_validator(mode="after")
    def _one_source(self) -> "PromptCacheEntry":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("prompt_cache entry: give exactly one of text or token_ids")
        return self


class TracingConfig(_Base):
    """OpenTelemetry tracing; off unless an OTLP endpoint is set (or a test installs a provider)."""

    otlp_endpoint: str | None = Field(None, description="OTLP/gRPC collector, e.g. http://otel-collector:4317.")
    service_name: str = Field("kvmesh")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="Fraction of new traces sampled.")


class KernelConfig(_Base):
    """Which implementation each layer runs, chosen once when the model is built (layers/op.py).
    The defaults pick the fastest path that works on the device; the switches exist to measure
    a path against another and to rule a kernel out when chasing a wrong answer."""

    cpu_kernels: bool = Field(
        True, description="Build and use kvmesh's native CPU kernels (layers/csrc: paged attention, fused "
        "ops, GEMMs, quantized GEMMs, the decode stack). Off: every op runs its PyTorch reference.",
    )
    native_isa: Literal["native", "avx2"] = Field(
        "native", description="Instruction set the native CPU kernels are built for: native (this CPU, "
        "AVX-512 where present) or avx2 (AVX-512 off, e.g. to measure the AVX2 loops on an AVX-512 CPU). "
        "One build per process: the first engine to load the kernels decides.",
    )
    layer_ops: Literal["auto", "torch", "triton"] = Field(
        "auto", description="Element-wise layer ops (RMSNorm, RoPE, SiLU-and-mul): auto (native C++ on CPU, "
        "Triton on CUDA), torch (the PyTorch reference everywhere) or triton (also on CPU under "
        "TRITON_INTERPRET=1, for tests).",
    )
    onednn_linear: bool = Field(
        True, description="Run CPU GEMMs the native kernels do not take through oneDNN with a prepacked "
        "weight; off: the weight-split bmm (layers/linear.py split_linear).",
    )
    small_gemm: bool = Field(
        True, description="Decode batches of 5-64 rows of a float32 layer on the native small-batch GEMM "
        "(layers/csrc/small_gemm.cpp); off: oneDNN.",
    )
    quantized_cpu_gemm: bool = Field(
        True, description="int8 / int4 layers on the native quantized GEMM for decode-sized inputs "
        "(layers/csrc/quant_gemm.cpp, AVX2); off: dequantize then multiply.",
    )
    decode_stack: bool = Field(
        True, description="CPU: run a decode step's decoder layers as one C++ call where the step's shape "
        "allows (layers/decode_stack.py; with tensor parallelism its all-reduces too); off: the layer loop, "
        "the same kernels one Python call each (bit-identical, ~8% slower offline).",
    )
    keep_host_memory: bool = Field(
        True, description="CPU: keep freed activation memory in the process (glibc mallopt: no mmap for "
        "blocks under 32 MiB, no trim of the heap) instead of handing it back to the kernel after every "
        "step and faulting it in again on the next (worker/host_memory.py); off: glibc's defaults.",
    )


class EngineConfig(_Base):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads on CPU; None keeps torch's default."
    )
    kv_store: str | None = Field(
        None,
        description="Shared KV block store: 'memory', 'memory://?max_bytes=N' or "
        "'redis://host:port/db?timeout_ms=50&breaker_cooldown_s=5'. None: local prefix cache only.",
    )
    kv_store_ttl_s: float | None = Field(3600.0, gt=0, description="TTL of blocks written to the store.")
    prompt_cache: list[PromptCacheEntry] = Field(
        default_factory=list, description="Prompts to compute and pin at startup."
    )
    speculative: SpeculativeConfig | None = Field(None, description="Speculative decoding; None = off.")
    lora: LoRAConfig | None = Field(None, description="Multi-LoRA serving (`--enable-lora`); None = off.")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="auto: C++ paged kernels on CPU when they build, Triton kernels on CUDA when "
        "triton is installed, else the PyTorch reference. triton needs a CUDA device and `kvmesh[gpu]`."
    )
    cuda_graphs: bool = Field(
        True, description="On CUDA with the triton backend, replay decode-only steps from CUDA graphs "
        "captured at start-up (one per batch bucket 1, 2, 4, ... up to cuda_graph_max_batch_size; the "
        "capture time is logged). Off: every step runs eagerly. Ignored on CPU.",
    )
    cuda_graph_max_batch_size: int = Field(
        64, ge=1, le=512, description="Largest decode batch replayed from a CUDA graph (capped at "
        "max_num_seqs); larger decode batches and steps with prefill chunks run eagerly.",
    )
    kernels: KernelConfig = Field(default_factory=KernelConfig)

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.model.device.startswith("cpu") and self.model.dtype == "float16":
            raise ValueError("model.dtype: float16 is not supported on CPU; use float32 or bfloat16")
        return self

    def with_overrides(self, **overrides: Any) -> "EngineConfig":
        """A copy with flat keyword overrides (`max_num_seqs=8`, `kv_store=...`), validated
        like `from_kwargs`."""
        if not overrides:
            return self
        flat = {**self.model.model_dump(), **self.cache.model_dump(), **self.scheduler.model_dump(),
                **self.parallel.model_dump(), **self.kernels.model_dump(),
                **{k: getattr(self, k) for k in type(self).model_fields if k not in _SECTIONS}}
        return type(self).from_kwargs(**{**flat, **overrides})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (`LLM(model=..., block_size=16, ...)`)."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        owners = {name: section.model_fields for name, section in _SECTIONS.items()}
        for key, value in kwargs.items():
            for section, fields in owners.items():
                if key in fields:
                    sections[section][key] = value
                    break
            else:
                if key in cls.model_fields and key not in owners:
                    top[key] = value
                else:
                    raise ValueError(f"unknown engine option {key!r}")
        return cls(**{name: section(**sections[name]) for name, section in _SECTIONS.items()}, **top)


# EngineConfig's sections whose fields are flat keyword arguments and flags (names unique).
_SECTIONS: dict[str, type[_Base]] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                                     "parallel": ParallelConfig, "kernels": KernelConfig}
