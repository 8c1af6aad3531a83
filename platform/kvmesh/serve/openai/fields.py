"""Body fields beyond the ones kvmesh serves: refused when they would change the output,
ignored with a warning when unknown (as vLLM does).

The request models (protocol.py) declare every field kvmesh honours and keep the rest
as extras. Of those extras:
- a known field that would change the output (beam search, allowed_token_ids, a chat
  template sent with the request, ...) is a 400 naming it and what to use instead, unless
  it holds the value that changes nothing (`use_beam_search: false`, `length_penalty: 1`);
- a known field that changes nothing kvmesh returns (`store`, `priority`, `prediction`, ...)
  is accepted silently;
- any other field is ignored and logged at WARNING, naming it: once per process for each
  set of names, so one client that always sends a field cannot flood the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refused:
    """A field kvmesh does not serve: `inert` are the values that change nothing."""

    use: str  # what to do instead, as the 400 says it
    inert: tuple[Any, ...] = (None,)


_TEXT_ONLY = "kvmesh serves text models; send text (or token ids) only"

# Fields of the completions and chat bodies (OpenAI's and vLLM's).
SAMPLING_REFUSED: dict[str, Refused] = {
    "use_beam_search": Refused("kvmesh does not run beam search; sample several choices with n instead",
                               (None, False)),
    "length_penalty": Refused("length_penalty applies to beam search only, which kvmesh does not run; "
                              "leave it unset", (None, 1, 1.0)),
    "truncate_prompt_tokens": Refused("kvmesh does not truncate prompts; shorten the prompt, or compress its "
                                      "context with the kvmesh compression field"),
    "allowed_token_ids": Refused("restrict the output with structured outputs (guided_choice, guided_regex, "
                                 "response_format) or logit_bias"),
    "bad_words": Refused("ban tokens with logit_bias ({token id: -100})", (None, [])),
    "logits_processors": Refused("custom logits processors are not supported; use logit_bias or structured "
                                 "outputs", (None, [])),
    "return_tokens_as_token_ids": Refused("token ids are not returned in place of text; read logprobs' tokens "
                                          "or POST /tokenize the text", (None, False)),
    "spaces_between_special_tokens": Refused("special tokens are always decoded with spaces between them; "
                                             "leave it unset", (None, True)),
    "guided_whitespace_pattern": Refused("set structured_outputs.disable_any_whitespace for compact JSON"),
    "prompt_embeds": Refused("prompt embeddings are not accepted; send the prompt as text or token ids"),
    "mm_processor_kwargs": Refused(_TEXT_ONLY, (None, {})),
    "multi_modal_data": Refused(_TEXT_ONLY),
    "audio": Refused(_TEXT_ONLY),
    "modalities": Refused(_TEXT_ONLY, (None, ["text"])),
    "web_search_options": Refused("kvmesh runs no web search; put retrieved text in the messages"),
    "return_token_ids": Refused("token ids are not added to the reply; POST /tokenize the prompt, or read "
                                "logprobs' tokens", (None, False)),
    "thinking_token_budget": Refused("the reasoning length is not capped separately; bound the reply with "
                                     "max_tokens"),
}

CHAT_REFUSED: dict[str, Refused] = {
    **SAMPLING_REFUSED,
    "chat_template": Refused("a request cannot bring its own chat template: the server renders the model's "
                             "(pass variables to it with chat_template_kwargs)"),
    "echo": Refused("chat does not echo the last message; read it from your request", (None, False)),
    "add_special_tokens": Refused("the chat template adds the special tokens it needs; leave it unset",
                                  (None, False)),
    "include_reasoning": Refused("reasoning is always returned (as reasoning_content, with --reasoning-parser); "
                                 "drop reasoning_content on the client", (None, True)),
}

RESPONSES_REFUSED: dict[str, Refused] = {
    "prompt": Refused("kvmesh keeps no stored prompts; send the instructions and input themselves"),
    "truncation": Refused("kvmesh does not truncate the conversation; send one that fits the context",
                          (None, "disabled")),
    "max_tool_calls": Refused("the number of calls is not capped; set parallel_tool_calls false for at most one"),
}

# Known fields that do not change what kvmesh returns (bookkeeping, scheduling hints,
# other servers' backend choices): accepted without a warning.
ACCEPTED = frozenset({
    "store", "metadata", "service_tier", "priority", "request_id", "prediction", "guided_decoding_backend",
    "kv_transfer_params", "vllm_xargs", "safety_identifier", "prompt_cache_key", "stream_options",
})

# Fields of a chat message the API returns and clients send back unchanged (openai's
# `model_dump()` of a reply): no template reads them here, so they are dropped silently.
MESSAGE_REPLY_FIELDS = frozenset({"refusal", "annotations", "audio", "reasoning_content", "reasoning"})

_warned: set[tuple[str, frozenset[str]]] = set()


def refusal(extras: dict[str, Any] | None, refused: dict[str, Refused]) -> tuple[str, str] | None:
    """(field, the 400's message) of the first output-changing field in `extras`, or None."""
    for name, value in (extras or {}).items():
        rule = refused.get(name)
        if rule is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                        for v in rule.inert):
            return name, f"{name} is not supported: {rule.use}"
    return None


def warn_unknown(extras: dict[str, Any] | None, known: dict[str, Refused] | frozenset[str], where: str) -> None:
    """Log the fields of `extras` that are neither in `known` nor ACCEPTED (`where` names
    the body: '/v1/chat/completions', 'messages[]')."""
    names = frozenset(n for n in extras or () if n not in known and n not in ACCEPTED)
    if not names or (where, names) in _warned:
        return
    if len(_warned) < 1024:  # bounded: a client making up names cannot grow it without end
        _warned.add((where, names))
    logger.warning("%s: ignoring unknown fields %s (kvmesh does not read them; logged once per set of names)",
                   where, ", ".join(sorted(names)))
