"""Chat formats: a model's prompt template and the parser of its output, behind one seam.

A `ChatTemplate` turns a `ChatPrompt` (messages, tools, thinking) into prompt text and gives the
incremental parser that splits the model's output into reasoning, content and tool-call deltas.
`template_for(model_type)` picks one by the checkpoint's `model_type`; GLM's will register here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dsv4serve.chat import dsv4
from dsv4serve.chat.dsml import Delta, DSMLParser
from dsv4serve.chat.dsv4 import ChatError
from dsv4serve.chat.messages import ChatPrompt, RenderedPrompt


class OutputParser(Protocol):
    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class ChatTemplate(Protocol):
    def render(self, prompt: ChatPrompt) -> RenderedPrompt: ...

    def parser(self, rendered: RenderedPrompt) -> tuple[OutputParser, list[Delta]]:
        """A parser for the output of `rendered`, and the deltas its prefill stands for."""
        ...


@dataclass(frozen=True)
class DeepSeekV4Template:
    def render(self, prompt: ChatPrompt) -> RenderedPrompt:
        return dsv4.render(prompt)

    def parser(self, rendered: RenderedPrompt) -> tuple[OutputParser, list[Delta]]:
        parser = DSMLParser(thinking=rendered.thinking)
        return parser, parser.feed(rendered.prefill)


TEMPLATES: dict[str, ChatTemplate] = {"deepseek_v4": DeepSeekV4Template()}


def template_for(model_type: str) -> ChatTemplate:
    if model_type not in TEMPLATES:
        raise ChatError(f"no chat template for model_type {model_type!r}")
    return TEMPLATES[model_type]


__all__ = ["ChatError", "ChatPrompt", "ChatTemplate", "OutputParser", "RenderedPrompt", "template_for"]
