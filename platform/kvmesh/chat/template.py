"""What a chat template can do with tools, read from its Jinja source.

A template "takes tools" when its source reads the `tools` variable (Qwen 2.5 / 3,
Llama 3.1, Mistral, Hermes do); kvmesh then passes `tools=` to `apply_chat_template`.
Otherwise (SmolLM2, most small models) tools.py renders them into a system prompt. The
`auto` tool-call parser is the format the template teaches: markers in its source pick
mistral or llama3_json, and everything else, the injected prompt included, is hermes.
"""

from __future__ import annotations

import functools

import jinja2
import jinja2.meta

from kvmesh.chat.tool_parsers import ToolParser, get_tool_parser


def template_source(tokenizer) -> str:
    """The tokenizer's chat template text ('' when it has none); of a named set
    (tokenizers that ship several), the tool_use one."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("tool_use") or tpl.get("default") or next(iter(tpl.values()), "")
    return tpl or ""


@functools.lru_cache(maxsize=16)
def takes_tools(source: str) -> bool:
    """Whether the template reads `tools` (a variable it does not define itself)."""
    if not source:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source))
    except jinja2.TemplateError:
        return "tools" in source


def auto_tool_parser(source: str) -> str:
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("<|eot_id|>" in source and takes_tools(source)):
        return "llama3_json"
    return "hermes"


def resolve_tool_parser(name: str, source: str) -> ToolParser:
    """`--tool-call-parser` (a registered name, or auto) for a template."""
    return get_tool_parser(auto_tool_parser(source) if name == "auto" else name)
