"""Typed per-request compression options, and their parsing from every front end.

No torch here: the router and the HTTP ingress validate options without loading a model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.errors import InvalidRequestError

Method = Literal["token", "passage"]
Granularity = Literal["paragraph", "sentence"]

# The field name every front end uses for the option (gRPC field, HTTP body key).
FIELD = "compression"


class CompressionOptions(BaseModel):
    """How to compress the context of one prompt.

    The context is what the prompt marks compressible (`<context>...</context>` spans
    of a prompt string, or the `contexts` list of `compress`); the instruction and the
    question are never changed. The kept context has about
    `original_context_tokens / target_ratio` tokens.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method = Field(
        "passage",
        description="passage: keep the passages most relevant to the question (MiniLM cosine), in their "
                    "original order. token: drop the words a small LM finds most predictable (LLMLingua-style).")
    target_ratio: float = Field(
        2.0, ge=1.0, le=100.0,
        description="original context tokens / kept context tokens; 1 keeps everything.")
    question: str | None = Field(
        None, max_length=8192,
        description="Text the passages are ranked against (passage method). Default: the prompt after the "
                    "last context span, else the prompt before the first one.")
    granularity: Granularity = Field(
        "paragraph",
        description="passage method unit: paragraphs (split on blank lines; a context with a single paragraph "
                    "is split into sentences) or sentences.")


def _field_path(err: dict) -> str:
    loc = [str(p) for p in err.get("loc", ()) if p != "__root__"]
    return ".".join([FIELD, *loc])


def parse_options(value: CompressionOptions | dict[str, Any] | None) -> CompressionOptions | None:
    """Validated options from a model, a plain dict or None.

    Raises InvalidRequestError naming the offending field (e.g. `compression.target_ratio`),
    which every front end maps to INVALID_ARGUMENT / HTTP 400.
    """
    if value is None or isinstance(value, CompressionOptions):
        return value
    if not isinstance(value, dict):
        raise InvalidRequestError(FIELD, f"must be an object like {{\"method\": \"passage\", \"target_ratio\": 3}}, "
                                         f"got {type(value).__name__}")
    try:
        return CompressionOptions.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidRequestError(_field_path(err), err["msg"]) from None


def options_from_openai(body: dict[str, Any]) -> CompressionOptions | None:
    """The `compression` field of an OpenAI-style request body, validated; None when absent.

    `{"compression": {"method": "passage", "target_ratio": 3}}` turns compression on; a
    missing key or `null` leaves the request untouched. Bad values raise
    InvalidRequestError naming the field (map it to HTTP 400, type invalid_request_error).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    return parse_options(body.get(FIELD))
