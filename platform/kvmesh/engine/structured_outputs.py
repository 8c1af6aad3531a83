"""What a request's output must match (structured outputs): one JSON schema, any JSON object,
a regex, one of a list of strings, or a grammar (EBNF / GBNF; Lark where the grammar engine
reads it). The vLLM `StructuredOutputsParams` set, validated on construction; no torch.

The worker (worker/structured.py) compiles the spec with the grammar engine and masks every
sampled row's logits to the tokens the grammar allows next. The engine only checks the
shape of the spec here and asks the executor to compile it at admission, so a spec the
grammar engine cannot compile is an InvalidRequestError before the request is queued.

How a request ends: once the grammar is complete, the mask allows the model's EOS tokens
(and, where the grammar can still go on, its continuations); once nothing but EOS can
follow, EOS is the only token left and the request stops as any request stops on EOS
(finish_reason "stop"). That is why `ignore_eos` is refused with a spec (SamplingParams).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvmesh.errors import InvalidRequestError

# The longest spec text accepted (a schema, regex or grammar, in characters): compiling is
# paid on the step thread, and a megabyte-long schema is a denial of service, not a format.
MAX_SPEC_CHARS = 200_000
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the kinds. `json` is a JSON schema (dict or JSON text; strict: the
    output validates against it); `json_object` any JSON object; `regex` a full-match regex;
    `choice` one of the strings exactly; `grammar` an EBNF / GBNF grammar whose root rule is
    `root`. `disable_any_whitespace`: JSON only in compact form (vLLM's option).

    `prefilled_output_ids` is set by the engine's hosts, never by clients: output tokens
    generated elsewhere that the grammar state starts from (P/D: the decode worker's prompt
    ends with the prefill worker's first sampled token).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    prefilled_output_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            self.choice = list(self.choice)
        self.prefilled_output_ids = tuple(self.prefilled_output_ids)
        self._validate()

    @property
    def kind(self) -> str:
        for name in KINDS:
            if name == "json_object":
                if self.json_object:
                    return name
            elif getattr(self, name) is not None:
                return name
        raise AssertionError("validated: exactly one kind is set")

    @property
    def spec_text(self) -> str:
        """The spec as one string: a compact JSON schema (keys in their order: property order
        is the output's order), the regex, the grammar, or the choices as a JSON list."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for specs that compile to the same grammar (the compile cache's key)."""
        return self.kind, self.spec_text, self.disable_any_whitespace

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"structured_outputs.{name}" if name else "structured_outputs", msg)

        if not isinstance(self.json_object, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise bad("json_object", "json_object and disable_any_whitespace must be true or false")
        given = [k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise bad("", f"set exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            self._check_schema(bad)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise bad(name, "must be a non-empty string")
            if isinstance(value, str) and len(value) > MAX_SPEC_CHARS:
                raise bad(name, f"is {len(value)} characters long; at most {MAX_SPEC_CHARS} are accepted")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, str) or not c or any(not isinstance(s, str) or not s for s in c):
                raise bad("choice", "must be a non-empty list of non-empty strings")
            if len(c) > MAX_CHOICES:
                raise bad("choice", f"has {len(c)} entries; at most {MAX_CHOICES} are accepted")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.prefilled_output_ids):
            raise bad("prefilled_output_ids", "must be token ids (integers >= 0)")

    def _check_schema(self, bad) -> None:
        schema = self.json
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise bad("json", f"is {len(schema)} characters long; at most {MAX_SPEC_CHARS} are accepted")
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad("json", f"is not valid JSON: {exc}") from None
        if isinstance(schema, bool):
            return  # true / false are valid JSON schemas (anything / nothing)
        if not isinstance(schema, dict):
            raise bad("json", f"a JSON schema must be an object, got {type(schema).__name__}")
        text = json.dumps(schema)
        if len(text) > MAX_SPEC_CHARS:
            raise bad("json", f"is {len(text)} characters long; at most {MAX_SPEC_CHARS} are accepted")
