"""Per-request sampling parameters (the vLLM / OpenAI set), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvmesh.engine.hashing import MAX_CACHE_SALT_CHARS
from kvmesh.engine.structured_outputs import StructuredOutputsParams
from kvmesh.errors import InvalidRequestError

# How many top logprobs a request may ask for per generated token.
MAX_LOGPROBS = 20
# How many choices one request may ask for (OpenAI's `n`); each holds its own KV tail.
MAX_N = 128
# OpenAI's logit_bias range, added to the raw logits.
MAX_LOGIT_BIAS = 100.0
# Integer fields travel as protobuf int32 (seed as int64): anything outside cannot be sent
# on to a worker, so it is refused here rather than failing in serialization.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    """A finite int or float (NaN / Infinity would silently change what is sampled)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How to turn each step's logits into a token, and when to stop.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable
    those filters. `seed` makes a request's samples reproducible on its own,
    independent of whatever else is batched with it.
    """

    max_tokens: int = 16
    # Generate at least this many tokens (vLLM's): until then EOS and stop_token_ids are
    # never sampled (the scheduler bans them per step) and stop strings are not looked for.
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # Let the engine speculate for this request (when speculative decoding is on).
    speculative: bool = True
    # Prefix-cache isolation (vLLM's `cache_salt`): KV is reused only between requests with
    # the same salt (engine/hashing.py). Carried here so it travels with the request.
    cache_salt: str = ""
    # Parallel sampling: `n` choices from one prompt, computed once (the choices fork its KV
    # blocks). `best_of` is accepted only as None or == n (no ranking of extra samples).
    n: int = 1
    best_of: int | None = None
    # {token id: bias in [-100, 100]} added to the raw logits before penalties (OpenAI).
    logit_bias: dict[int, float] | None = None
    # Top-k logprobs of every prompt token given its prefix (vLLM's prompt_logprobs, 0..20).
    prompt_logprobs: int | None = None
    # The output must match a JSON schema / regex / choice / grammar (engine/structured_outputs.py);
    # a dict is read as StructuredOutputsParams(**dict).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise InvalidRequestError("structured_outputs", str(exc)) from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _parse_logit_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(name, msg)

        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise bad("max_tokens", f"must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not _is_real(getattr(self, name)):
                raise bad(name, f"must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not _valid_unicode(s) for s in self.stop):
            raise bad("stop", "stop strings must be valid Unicode (no lone surrogates)")
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be integers in [0, {INT32_MAX}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise bad("cache_salt", f"must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        self._validate_sampling_surface()
        self._validate_structured_outputs()

    def _validate_sampling_surface(self) -> None:
        """n / best_of / logit_bias / prompt_logprobs."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of", f"is supported only unset or equal to n ({self.n}), got "
                                                 f"{self.best_of!r}: kvmesh does not rank extra samples")
        for tid, bias in (self.logit_bias or {}).items():
            if not 0 <= tid <= INT32_MAX:
                raise InvalidRequestError("logit_bias", f"token id {tid} must be in [0, {INT32_MAX}]")
            if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError("logit_bias", f"bias of token {tid} must be a number in "
                                                        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS}, "
                                                         f"got {self.prompt_logprobs!r}")

    def _validate_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if not isinstance(so, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs",
                                      f"must be StructuredOutputsParams, got {type(so).__name__}")
        if self.ignore_eos:
            # A finished grammar ends the request by allowing only EOS (engine/structured_outputs.py).
            raise InvalidRequestError("ignore_eos", "cannot be combined with structured_outputs: the request ends "
                                                    "with EOS when its output is complete; leave ignore_eos unset")
        if self.min_tokens:
            # The grammar may allow only EOS before min_tokens: the two cannot both hold.
            raise InvalidRequestError("min_tokens", "cannot be combined with structured_outputs: the output ends "
                                                    "where the grammar completes; leave min_tokens unset")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def can_speculate(self) -> bool:
        """Penalties and logprobs are position-dependent outputs the verifier does not
        reproduce per draft position; such requests decode one token at a time. So do
        requests with a logit_bias (the verifier scores the unbiased logits) or a min_tokens
        (the verifier does not ban EOS)."""
        return (self.speculative and not self.needs_penalties and self.logprobs is None and not self.logit_bias
                and not self.min_tokens)

    def for_choice(self, index: int) -> SamplingParams:
        """The params of choice `index` of an n > 1 request: one choice each, the seed
        offset by the index (vLLM's seed + i, so choice i samples as a single request with
        that seed would); prompt logprobs are computed once, by choice 0."""
        seed = None if self.seed is None else _wrap_int64(self.seed + index)
        return replace(self, n=1, best_of=None, seed=seed,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _wrap_int64(x: int) -> int:
    """seed + i kept a 64-bit integer (wrapping past 2**63 - 1), so a seed near the top of
    the range never makes a choice's params fail validation."""
    return (x - INT64_MIN) % 2**64 + INT64_MIN


def _parse_logit_bias(bias) -> dict[int, float]:
    """{token id: bias}; JSON object keys arrive as strings ("50256"), so digit strings
    are read as ids. Anything else is refused naming the field."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", f"must be a mapping of token id to bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if not _is_int(key):
            raise InvalidRequestError("logit_bias", f"keys must be token ids (integers), got {key!r}")
        out[key] = value
    return out


def _valid_unicode(text: str) -> bool:
    """False for strings holding lone UTF-16 surrogates (JSON lets "\\ud800" through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
