"""Chat-level reading and writing of model text, shared by the HTTP API (serve/openai) and
any other chat front end: tool definitions and choices (tools), how a template sees them
(template), the tool-call formats models write (tool_parsers), `<think>` reasoning
splitting (reasoning), and a reply -> OpenAI message / stream deltas (output). No torch,
no I/O: pure functions of text, tested in milliseconds.
"""

from kvmesh.chat.config import ChatConfig
from kvmesh.chat.output import ChatOutput, ChatOutputSpec, merge_deltas, output_spec
from kvmesh.chat.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from kvmesh.chat.template import resolve_tool_parser, takes_tools, template_source
from kvmesh.chat.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser, get_tool_parser
from kvmesh.chat.tools import Tool, ToolSet, template_messages

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "ChatConfig", "ChatOutput", "ChatOutputSpec", "ReasoningParser",
           "Tool", "ToolCall", "ToolParser", "ToolSet", "get_reasoning_parser", "get_tool_parser", "merge_deltas",
           "output_spec", "resolve_tool_parser", "takes_tools", "template_messages", "template_source"]
