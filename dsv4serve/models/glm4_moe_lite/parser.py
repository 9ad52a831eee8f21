"""An incremental parser of GLM-4.7 output: reasoning, content and XML-ish tool calls as deltas.

The model writes (thinking on) `{reasoning}</think>{content}` and (thinking off) `{content}`, where
content may hold tool calls

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

each of which becomes an OpenAI tool call whose `arguments` is the JSON object `{"KEY": VALUE, ...}`.
A value is copied as a string when the tool's schema types that key `string` (GLM's template writes
string values verbatim), else it is the JSON it parses as (`42`, `true`, `["a"]`) or, when it does
not parse, a string (vLLM's GLM parser reads values the same way). A `<tool_call>` met in the
reasoning ends the reasoning.

Contract: `feed` may be given the text in any split; the concatenation of the deltas it and `finish`
return is the same for every split (a tail that might still start a tag is held back). A tool call
comes out whole when its `</tool_call>` arrives (so its arguments are not streamed piece by piece);
a call that does not parse, is cut short by another `<tool_call>`, or is still open at the end comes
out as content, verbatim. Stray `<think>`, `</think>` and `</tool_call>` are dropped. Whitespace
between content and a tool call, or between calls, is not content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from dsv4serve.chat.deltas import Content, Delta, Reasoning, TagStream, ToolArguments, ToolCallStart
from dsv4serve.chat.messages import ToolSpec

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
MARKERS = (THINK_START, THINK_END, CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END)

_PAIR = re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)


class _State(Enum):
    REASONING = auto()
    CONTENT = auto()
    CALL = auto()  # after `<tool_call>`: the call's text is gathered up to `</tool_call>`


_TERMINATORS: dict[_State, tuple[str, ...]] = {
    _State.REASONING: (THINK_END, THINK_START, CALL_START, CALL_END),
    _State.CONTENT: (CALL_START, THINK_START, THINK_END, CALL_END),
    _State.CALL: (CALL_END, CALL_START),
}


def string_keys(tools: tuple[ToolSpec, ...]) -> dict[str, frozenset[str]]:
    """Each tool's argument keys whose schema type is `string`."""
    out: dict[str, frozenset[str]] = {}
    for tool in tools:
        properties = (tool.function.parameters or {}).get("properties")
        if isinstance(properties, dict):
            keys = (k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string")
            out[tool.function.name] = frozenset(keys)
    return out


@dataclass(eq=False, slots=True)
class GlmParser(TagStream):
    """Feed text deltas, get `Delta`s; `thinking` starts in the reasoning (the prompt ended in `<think>`).
    `strings`: per tool, the argument keys kept as strings (see `string_keys`)."""

    thinking: bool = False
    strings: Mapping[str, frozenset[str]] = field(default_factory=dict)
    _state: _State = _State.CONTENT
    _call: list[str] = field(default_factory=list)  # the open call's text so far
    _space: str = ""  # content whitespace held until we know whether a tool call follows
    _call_space: str = ""  # the whitespace before the open call (content again if the call is not one)
    _after_call: bool = False  # content so far since the last call is whitespace
    _num_calls: int = 0

    def __post_init__(self) -> None:
        self._state = _State.REASONING if self.thinking else _State.CONTENT

    def finish(self) -> list[Delta]:
        """The end of the output: held text goes out; an open call goes out as content."""
        rest, self._buf = self._buf, ""
        if self._state is _State.REASONING:
            self._emit(Reasoning(rest))
        elif self._state is _State.CONTENT:
            self._content(rest)
        else:
            self._content(self._call_space + CALL_START + "".join(self._call) + rest)
        self._emit(Content(self._space))
        self._space, self._call = "", []
        return self._take()

    def _emit(self, delta: Delta) -> None:
        if not isinstance(delta, Reasoning | Content) or delta.text:
            self._out.append(delta)

    def _tags(self) -> tuple[tuple[str, ...], bool]:
        return _TERMINATORS[self._state], True

    def _body(self, text: str) -> None:
        if self._state is _State.REASONING:
            self._emit(Reasoning(text))
        elif self._state is _State.CONTENT:
            self._content(text)
        elif text:
            self._call.append(text)

    def _content(self, text: str) -> None:
        text = self._space + text
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            self._after_call = False
            self._emit(Content(body))

    def _transition(self, tag: str) -> None:
        if tag == CALL_START:
            if self._state is _State.CALL:  # the open call was cut short: it was text after all
                self._content(self._call_space + CALL_START + "".join(self._call))
            self._call_space, self._space, self._call = self._space, "", []
            self._state = _State.CALL
        elif self._state is _State.CALL:  # CALL_END
            self._end_call("".join(self._call))
            self._call = []
            self._state = _State.CONTENT
        elif tag == THINK_END and self._state is _State.REASONING:
            self._state = _State.CONTENT
        # any other tag is stray here and dropped

    def _end_call(self, text: str) -> None:
        call = parse_call(text, self.strings)
        if call is None:
            self._content(self._call_space + CALL_START + text + CALL_END)
            return
        name, arguments = call
        self._emit(ToolCallStart(self._num_calls, name))
        self._emit(ToolArguments(self._num_calls, arguments))
        self._num_calls += 1
        self._after_call = True


def parse_call(text: str, strings: Mapping[str, frozenset[str]]) -> tuple[str, str] | None:
    """The name and JSON arguments of the call `text` (what lies between its tags); None if malformed."""
    head, _, _ = text.partition(KEY_START)
    name, pos, args = head.strip(), len(head), {}
    if not name or any(m in name for m in MARKERS):
        return None
    keep = strings.get(name, frozenset())
    while (pair := _PAIR.match(text, pos)) is not None:
        key, value = pair["key"].strip(), pair["value"]
        args[key] = value if key in keep else _json_or_text(value)
        pos = pair.end()
    if text[pos:].strip():
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _json_or_text(value: str) -> Any:
    """The JSON `value` parses as, else `value` itself (NaN and Infinity are not JSON)."""
    try:
        return json.loads(value, parse_constant=_not_json)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the JSON module goes
        return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")
