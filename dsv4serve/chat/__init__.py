"""Chat formats: a model's prompt template and the parser of its output, behind one seam.

A `ChatTemplate` turns a `ChatPrompt` (messages, tools, thinking) into prompt text and gives the
incremental parser that splits the model's output into reasoning, content and tool-call deltas. Each
model family ships its own (`ModelSpec.chat_template`): DeepSeek-V4's is written in Python
(models/deepseek_v4/chat.py, its output dsml.py); GLM-4.7's renders the checkpoint's own Jinja template
(models/glm4_moe_lite/chat.py, its output parser.py). This package holds what they share: the
messages (`messages.py`) and the deltas and their tag scanner (`deltas.py`).
"""

from __future__ import annotations

from typing import Protocol

from dsv4serve.chat.deltas import Delta
from dsv4serve.chat.messages import ChatError, ChatPrompt, RenderedPrompt


class OutputParser(Protocol):
    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


class ChatTemplate(Protocol):
    @property
    def grammar_format(self) -> str | None:
        """xgrammar's name of the model's tool-call format (None: no strict tool calls)."""
        ...

    def render(self, prompt: ChatPrompt) -> RenderedPrompt: ...

    def parser(self, rendered: RenderedPrompt) -> tuple[OutputParser, list[Delta]]:
        """A parser for the output of `rendered`, and the deltas its prefill stands for."""
        ...


class NoTemplate:
    """A family without a chat format: chat requests are refused with a clear error."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        self.grammar_format: str | None = None

    def render(self, prompt: ChatPrompt) -> RenderedPrompt:
        raise ChatError(f"{self.model_type} has no chat template: send raw prompts to /v1/completions")

    def parser(self, rendered: RenderedPrompt) -> tuple[OutputParser, list[Delta]]:
        raise ChatError(f"{self.model_type} has no chat template")


__all__ = ["ChatError", "ChatPrompt", "ChatTemplate", "Delta", "NoTemplate", "OutputParser", "RenderedPrompt"]
