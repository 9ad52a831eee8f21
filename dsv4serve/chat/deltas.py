"""What a chat output parser yields (reasoning, content and tool-call deltas, and their sum), and the
two tag-scanning helpers the parsers share."""

from __future__ import annotations

from dataclasses import dataclass
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
