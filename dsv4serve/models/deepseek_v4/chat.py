"""DeepSeek-V4's chat format (the official `encoding/encoding_dsv4.py`, `encode_messages`), with tools.

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...]<｜User｜>{user}<｜Assistant｜></think>{answer}...

- The last user turn ends in `<｜Assistant｜><think>` with thinking on, `<｜Assistant｜></think>` off.
- `tool` messages join the next user turn as `<tool_result>...</tool_result>` blocks (in the order of
  the calls of the assistant turn before them); consecutive user texts join with a blank line.
- Without tools, reasoning of turns before the last user message is dropped (`drop_thinking`); with
  tools, every assistant turn keeps its reasoning and every user turn opens a thinking block.
- Assistant turns: `{reasoning}</think>` (thinking mode) + `{content}` + DSML tool calls + EOS.
- `tool_choice` `required` or a named function: the prompt ends in the opening tags of a tool call
  (`prefill`), so the model continues inside it; with thinking on its reasoning is then empty.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from dsv4serve.chat.deltas import Delta
from dsv4serve.chat.messages import (
    ChatError,
    ChatMessage,
    ChatPrompt,
    RenderedPrompt,
    ToolCallSpec,
    ToolSpec,
    forced_tool,
)
from dsv4serve.models.deepseek_v4.dsml import DSML, THINK_END, THINK_START, TOOL_BLOCK, DSMLParser

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TOOL_CALLS_START = f"\n\n<{DSML}{TOOL_BLOCK}>\n"
TOOL_CALLS_END = f"\n</{DSML}{TOOL_BLOCK}>"

# prompt text the model was trained on, verbatim from the official encoder
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, \
booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: tuple[ToolSpec, ...]) -> str:
    schemas = "\n".join(to_json(msgspec.to_builtins(t.function)) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def render_tool_calls(calls: list[ToolCallSpec]) -> str:
    """The DSML block of an assistant turn's calls (arguments: JSON text of an object)."""
    invokes = [render_invoke(c.function.name, c.function.arguments) for c in calls]
    return TOOL_CALLS_START + "\n".join(invokes) + TOOL_CALLS_END


def render_invoke(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        args = {"arguments": arguments}  # as the official encoder does with text it cannot read
    params = [
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>"
        for key, v in args.items()
    ]
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


def forced_prefill(prompt: ChatPrompt) -> str:
    """The opening tags a `required` or named tool choice puts at the start of the answer."""
    name = forced_tool(prompt)
    if name is None:
        return ""
    head = TOOL_CALLS_START + f'<{DSML}invoke name="'
    if name:
        head += f'{name}">\n'
    return (THINK_END if prompt.thinking else "") + head


# ---------------------------------------------------------------- turns


class _Turn(msgspec.Struct, kw_only=True):
    role: str  # system, developer, user, assistant
    text: str = ""
    message: ChatMessage | None = None  # assistant turns
    tool_results: list[tuple[str, str]] = []  # user turns: (tool_call_id, content)
    texts: list[str] = []  # user turns


def _turns(messages: tuple[ChatMessage, ...]) -> list[_Turn]:
    """Tool results and consecutive user messages merged into user turns."""
    turns: list[_Turn] = []
    for m in messages:
        merge = bool(turns) and turns[-1].role == "user"
        if m.role == "tool":
            if not merge:
                turns.append(_Turn(role="user"))
            turns[-1].tool_results.append((m.tool_call_id or "", m.text))
            turns[-1].texts.append("\0tool")  # placeholder: results keep their place among texts
        elif m.role == "user":
            if not merge:
                turns.append(_Turn(role="user"))
            turns[-1].texts.append(m.text)
        else:
            turns.append(_Turn(role=m.role, text=m.text, message=m))
    _order_tool_results(turns)
    return turns


def _order_tool_results(turns: list[_Turn]) -> None:
    """Each user turn's tool results in the order of the calls of the assistant turn before it."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.message is not None and turn.message.tool_calls:
            order = {c.id: k for k, c in enumerate(turn.message.tool_calls) if c.id}
        elif turn.role == "user" and len(turn.tool_results) > 1 and order:
            turn.tool_results.sort(key=lambda r: order.get(r[0], 0))


def _user_text(turn: _Turn) -> str:
    results = iter(turn.tool_results)
    parts = [f"<tool_result>{next(results)[1]}</tool_result>" if t == "\0tool" else t for t in turn.texts]
    return "\n\n".join(parts)


# ---------------------------------------------------------------- render


def render(prompt: ChatPrompt) -> RenderedPrompt:
    if not prompt.messages:
        raise ChatError("messages: must not be empty")
    if prompt.template_kwargs:
        key = next(iter(prompt.template_kwargs))
        raise ChatError(
            f"chat_template_kwargs.{key}: DeepSeek-V4's encoding takes no template variables "
            "(only thinking / enable_thinking)"
        )
    tools = prompt.tools if prompt.tool_choice != "none" else ()
    prefill = forced_prefill(prompt)
    turns = _turns(prompt.messages)
    if turns[-1].role not in ("user", "developer"):
        raise ChatError(f"messages: the last message must be from the user or a tool, not {turns[-1].role!r}")
    if tools:
        _attach_tools(turns, tools)
    drop = not tools
    last_user = max(i for i, t in enumerate(turns) if t.role in ("user", "developer"))
    if prompt.thinking and drop:
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]
        last_user = max(i for i, t in enumerate(turns) if t.role in ("user", "developer"))
    parts = [BOS]
    if prompt.thinking and prompt.reasoning_effort == "max":
        parts.append(REASONING_EFFORT_MAX)
    for i, turn in enumerate(turns):
        parts.append(_render_turn(turn, prompt.thinking and (not drop or i > last_user)))
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if turn.role in ("user", "developer") and following in (None, "assistant"):
            think = prompt.thinking and (not drop or i >= last_user)
            parts.append(ASSISTANT + (THINK_START if think else THINK_END))
    return RenderedPrompt(text="".join(parts) + prefill, thinking=prompt.thinking, prefill=prefill)


def _attach_tools(turns: list[_Turn], tools: tuple[ToolSpec, ...]) -> None:
    block = render_tools(tools)
    if turns[0].role == "system":
        turns[0].text += "\n\n" + block
    else:
        turns.insert(0, _Turn(role="system", text=block))


def _render_turn(turn: _Turn, keep_reasoning: bool) -> str:
    if turn.role == "system":
        return turn.text
    if turn.role == "developer":
        return USER + turn.text
    if turn.role == "user":
        return USER + _user_text(turn)
    m = turn.message
    assert m is not None
    reasoning = (m.reasoning_content or "") + THINK_END if keep_reasoning else ""
    calls = render_tool_calls(m.tool_calls) if m.tool_calls else ""
    return reasoning + m.text + calls + EOS


class DeepSeekV4Template:
    """The chat template of every DeepSeek-V4 checkpoint (the format is fixed; checkpoints ship none)."""

    grammar_format = "deepseek_v4"  # xgrammar's structural tag of DSML tool calls (chat/grammar.py)

    def render(self, prompt: ChatPrompt) -> RenderedPrompt:
        return render(prompt)

    def parser(self, rendered: RenderedPrompt) -> tuple[DSMLParser, list[Delta]]:
        parser = DSMLParser(thinking=rendered.thinking)
        return parser, parser.feed(rendered.prefill)
