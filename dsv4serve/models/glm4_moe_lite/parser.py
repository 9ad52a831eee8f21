"""An incremental parser of GLM-4.7 output: reasoning, content and XML-ish tool calls as deltas.

The model writes (thinking on) `{reasoning}</think>{content}` and (thinking off) `{content}`, where
content may hold tool calls

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

each of which becomes an OpenAI tool call whose `arguments` is the JSON object `{"KEY": VALUE, ...}`.
A value is read without the whitespace around it, then copied as a string when the tool's schema
types that key `string` (GLM's template writes string values verbatim), else it is the JSON it
parses as (`42`, `true`, `["a"]`) or, when it does not parse, a string (vLLM's GLM parser reads
values the same way; xgrammar's GLM tool-call grammar allows that whitespace). A `<tool_call>` met in the
reasoning ends the reasoning.

Streaming: a call starts (`ToolCallStart`, then `{`) once its name is complete (at its first
`<arg_key>` or its `</tool_call>`); a string value streams as it is generated (JSON-escaped; its
whitespace held until more text follows), any
other value comes out at its `</arg_value>` (whether it parses as JSON is known only then); `}` at
the call's end. Once started, a call is a call: a key without a value is left out, text between the
pairs is dropped, a call cut short by another `<tool_call>` or by the end of the output is closed
with what it has. A call whose name is empty or holds markup (or that is still naming itself at the
end) comes out as content, verbatim.

Contract: `feed` may be given the text in any split; the concatenation of the deltas it and `finish`
return is the same for every split (a tail that might still start a tag is held back). Stray
`<think>`, `</think>` and `</tool_call>` in text are dropped. Whitespace between content and a tool
call, or between calls, is not content.
"""

from __future__ import annotations

import json
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


class _State(Enum):
    REASONING = auto()
    CONTENT = auto()
    NAME = auto()  # after `<tool_call>`: the name, up to the first tag
    CALL = auto()  # a started call, between its pairs
    KEY = auto()  # after `<arg_key>`
    PAIR = auto()  # after `</arg_key>`, before `<arg_value>`
    VALUE = auto()  # after `<arg_value>`


_IN_CALL = (KEY_START, CALL_END, CALL_START)
_TERMINATORS: dict[_State, tuple[str, ...]] = {
    _State.REASONING: (THINK_END, THINK_START, CALL_START, CALL_END),
    _State.CONTENT: (CALL_START, THINK_START, THINK_END, CALL_END),
    _State.NAME: MARKERS,
    _State.CALL: _IN_CALL,
    _State.KEY: (KEY_END, CALL_END, CALL_START),
    _State.PAIR: (VALUE_START, *_IN_CALL),
    _State.VALUE: (VALUE_END, CALL_END, CALL_START),
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
    _name: str = ""  # the name being read, then the open call's
    _key: str = ""  # the pair's key
    _value: str = ""  # a non-string value so far; a string value's whitespace not yet sent
    _string_value: bool = False
    _value_begun: bool = False  # a string value's first non-space character is sent
    _num_params: int = 0
    _space: str = ""  # content whitespace held until we know whether a tool call follows
    _call_space: str = ""  # the whitespace before the naming call (content again if it is not one)
    _after_call: bool = False  # content so far since the last call is whitespace
    _num_calls: int = 0

    def __post_init__(self) -> None:
        self._state = _State.REASONING if self.thinking else _State.CONTENT

    def finish(self) -> list[Delta]:
        """The end of the output: held text goes out, an open call is closed, a call still naming
        itself goes out as content."""
        rest, self._buf = self._buf, ""
        if self._state is _State.REASONING:
            self._emit(Reasoning(rest))
        elif self._state is _State.CONTENT:
            self._content(rest)
        elif self._state is _State.NAME:
            self._content(self._call_space + CALL_START + self._name + rest)
        else:
            self._body(rest)
            self._close_call()
        self._emit(Content(self._space))
        self._space = ""
        return self._take()

    def _emit(self, delta: Delta) -> None:
        if not isinstance(delta, Reasoning | Content) or delta.text:
            self._out.append(delta)

    def _args(self, text: str) -> None:
        self._out.append(ToolArguments(self._num_calls - 1, text))

    def _tags(self) -> tuple[tuple[str, ...], bool]:
        return _TERMINATORS[self._state], True

    def _body(self, text: str) -> None:
        match self._state:
            case _State.REASONING:
                self._emit(Reasoning(text))
            case _State.CONTENT:
                self._content(text)
            case _State.NAME:
                self._name += text
            case _State.KEY:
                self._key += text
            case _State.VALUE if self._string_value:
                text = self._value + (text if self._value_begun else text.lstrip())
                body = text.rstrip()
                self._value = text[len(body) :]
                if body:
                    self._value_begun = True
                    self._args(json.dumps(body, ensure_ascii=False)[1:-1])
            case _State.VALUE:
                self._value += text
            case _State.CALL | _State.PAIR:
                pass  # between a call's tags: not content

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
        state = self._state
        if state in (_State.REASONING, _State.CONTENT):
            if tag == CALL_START:
                self._open_call()
            elif tag == THINK_END and state is _State.REASONING:
                self._state = _State.CONTENT
            return  # any other tag is stray here and dropped
        if state is _State.NAME:
            self._named(tag)
        elif state is _State.KEY and tag == KEY_END:
            self._state = _State.PAIR
        elif state is _State.PAIR and tag == VALUE_START:
            self._start_value()
        elif state is _State.VALUE and tag == VALUE_END:
            self._end_value()
        elif tag == KEY_START:  # a new pair (a key read before it had no value: left out)
            self._key, self._state = "", _State.KEY
        else:  # CALL_END or CALL_START: the call ends here
            self._close_call()
            if tag == CALL_START:
                self._open_call()

    def _open_call(self) -> None:
        self._call_space, self._space, self._name = self._space, "", ""
        self._state = _State.NAME

    def _named(self, tag: str) -> None:
        """The name ends at `tag`: a call starts, or (no valid name) the text so far was content."""
        name = self._name.strip()
        if not name or tag not in (KEY_START, CALL_END):
            self._state = _State.CONTENT
            if tag == CALL_START:  # the text so far was content; a new call opens
                self._content(self._call_space + CALL_START + self._name)
                self._open_call()
            else:
                self._content(self._call_space + CALL_START + self._name + tag)
            return
        self._name, self._num_params = name, 0
        self._emit(ToolCallStart(self._num_calls, name))
        self._num_calls += 1
        self._args("{")
        self._state = _State.CALL
        self._transition(tag)

    def _start_value(self) -> None:
        self._string_value = self._key.strip() in self.strings.get(self._name, frozenset())
        key = json.dumps(self._key.strip(), ensure_ascii=False)
        quote = '"' if self._string_value else ""
        self._args(f"{', ' if self._num_params else ''}{key}: {quote}")
        self._num_params += 1
        self._value, self._value_begun, self._state = "", False, _State.VALUE

    def _end_value(self) -> None:
        if self._string_value:
            self._args('"')
        else:
            self._args(json.dumps(_json_or_text(self._value.strip()), ensure_ascii=False))
        self._value, self._state = "", _State.CALL

    def _close_call(self) -> None:
        """The open call ends: a value in progress is kept, a key without one left out."""
        if self._state is _State.VALUE:
            self._end_value()
        self._args("}")
        self._after_call, self._state = True, _State.CONTENT


def _json_or_text(value: str) -> Any:
    """The JSON `value` parses as, else `value` itself (NaN and Infinity are not JSON)."""
    try:
        return json.loads(value, parse_constant=_not_json)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the JSON module goes
        return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")
