"""The chat options of a deployment (vLLM's flags of the same names): which tool-call and
reasoning formats the served model writes. One typed model for `kvmesh serve` /
`kvmesh router` flags, the serving config (`chat:`) and the HTTP app."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvmesh.chat.reasoning import REASONING_PARSERS
from kvmesh.chat.tool_parsers import TOOL_PARSERS


class ChatConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tool_call_parser: str = Field(
        "auto", description="Tool-call format of the model's output: hermes (Hermes, Qwen 2.5 / 3), llama3_json, "
        "mistral, or auto (the format the chat template teaches; hermes for templates that ignore tools, which get "
        "a Hermes-style tool prompt).")
    enable_auto_tool_choice: bool = Field(
        True, description="Let the model decide to call tools (tool_choice auto, the default with tools); off, such "
        "requests are refused and only required / named choices are served.")
    reasoning_parser: str | None = Field(
        None, description="Split <think>...</think> into reasoning_content: deepseek_r1 (the reply starts inside "
        "the thought) or qwen3 (only an opened <think>); None leaves the reply whole.")

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_parser(cls, v: str) -> str:
        if v != "auto" and v not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: unknown {v!r}; choose auto or one of {sorted(TOOL_PARSERS)}")
        return v

    @field_validator("reasoning_parser")
    @classmethod
    def _reasoning_parser(cls, v: str | None) -> str | None:
        if v is not None and v not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: unknown {v!r}; choose one of {sorted(REASONING_PARSERS)}")
        return v

    def cli_flags(self) -> list[str]:
        """These options as `kvmesh router` flags (`kvmesh serve --local` starts one)."""
        out = ["--tool-call-parser", self.tool_call_parser,
               "--enable-auto-tool-choice" if self.enable_auto_tool_choice else "--no-enable-auto-tool-choice"]
        if self.reasoning_parser:
            out += ["--reasoning-parser", self.reasoning_parser]
        return out
