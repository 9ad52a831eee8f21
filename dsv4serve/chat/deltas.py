"""What a chat output parser yields (reasoning, content and tool-call deltas, and their sum), the
tag-scanning helpers the parsers share, and their feed loop (`TagStream`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order of the output
    name: str


@dataclass(frozen=True, slots=True)
class ToolArguments:
    index: int
    text: str  # the next piece of the call's JSON arguments


Delta: TypeAlias = Reasoning | Content | ToolCallStart | ToolArguments


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (complete when the model closed the call)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]


def collect(deltas: list[Delta]) -> ParsedOutput:
    reasoning, content = [], []
    names: list[str] = []
    arguments: list[list[str]] = []
    for delta in deltas:
        match delta:
            case Reasoning(text=text):
                reasoning.append(text)
            case Content(text=text):
                content.append(text)
            case ToolCallStart(name=name):
                names.append(name)
                arguments.append([])
            case ToolArguments(index=index, text=text):
                arguments[index].append(text)
    calls = tuple(ToolCall(n, "".join(a)) for n, a in zip(names, arguments, strict=True))
    return ParsedOutput("".join(reasoning), "".join(content), calls)


def find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest tag in `text` (at one start: the longest)."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(tag) > len(best[1]))):
            best = (at, tag)
    return best


def held(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of a tag."""
    for size in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        tail = text[-size:]
        if any(t.startswith(tail) for t in tags):
            return size
    return 0


def split_at_tag(buf: str, tags: tuple[str, ...], hold: bool = True) -> tuple[str, str | None, str]:
    """(the text before `buf`'s first tag, the tag, the text after it). With no tag in `buf`: (all but
    a tail that may begin a tag, None, that tail), or, not `hold`ing (a head read whole at its
    terminator), ("", None, buf)."""
    found = find_first(buf, tags)
    if found is None:
        keep = held(buf, tags) if hold else len(buf)
        return buf[: len(buf) - keep], None, buf[len(buf) - keep :]
    start, tag = found
    return buf[:start], tag, buf[start + len(tag) :]


@dataclass(eq=False, slots=True, kw_only=True)
class TagStream:
    """The feed loop of a streaming tag parser (a dataclass with a state): each step consumes the
    buffer up to the state's next tag (`_tags`: the tags, and whether a tail that may begin one is held
    back or the text is read whole at its tag), hands the text before it to `_body` and the tag to
    `_transition`; `feed` returns the deltas they emitted."""

    _buf: str = ""
    _out: list[Delta] = field(default_factory=list)

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        while self._step():
            pass
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _step(self) -> bool:
        """Consume the buffer up to the state's next tag; False when it needs more text."""
        body, tag, self._buf = split_at_tag(self._buf, *self._tags())
        self._body(body)
        if tag is None:
            return False
        self._transition(tag)
        return True

    def _tags(self) -> tuple[tuple[str, ...], bool]:
        raise NotImplementedError

    def _body(self, text: str) -> None:
        raise NotImplementedError

    def _transition(self, tag: str) -> None:
        raise NotImplementedError
