"""Chat formats: a model's prompt template and the parser of its output, behind one seam.

A `ChatTemplate` turns a `ChatPrompt` (messages, tools, thinking) into prompt text and gives the
incremental parser that splits the model's output into reasoning, content and tool-call deltas.
`template_for(model_type, model_dir)` picks one by the checkpoint's `model_type`: DeepSeek-V4's is
written in Python (`dsv4.py`, its output `dsml.py`); GLM-4.7's renders the checkpoint's own Jinja
template (`glm.py`, its output `glm_parser.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dsv4serve.chat import dsv4
from dsv4serve.chat.dsml import Delta, DSMLParser
from dsv4serve.chat.glm import GlmTemplate
from dsv4serve.chat.messages import ChatError, ChatPrompt, RenderedPrompt


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


def _deepseek_v4(model_dir: Path) -> ChatTemplate:
    return DeepSeekV4Template()  # the format is fixed; the checkpoint ships no template


# model_type -> the template of a checkpoint directory
TEMPLATES: dict[str, Callable[[Path], ChatTemplate]] = {
    "deepseek_v4": _deepseek_v4,
    "glm4_moe_lite": GlmTemplate.from_dir,
}


def template_for(model_type: str, model_dir: Path) -> ChatTemplate:
    if model_type not in TEMPLATES:
        raise ChatError(f"no chat template for model_type {model_type!r}")
    return TEMPLATES[model_type](Path(model_dir))


__all__ = ["ChatError", "ChatPrompt", "ChatTemplate", "OutputParser", "RenderedPrompt", "template_for"]
