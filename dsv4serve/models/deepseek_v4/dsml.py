"""An incremental parser of DeepSeek-V4 output: reasoning, content and DSML tool calls as deltas.

The model writes (thinking mode) `{reasoning}</think>{content}\\n\\n<｜DSML｜tool_calls>...` and in chat
mode starts at `{content}`. A tool-call block is

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    ...
    </｜DSML｜invoke>
    ...
    </｜DSML｜tool_calls>

and each invoke becomes an OpenAI tool call whose `arguments` is the JSON object
`{"KEY": VALUE, ...}` (a `string="true"` value JSON-quoted, any other value copied as written),
streamed as the value's text arrives.

Contract: `feed` may be given the text in any split; the concatenation of the deltas it and `finish`
return is the same for every split (a tail that might still start a tag is held back), and
`Reasoning` / `Content` text never holds `<think>`, `</think>` or any part of a DSML tag (the DSML
marker `｜DSML｜` included): markup the grammar does not expect is dropped, never shown.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum, auto

from dsv4serve.chat.deltas import (
    Content,
    Delta,
    ParsedOutput,
    Reasoning,
    TagStream,
    ToolArguments,
    ToolCallStart,
    collect,
)

DSML = "｜DSML｜"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_BLOCK = "tool_calls"
MARKERS = (THINK_START, THINK_END, DSML)  # never in reasoning or content

_OPEN, _CLOSE = "<" + DSML, "</" + DSML
_INVOKE, _INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
_PARAM, _PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"
_BLOCK_END = f"</{DSML}{TOOL_BLOCK}>"
_NAME = re.compile(r'name="(?P<name>[^"]*)"')
_STRING = re.compile(r'string="(?P<string>true|false)"')
_MAX_NEWLINES = 2  # newlines before a tool block belong to its start tag, not to the content


class _State(Enum):
    REASONING = auto()
    CONTENT = auto()
    TAG = auto()  # after `<｜DSML｜` (or `</｜DSML｜`) outside a block: read up to `>`
    BLOCK = auto()  # inside the block, between invokes
    INVOKE_HEAD = auto()  # after `<｜DSML｜invoke`: read up to `>`
    INVOKE = auto()  # between parameters
    PARAM_HEAD = auto()  # after `<｜DSML｜parameter`: read up to `>`
    VALUE = auto()  # a parameter's value, up to `</｜DSML｜parameter>`


_TERMINATORS: dict[_State, tuple[str, ...]] = {
    _State.REASONING: (_OPEN, _CLOSE, THINK_END, THINK_START, DSML),
    _State.CONTENT: (_OPEN, _CLOSE, THINK_END, THINK_START, DSML),
    _State.TAG: (">",),
    _State.BLOCK: (_INVOKE, _BLOCK_END),
    _State.INVOKE_HEAD: (">",),
    _State.INVOKE: (_PARAM, _INVOKE_END, _BLOCK_END),
    _State.PARAM_HEAD: (">",),
    _State.VALUE: (_PARAM_END, _INVOKE_END, _BLOCK_END),
}


_HEADS = (_State.TAG, _State.INVOKE_HEAD, _State.PARAM_HEAD)


@dataclass(eq=False, slots=True)
class DSMLParser(TagStream):
    """Feed text deltas, get `Delta`s; `thinking` starts in the reasoning (the prompt ended in `<think>`)."""

    thinking: bool = False
    _state: _State = _State.CONTENT
    _newlines: str = ""  # content newlines held until we know no tool block follows
    _closing: bool = False  # the TAG being read is a closing one
    _text_state: _State = _State.CONTENT  # where a stray tag returns to
    _in_block: bool = False  # the open invoke sits in a tool_calls block
    _head: str = ""  # the text of the tag head just read
    _num_calls: int = 0
    _num_params: int = 0
    _string_value: bool = False

    def __post_init__(self) -> None:
        self._state = _State.REASONING if self.thinking else _State.CONTENT

    def finish(self) -> list[Delta]:
        """The end of the output: held text goes out; an unfinished tag is dropped."""
        rest, self._buf = self._buf, ""
        if self._state is _State.CONTENT:
            self._text(self._newlines + rest)
        elif self._state is _State.REASONING:
            self._text(rest)
        elif self._state is _State.VALUE:
            self._value(rest)
        self._newlines = ""
        return self._take()

    def _tags(self) -> tuple[tuple[str, ...], bool]:
        return _TERMINATORS[self._state], self._state not in _HEADS  # a head is read whole, at its `>`

    def _body(self, text: str) -> None:
        match self._state:
            case _State.REASONING:
                self._text(text)
            case _State.CONTENT:
                self._content(text)
            case _State.VALUE:
                self._value(text)
            case _State.TAG | _State.INVOKE_HEAD | _State.PARAM_HEAD:
                self._head = text  # read whole: a terminator follows
            case _State.BLOCK | _State.INVOKE:
                pass  # whitespace between tags (anything else there is not ours to show)

    def _content(self, text: str) -> None:
        text = self._newlines + text
        body = text.rstrip("\n")
        self._newlines = text[len(body) :]
        if len(self._newlines) > _MAX_NEWLINES:
            body += self._newlines[:-_MAX_NEWLINES]
            self._newlines = self._newlines[-_MAX_NEWLINES:]
        self._text(body)

    def _text(self, text: str) -> None:
        if text:
            self._out.append(Reasoning(text) if self._state is _State.REASONING else Content(text))

    def _value(self, text: str) -> None:
        if text:
            piece = json.dumps(text, ensure_ascii=False)[1:-1] if self._string_value else text
            self._args(piece)

    def _args(self, text: str) -> None:
        self._out.append(ToolArguments(self._num_calls - 1, text))

    def _transition(self, tag: str) -> None:
        match self._state:
            case _State.REASONING | _State.CONTENT:
                self._after_text(tag)
            case _State.TAG:
                self._state = self._after_tag(self._head)
            case _State.INVOKE_HEAD:
                self._start_call(self._head)
                self._state = _State.INVOKE
            case _State.PARAM_HEAD:
                self._start_param(self._head)
                self._state = _State.VALUE
            case _State.BLOCK | _State.INVOKE | _State.VALUE:
                self._after_structure(tag)

    def _after_text(self, tag: str) -> None:
        if tag == THINK_END and self._state is _State.REASONING:
            self._state = _State.CONTENT
        elif tag in (_OPEN, _CLOSE, DSML):
            self._newlines = ""  # a tool block's start tag owns the newlines before it
            self._closing = tag == _CLOSE
            self._text_state = self._state
            self._state = _State.TAG
        # a stray <think> / </think> is dropped

    def _after_tag(self, head: str) -> _State:
        """A DSML tag met in text: a block's start, a bare invoke, or a stray tag (dropped)."""
        if self._closing or not head.startswith(("invoke", TOOL_BLOCK, "function_calls")):
            return self._text_state
        self._in_block = not head.startswith("invoke")
        if self._in_block:
            return _State.BLOCK
        self._start_call(head)
        return _State.INVOKE

    def _start_call(self, head: str) -> None:
        name = _NAME.search(head)
        self._num_calls += 1
        self._num_params = 0
        self._out.append(ToolCallStart(self._num_calls - 1, name["name"] if name else ""))
        self._args("{")

    def _start_param(self, head: str) -> None:
        name, string = _NAME.search(head), _STRING.search(head)
        self._string_value = string is None or string["string"] == "true"
        key = json.dumps(name["name"] if name else "", ensure_ascii=False)
        self._args(f"{', ' if self._num_params else ''}{key}: {self._quote()}")
        self._num_params += 1

    def _quote(self) -> str:
        return '"' if self._string_value else ""

    def _after_structure(self, tag: str) -> None:
        """Tags inside a block or an invoke (a missing close tag is supplied)."""
        if tag == _INVOKE:
            self._state = _State.INVOKE_HEAD
        elif tag == _PARAM:
            self._state = _State.PARAM_HEAD
        elif tag == _PARAM_END:
            self._args(self._quote())
            self._state = _State.INVOKE
        else:  # the invoke or the block ends
            if self._state is _State.VALUE:
                self._args(self._quote())
            if self._state in (_State.VALUE, _State.INVOKE):
                self._args("}")
            in_block = self._in_block and tag == _INVOKE_END
            self._state = _State.BLOCK if in_block else _State.CONTENT


def parse_output(text: str, thinking: bool = False) -> ParsedOutput:
    """The whole output at once (what the streamed deltas add up to)."""
    parser = DSMLParser(thinking)
    return collect([*parser.feed(text), *parser.finish()])
