"""Weight-only quantization: int8 / int4 methods, quantized modules, checkpoint formats.

- `methods`: the method interface and registry (`get_method("int4", group_size=32)`),
  each an offline pass over an HF state dict;
- `modules`: `QuantLinear` / `QuantEmbedding`, swapped in for Linear / embedding;
- `kernels` + `native`: the quantized matmuls (AVX2 kernel for decode, dequantize
  then matmul elsewhere);
- `formats`: readers for kvmesh, GPTQ and AWQ checkpoints;
- `loader`: builds a quantized model (`models.loader.load_model` calls it);
- `checkpoint`: `kvmesh quantize`.
"""

from kvmesh.quant.methods import QUANT_METHODS, QuantMethod, get_method, register_method

__all__ = ["QUANT_METHODS", "QuantMethod", "get_method", "register_method"]
