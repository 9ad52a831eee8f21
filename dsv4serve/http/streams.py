"""Engine events -> OpenAI bodies: streamed chunks and whole responses, for completions and chat.

A chat choice's text goes through the template's output parser, so reasoning, content and tool
calls come out as their own deltas (tool arguments as they are generated) and no tool-call markup
reaches `content`. Streamed logprobs (and top logprobs) arrive in each choice's last chunk.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

import msgspec

from dsv4serve.actors.tokenizer_core import SupportsDecode
from dsv4serve.chat import ChatTemplate, OutputParser
from dsv4serve.chat.deltas import Content, Delta, Reasoning, ToolArguments, ToolCallStart, collect
from dsv4serve.chat.messages import RenderedPrompt
from dsv4serve.http import schema as s
from dsv4serve.protocol import DoneEvent, TokenEvent


class Stream(Protocol):
    id: str
    streaming: bool

    def opening(self) -> list[object]: ...

    def chunks(self, index: int, event: TokenEvent | DoneEvent) -> list[object]: ...

    def whole(self, dones: list[DoneEvent]) -> object: ...

    def usage_chunk(self) -> object | None: ...


def _usage(dones: list[DoneEvent]) -> s.Usage:
    prompt = sum(d.usage.prompt_tokens for d in dones)
    completion = sum(d.usage.completion_tokens for d in dones)
    return s.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _tokens(decoder: SupportsDecode, ids: tuple[int, ...]) -> list[str]:
    return [str(decoder.decode([i], skip_special_tokens=False)) for i in ids]


def _top_tokens(decoder: SupportsDecode, done: DoneEvent) -> list[list[tuple[str, float]]]:
    """Each position's top logprobs as (token text, logprob), most likely first; [] without them."""
    if done.top_logprobs is None:
        return [[] for _ in done.token_ids]
    return [
        list(zip(_tokens(decoder, tuple(t.token_id for t in row)), (t.logprob for t in row), strict=True))
        for row in done.top_logprobs
    ]


def _by_text(row: list[tuple[str, float]]) -> dict[str, float]:
    """The completions API's top logprobs: text -> logprob; ids that decode alike keep the likeliest."""
    out: dict[str, float] = {}
    for text, logprob in row:
        out.setdefault(text, logprob)
    return out


class _Base:
    def __init__(self, rid: str, req: s.CompletionRequest | s.ChatRequest, decoder: SupportsDecode) -> None:
        self.id, self.model, self.created = rid, req.model, int(time.time())
        self.streaming = req.stream
        self._include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self._continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        self._counts: dict[int, tuple[int, int]] = {}  # choice -> (prompt tokens, tokens generated so far)
        self._decoder = decoder
        self._dones: list[DoneEvent] = []

    def _running(self, index: int, event: TokenEvent | DoneEvent, chunks: list[Any]) -> list[object]:
        """`continuous_usage_stats`: each chunk carries the usage so far, over the choices seen."""
        if not self._continuous:
            return chunks
        prompt, generated = self._counts.get(index, (0, 0))
        if isinstance(event, TokenEvent):
            self._counts[index] = (event.prompt_tokens or prompt, generated + len(event.token_ids))
        else:
            self._counts[index] = (event.usage.prompt_tokens, event.usage.completion_tokens)
        p, g = (sum(c[i] for c in self._counts.values()) for i in (0, 1))
        usage = s.Usage(prompt_tokens=p, completion_tokens=g, total_tokens=p + g)
        return [msgspec.structs.replace(chunk, usage=usage) for chunk in chunks]

    def _finish_reason(self, done: DoneEvent) -> str:
        return "length" if done.finish_reason == "length" else "stop"


class CompletionStream(_Base):
    def __init__(
        self,
        rid: str,
        req: s.CompletionRequest,
        decoder: SupportsDecode,
        echoes: list[str] | None = None,  # `echo`: each choice's prompt text
    ) -> None:
        super().__init__(rid, req, decoder)
        self._echoes = echoes

    def opening(self) -> list[object]:
        return [
            self._chunk(s.CompletionChoice(index=i, text=text))
            for i, text in enumerate(self._echoes or ())
            if text
        ]

    def _chunk(self, choice: s.CompletionChoice, usage: s.Usage | None = None) -> s.CompletionResponse:
        return s.CompletionResponse(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage,
        )

    def _logprobs(self, done: DoneEvent) -> s.CompletionLogprobs | None:
        if done.logprobs is None:
            return None
        tokens = _tokens(self._decoder, done.token_ids)
        offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        tops = None
        if done.top_logprobs is not None:
            tops = [_by_text(row) for row in _top_tokens(self._decoder, done)]
        return s.CompletionLogprobs(
            tokens=tokens, token_logprobs=list(done.logprobs), top_logprobs=tops, text_offset=offsets
        )

    def chunks(self, index: int, event: TokenEvent | DoneEvent) -> list[object]:
        if isinstance(event, TokenEvent):
            text = [self._chunk(s.CompletionChoice(index=index, text=event.text))] if event.text else []
            return self._running(index, event, text)
        self._dones.append(event)
        choice = s.CompletionChoice(
            index=index, text="", finish_reason=self._finish_reason(event), logprobs=self._logprobs(event)
        )
        return self._running(index, event, [self._chunk(choice)])

    def whole(self, dones: list[DoneEvent]) -> object:
        choices = [
            s.CompletionChoice(
                index=i,
                text=(self._echoes[i] if self._echoes else "") + d.text,
                finish_reason=self._finish_reason(d),
                logprobs=self._logprobs(d),
            )
            for i, d in enumerate(dones)
        ]
        return s.CompletionResponse(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=_usage(dones),
        )

    def usage_chunk(self) -> object | None:
        if not self._include_usage:
            return None
        return s.CompletionResponse(
            id=self.id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=[],
            usage=_usage(self._dones),
        )


class _ChatChoice:
    def __init__(self, parser: OutputParser, prefill: list[Delta]) -> None:
        self.parser, self.pending = parser, list(prefill)
        self.call_ids: list[str] = []


class ChatStream(_Base):
    def __init__(
        self,
        rid: str,
        req: s.ChatRequest,
        decoder: SupportsDecode,
        template: ChatTemplate,
        rendered: RenderedPrompt,
    ) -> None:
        super().__init__(rid, req, decoder)
        self._template, self._rendered, self._thinking = template, rendered, rendered.thinking
        self._choices = [_ChatChoice(*template.parser(rendered)) for _ in range(req.n)]

    def _chunk(self, choices: list[s.ChunkChoice], usage: s.Usage | None = None) -> s.ChatChunk:
        return s.ChatChunk(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def opening(self) -> list[object]:
        deltas = [
            s.ChunkChoice(index=i, delta=s.MessageOut(role="assistant", content=""))
            for i in range(len(self._choices))
        ]
        return [self._chunk(deltas)]

    def chunks(self, index: int, event: TokenEvent | DoneEvent) -> list[object]:
        choice = self._choices[index]
        deltas, choice.pending = choice.pending, []
        if isinstance(event, TokenEvent):
            deltas += choice.parser.feed(event.text)
        else:
            deltas += choice.parser.finish()
        out: list[object] = [
            self._chunk([s.ChunkChoice(index=index, delta=m)]) for m in _messages(deltas, choice.call_ids)
        ]
        if isinstance(event, DoneEvent):
            self._dones.append(event)
            last = s.ChunkChoice(
                index=index,
                delta=s.MessageOut(),
                finish_reason=self._reason(event, choice),
                logprobs=self._logprobs(event),
            )
            out.append(self._chunk([last]))
        return self._running(index, event, out)

    def _reason(self, done: DoneEvent, choice: _ChatChoice) -> str:
        reason = self._finish_reason(done)
        return "tool_calls" if reason == "stop" and choice.call_ids else reason

    def _logprobs(self, done: DoneEvent) -> s.ChatLogprobs | None:
        if done.logprobs is None:
            return None
        tokens = _tokens(self._decoder, done.token_ids)
        tops = _top_tokens(self._decoder, done)
        content = [
            s.TokenLogprob(
                token=t,
                logprob=lp,
                bytes=list(t.encode()),
                top_logprobs=[s.TopLogprobOut(token=x, logprob=y, bytes=list(x.encode())) for x, y in top],
            )
            for t, lp, top in zip(tokens, done.logprobs, tops, strict=True)
        ]
        return s.ChatLogprobs(content=content)

    def whole(self, dones: list[DoneEvent]) -> object:
        choices = []
        for i, done in enumerate(dones):
            parser, prefill = self._template.parser(self._rendered)
            parsed = collect([*prefill, *parser.feed(done.text), *parser.finish()])
            calls = [
                s.ToolCallOut(
                    id=_call_id(), type="function", function=s.FunctionOut(name=c.name, arguments=c.arguments)
                )
                for c in parsed.tool_calls
            ]
            message = s.MessageOut(
                role="assistant",
                content=parsed.content if parsed.content or not calls else None,
                reasoning_content=parsed.reasoning if self._thinking else None,
                tool_calls=calls or None,
            )
            reason = self._finish_reason(done)
            reason = "tool_calls" if reason == "stop" and calls else reason
            choices.append(
                s.ChatChoice(index=i, message=message, finish_reason=reason, logprobs=self._logprobs(done))
            )
        return s.ChatResponse(
            id=self.id,
            object="chat.completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=_usage(dones),
        )

    def usage_chunk(self) -> object | None:
        return self._chunk([], _usage(self._dones)) if self._include_usage else None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _messages(deltas: list[Delta], call_ids: list[str]) -> list[s.MessageOut]:
    """Parser deltas as stream deltas: runs of one kind joined, a call's start and arguments merged."""
    runs: list[list[object]] = []  # [kind, index, text, name]
    for d in deltas:
        match d:
            case Reasoning(text=text) | Content(text=text):
                kind = "reasoning" if isinstance(d, Reasoning) else "content"
                if runs and runs[-1][0] == kind:
                    runs[-1][2] = str(runs[-1][2]) + text
                else:
                    runs.append([kind, -1, text, None])
            case ToolCallStart(index=index, name=name):
                call_ids.append(_call_id())
                runs.append(["start", index, "", name])
            case ToolArguments(index=index, text=text):
                if runs and runs[-1][0] in ("start", "args") and runs[-1][1] == index:
                    runs[-1][2] = str(runs[-1][2]) + text
                else:
                    runs.append(["args", index, text, None])
    return [_message(run, call_ids) for run in runs]


def _message(run: list[object], call_ids: list[str]) -> s.MessageOut:
    kind, index, text, name = run
    assert isinstance(index, int) and isinstance(text, str)
    if kind == "reasoning":
        return s.MessageOut(reasoning_content=text)
    if kind == "content":
        return s.MessageOut(content=text)
    if kind == "start":
        fn = s.FunctionOut(name=str(name), arguments=text)
        return s.MessageOut(
            tool_calls=[s.ToolCallOut(index=index, id=call_ids[index], type="function", function=fn)]
        )
    return s.MessageOut(tool_calls=[s.ToolCallOut(index=index, function=s.FunctionOut(arguments=text))])
