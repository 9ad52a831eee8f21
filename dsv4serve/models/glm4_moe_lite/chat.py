"""GLM-4.7's chat format: the checkpoint's own Jinja template, rendered by transformers' chat-template
machinery (`render_jinja_template`, the engine behind `apply_chat_template`: a sandboxed jinja2
environment with HF's `tojson`), with `messages`, `tools`, `add_generation_prompt=True`,
`enable_thinking` and a request's other `chat_template_kwargs` (`clear_thinking: false` keeps the
reasoning of every earlier turn in GLM-4.7's template).

The template is `chat_template.jinja` in the checkpoint directory, else `chat_template` in its
`tokenizer_config.json` (a string, or the `default` entry of a list of named templates). A checkpoint
without one still serves completions; its chat requests are refused (`ChatError`).

What the template is given: `developer` messages as `system`; content as one string; a tool call's
`arguments` as the object its JSON text holds (GLM's template iterates over it); tools as OpenAI's
`{"type": "function", "function": {...}}`. `tool_choice` `none` leaves the tools out; `required` or
a named function ends the prompt in `<tool_call>` (plus the name), after a `</think>` when the
prompt leaves the model thinking, so the model continues inside the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from transformers.utils.chat_template_utils import render_jinja_template

from dsv4serve.chat.deltas import Delta
from dsv4serve.chat.messages import (
    ChatError,
    ChatMessage,
    ChatPrompt,
    RenderedPrompt,
    ToolCallSpec,
    forced_tool,
)
from dsv4serve.models.glm4_moe_lite.parser import CALL_START, THINK_END, THINK_START, GlmParser, string_keys

TEMPLATE_FILE = "chat_template.jinja"
# what a request sets itself, never a chat_template_kwargs variable
RESERVED = frozenset({"messages", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
                      "documents", "tokenize", "return_dict"})  # fmt: skip
TOKENIZER_CONFIG = "tokenizer_config.json"


def read_chat_template(model_dir: Path) -> str | None:
    """The checkpoint's Jinja chat template, or None when it ships none."""
    file = model_dir / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    config = model_dir / TOKENIZER_CONFIG
    if not config.is_file():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class GlmTemplate:
    source: str | None  # the Jinja text; None: the checkpoint has no chat template
    model_dir: Path
    grammar_format = "glm_4_7"  # xgrammar's structural tag of GLM-4.7's tool calls (chat/grammar.py)

    @classmethod
    def from_dir(cls, model_dir: Path) -> GlmTemplate:
        return cls(read_chat_template(model_dir), model_dir)

    def render(self, prompt: ChatPrompt) -> RenderedPrompt:
        if self.source is None:
            raise ChatError(
                f"the checkpoint {self.model_dir.name!r} has no chat template ({TEMPLATE_FILE} or "
                f"{TOKENIZER_CONFIG}'s chat_template): send raw prompts to /v1/completions"
            )
        if not prompt.messages:
            raise ChatError("messages: must not be empty")
        tools = prompt.tools if prompt.tool_choice != "none" else ()
        forced = forced_tool(prompt)
        messages = [_message(i, m) for i, m in enumerate(prompt.messages)]
        reserved = sorted(RESERVED & prompt.template_kwargs.keys())
        if reserved:
            raise ChatError(f"chat_template_kwargs.{reserved[0]}: set by the request itself, not a variable")
        try:
            # it returns (texts, generation indices), whatever its annotation says
            rendered: Any = render_jinja_template(
                [messages],
                tools=[msgspec.to_builtins(t) for t in tools] or None,
                chat_template=self.source,
                add_generation_prompt=True,
                **{**prompt.template_kwargs, "enable_thinking": prompt.thinking},
            )
        except jinja2.TemplateError as err:  # a syntax error, or the template's raise_exception
            raise ChatError(f"the chat template cannot render this conversation: {err}") from None
        text = str(rendered[0][0])
        thinking = text.rstrip().endswith(THINK_START)
        prefill = "" if forced is None else (THINK_END if thinking else "") + CALL_START + forced
        return RenderedPrompt(text=text + prefill, thinking=thinking, prefill=prefill, tools=tools)

    def parser(self, rendered: RenderedPrompt) -> tuple[GlmParser, list[Delta]]:
        parser = GlmParser(thinking=rendered.thinking, strings=string_keys(rendered.tools))
        return parser, parser.feed(rendered.prefill)


def _message(index: int, m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_tool_call(index, k, c) for k, c in enumerate(m.tool_calls)]
    return out


def _tool_call(index: int, k: int, call: ToolCallSpec) -> dict[str, Any]:
    """One call of an assistant message, its arguments an object (GLM's template iterates over them)."""
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        where = f"messages[{index}].tool_calls[{k}].function.arguments"
        raise ChatError(f"{where}: must be the JSON text of an object")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}
