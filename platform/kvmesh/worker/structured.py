"""Structured outputs in the worker: grammars compiled per spec, a matcher per request, and the
step's allowed-token bitmask filled while the model's forward pass runs.

Grammar engine: xgrammar (benchmarks/grammar_mask.py: on this CPU and the SmolLM2 tokenizer its
per-token mask fill is ~2-7 us against llguidance's ~20-60 us; it pays for that at compile time,
~5-10 ms a JSON schema, which the LRU cache below pays once per distinct spec).

The mask is computed off the step thread: `GrammarMasks.start` hands the step's constrained
rows to a one-thread pool before the forward pass (whose torch kernels release the GIL, so the
fills run beside them; nothing relies on xgrammar's own calls releasing it) and the
sampler's logits are masked after it (`StepMasks.apply_*`): -inf on every token the grammar does
not allow, before penalties, temperature and top-k / top-p, for greedy and sampled rows alike.
Logprobs are therefore those of the masked distribution (what the token was drawn from; vLLM
applies its bitmask before its sampler too).

Matcher state follows the request's output tokens, not the sampler: before each fill the
matcher accepts whatever output tokens it has not seen yet (and first the spec's
`prefilled_output_ids`: the prefill worker's first token in P/D). So sampling, accepted drafts,
preemption and recompute (outputs are kept) and P/D all keep it right with one rule. For
speculative rows the matcher is advanced through the drafts to fill one mask per position,
then rolled back: a draft the grammar refuses makes the target's masked logits refuse it too,
so constrained speculative output equals constrained non-speculative output.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvmesh.engine.outputs import ScheduledSeq
from kvmesh.engine.structured_outputs import StructuredOutputsParams
from kvmesh.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# How many compiled grammars one worker keeps (LRU); a JSON schema's is ~10s of KB to MBs.
GRAMMAR_CACHE_SIZE = 256
# xgrammar's C++ messages start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _xgr():
    import xgrammar

    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer into xgrammar grammars, LRU-cached by
    `spec.cache_key`. Thread-safe. The tokenizer's vocabulary is read on first use (~0.3 s)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.hits = self.misses = 0

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.stop_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=1)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar; InvalidRequestError (naming structured_outputs.<kind>) when the
        grammar engine refuses the spec."""
        key = spec.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            self.misses += 1
            compiled = self._compile(spec)
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredOutputsParams):
        c = self._get_compiler()
        kind = spec.kind
        ws = not spec.disable_any_whitespace
        try:
            if kind == "json":
                return c.compile_json_schema(spec.spec_text, any_whitespace=ws, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=ws, strict_mode=True)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _XGR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
            raise InvalidRequestError(f"structured_outputs.{kind}",
                                      f"the grammar engine cannot compile it: {reason}") from None

    def __len__(self) -> int:
        return len(self._cache)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (string literals, JSON-escaped)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class _RequestGrammar:
    matcher: object  # xgrammar.GrammarMatcher
    prefix: tuple[int, ...]  # prefilled_output_ids: accepted before the first output token
    num_fed: int = 0  # tokens of prefix + outputs the matcher has accepted
    dead: bool = False  # a token the grammar refused reached the output (never expected)


class GrammarMasks:
    """The per-request matchers of one ModelRunner, and the step's bitmask jobs."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.words = bitmask_words(self.vocab_size)
        self._states: dict[str, _RequestGrammar] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-grammar")
        # What a finished (or broken) grammar allows: the stop tokens, else everything.
        stop = torch.zeros(self.words * 32, dtype=torch.bool)
        stop[[t for t in compiler.stop_token_ids if 0 <= t < self.vocab_size]] = True
        self._stop_mask = pack_bits(stop if stop.any() else ~stop)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def start(self, spec_seqs: Sequence[ScheduledSeq], sample_seqs: Sequence[ScheduledSeq]) -> StepMasks | None:
        """Begin filling the masks of a step's verifying (`spec_seqs`, k + 1 logits rows each, in
        order) and sampling rows (one each); None when no row is constrained."""
        if not any(s.sampling_params.structured_outputs is not None for s in (*spec_seqs, *sample_seqs)):
            return None
        return StepMasks(self._pool.submit(self._fill_step, list(spec_seqs), list(sample_seqs)))

    def _fill_step(self, spec_seqs, sample_seqs):
        spec = self._fill_rows(spec_seqs, [s.spec_token_ids for s in spec_seqs])
        sample = self._fill_rows(sample_seqs, [[] for _ in sample_seqs])
        return spec, sample

    def _fill_rows(self, seqs, drafts) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask (R, words) int32, the logits rows it constrains) or None."""
        rows, row = [], 0
        for s, d in zip(seqs, drafts):
            if s.sampling_params.structured_outputs is not None:
                rows.extend(range(row, row + len(d) + 1))
            row += len(d) + 1
        if not rows:
            return None
        mask = torch.full((row, self.words), -1, dtype=torch.int32)
        row = 0
        for s, d in zip(seqs, drafts):
            if s.sampling_params.structured_outputs is not None:
                self._fill_seq(s, d, mask, row)
            row += len(d) + 1
        return mask, rows

    def _state(self, seq: ScheduledSeq) -> _RequestGrammar:
        st = self._states.get(seq.request_id)
        spec = seq.sampling_params.structured_outputs
        if st is None:
            compiled = self.compiler.compile(spec)
            st = self._states[seq.request_id] = _RequestGrammar(_xgr().GrammarMatcher(compiled),
                                                                spec.prefilled_output_ids)
        outputs = seq.output_token_ids
        want = len(st.prefix) + len(outputs)
        while st.num_fed < want:
            i = st.num_fed
            token = st.prefix[i] if i < len(st.prefix) else outputs[i - len(st.prefix)]
            m = st.matcher
            if not st.dead and not m.is_terminated() and not m.accept_token(token):
                logger.warning("request %s: output token %d is outside its grammar; only EOS is allowed from now",
                               seq.request_id, token)
                st.dead = True
            st.num_fed += 1
        return st

    def _fill_seq(self, seq: ScheduledSeq, drafts: list[int], mask: torch.Tensor, row: int) -> None:
        """Rows row..row+len(drafts): the masks after accepting drafts[:j]. Positions after a
        draft the grammar refuses are unreachable (the masked target refuses that draft) and
        stay unconstrained."""
        st = self._state(seq)
        m = st.matcher
        advanced = 0
        for j in range(len(drafts) + 1):
            if st.dead or m.is_terminated():
                mask[row + j] = self._stop_mask
            else:
                m.fill_next_token_bitmask(mask, row + j)
            if j == len(drafts) or st.dead or m.is_terminated() or not m.accept_token(drafts[j]):
                break
            advanced += 1
        if advanced:
            m.rollback(advanced)


class StepMasks:
    """A step's masks being filled; `apply_*` waits for them and masks the logits in place."""

    def __init__(self, future: Future):
        self._future = future

    def _apply(self, logits: torch.Tensor, which: int) -> None:
        got = self._future.result()[which]
        if got is None:
            return
        mask, rows = got
        apply_bitmask(logits, mask, rows)

    def apply_spec(self, logits: torch.Tensor) -> None:
        """Mask the verifying rows' (sum(k + 1), V) logits."""
        self._apply(logits, 0)

    def apply_sample(self, logits: torch.Tensor) -> None:
        """Mask the sampling rows' (B, V) logits."""
        self._apply(logits, 1)

    def wait(self) -> None:
        self._future.result()


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """logits[r, t] = -inf where bit t of mask[r] is 0, for r in rows (in place)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        _xgr().apply_token_bitmask_inplace(logits, mask, indices=rows)
        return
    allowed = unpack_bits(mask[rows].to(logits.device), logits.shape[-1])
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bits(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, words) int32 bitmask -> (R, vocab_size) bool (bit t % 32 of word t // 32)."""
    bits = (mask[:, :, None] >> _SHIFTS.to(mask.device)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """(words * 32,) bool -> (words,) int32, the inverse of unpack_bits for one row."""
    words = allowed.reshape(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = words.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
