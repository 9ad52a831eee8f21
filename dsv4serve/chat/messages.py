"""Chat requests as plain data: OpenAI's message, tool and tool-choice shapes (msgspec, decoded strictly
at the HTTP boundary), and `ChatPrompt`, what a chat template renders.

Messages accept unknown fields (clients echo back assistant messages with `refusal`, `annotations`,
...); everything they carry that a template uses is typed here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

import msgspec

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ChatError(ValueError):
    """A conversation the template cannot render; the message names the field."""


class TextPart(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True):
    name: Name
    arguments: str  # JSON text of an object


class ToolCallSpec(msgspec.Struct, frozen=True, kw_only=True):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallSpec] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: Name


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice: TypeAlias = Literal["none", "auto", "required"] | NamedToolChoice


class ChatPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat template renders: the conversation, the tools on offer and the thinking mode."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    thinking: bool = False
    reasoning_effort: Literal["high", "max"] | None = None


class RenderedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """A rendered chat prompt. `prefill` is the part of the assistant's answer the prompt already
    holds (a forced tool call's opening tags); the output parser reads it before the model's text."""

    text: str
    thinking: bool  # the prompt leaves the model inside a reasoning block (it ends in `<think>`)
    prefill: str = ""
    tools: tuple[ToolSpec, ...] = ()  # the tools the prompt offers (a parser may read their schemas)


def forced_tool(prompt: ChatPrompt) -> str | None:
    """What `tool_choice` forces: None (`none`, `auto`), "" (`required`: some tool) or a tool's name."""
    choice = prompt.tool_choice
    if choice in ("none", "auto"):
        return None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else ""
    if not prompt.tools:
        raise ChatError(f"tool_choice: {name or str(choice)!r} needs tools")
    if name and name not in {t.function.name for t in prompt.tools}:
        raise ChatError(f"tool_choice: no tool named {name!r} in tools")
    return name
