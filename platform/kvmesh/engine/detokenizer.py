"""Incremental detokenization and stop strings, per request.

Text is produced by decoding a small window of tokens twice (before and after the
new tokens) and emitting the difference, so byte-level BPE pieces that only form a
character together (multi-byte UTF-8) are held back until the character completes
(the decoded window ends in U+FFFD until then). Stop strings are searched in the
newly produced text plus a tail of the old, and text that could still become the
start of a stop string is held back from streaming until it cannot.
"""

from __future__ import annotations

from kvmesh.engine.sampling_params import SamplingParams

# Tokens before the read offset kept as left context when decoding a window, so
# that tokenizers that drop a leading space (SentencePiece) decode consistently.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self._num_prompt_tokens = len(self.token_ids)
        self.prefix_offset = max(len(self.token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""  # all output text produced so far (after stop truncation)
        self._emitted = 0  # chars of self.text already streamed
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self.stop_string: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def update(self, new_token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Add tokens; return (text delta to stream, whether a stop string was hit)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new_text = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
        elif finished:
            new_text = full[len(prefix) :].rstrip("\ufffd") if len(full) > len(prefix) else ""
        else:
            new_text = ""
        old_len = len(self.text)
        self.text += new_text
        hit = self._check_stop(old_len)
        done = finished or hit
        # Hold back a possible stop-string prefix unless the request is done.
        hold = 0 if done else max(self._max_stop_len - 1, 0)
        visible = max(len(self.text) - hold, self._emitted)
        delta = self.text[self._emitted : visible]
        self._emitted = visible
        return delta, hit

    def _check_stop(self, old_len: int) -> bool:
        if not self.params.stop or len(self.text) == old_len:
            return False
        if len(self.token_ids) - self._num_prompt_tokens < self.params.min_tokens:
            return False  # stop strings count only once min_tokens tokens are out (vLLM)
        search_from = max(old_len - self._max_stop_len + 1, 0)
        best = None
        for s in self.params.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        idx, s = best
        self.stop_string = s
        cut = idx + len(s) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:cut]
        self._emitted = min(self._emitted, cut)
        return True
