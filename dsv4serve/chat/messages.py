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
    # more variables for a Jinja template (a request's `chat_template_kwargs` but its thinking keys)
    template_kwargs: dict[str, Any] = {}


THINKING_KWARGS = ("enable_thinking", "thinking")  # chat_template_kwargs keys that set `thinking`


def prompt_of(
    messages: tuple[ChatMessage, ...],
    tools: tuple[ToolSpec, ...],
    tool_choice: ToolChoice,
    thinking: bool,
    reasoning_effort: Literal["high", "max"] | None,
    template_kwargs: dict[str, Any] | None,
) -> ChatPrompt:
    """A request's prompt; `chat_template_kwargs` (vLLM's and SGLang's field) may set the thinking mode
    (`enable_thinking` or `thinking`: a bool) and pass more variables to a Jinja template."""
    kwargs = dict(template_kwargs or {})
    for key in THINKING_KWARGS:
        if key in kwargs:
            value = kwargs.pop(key)
            if not isinstance(value, bool):
                raise ChatError(f"chat_template_kwargs.{key}: expected true or false, got {value!r}")
            thinking = value
    return ChatPrompt(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        thinking=thinking,
        reasoning_effort=reasoning_effort,
        template_kwargs=kwargs,
    )


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
