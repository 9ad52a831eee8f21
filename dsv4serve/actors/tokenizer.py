"""The tokenizer actor: prompts -> `Tokenized`; sampled ids -> text deltas, stop strings, client events.

It is the only actor that talks to clients: every accepted request ends here with exactly one
terminal event (`done` or `error`). `Clients` is the boundary registry of the live requests' event
channels: the engine handle adds entries and marks cancels, this actor ends them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, assert_never

import structlog
import trio

from dsv4serve.actors.tokenizer_core import IncrementalDetokenizer, StopMatcher, SupportsDecode
from dsv4serve.chat.grammar import GrammarCheck
from dsv4serve.chat.grammar import check as check_grammar
from dsv4serve.protocol import (
    CancelRequest,
    Detokenize,
    DoneEvent,
    Drain,
    ErrorCode,
    ErrorEvent,
    Event,
    FailRequest,
    FinishReason,
    Outputs,
    SchedulerMsg,
    StopHit,
    StructuredOutput,
    Submit,
    Timing,
    TokenEvent,
    Tokenized,
    TokenizerMsg,
    TopLogprobs,
    Usage,
)

Encode = Callable[[str], list[int]]


@dataclass(eq=False, slots=True)
class Client:
    events: trio.MemorySendChannel[Event]
    arrival: float  # trio.current_time() when accepted
    ended: bool = False  # its terminal event is out (or being sent)
    cancelled: bool = False  # a cancel was issued (by the handle, or because the client went away)
    cancel_pending: bool = False  # that cancel has not reached the tokenizer yet
    awaiting_engine: bool = False  # ended by the tokenizer while the scheduler still holds it


class Clients:
    """rid -> Client of every accepted request until it ended; an ended entry lingers while a cancel
    for it is still on its way, or while the scheduler's last message for it is (so the id is not
    reused under a stale message)."""

    def __init__(self) -> None:
        self._by_rid: dict[str, Client] = {}
        self.num_live = 0
        self.ended_by_reason: dict[str, int] = {}  # every accepted request once, by how it ended
        self.watchers: list[Callable[[str], None]] = []  # told each end's reason (metrics)

    def get(self, rid: str) -> Client | None:
        return self._by_rid.get(rid)

    def add(self, rid: str, client: Client) -> None:
        assert rid not in self._by_rid, rid
        self._by_rid[rid] = client
        self.num_live += 1

    def end(self, rid: str, reason: FinishReason | Literal["error"]) -> Client:
        client = self._by_rid[rid]
        assert not client.ended, f"{rid} ended twice"
        client.ended = True
        self.num_live -= 1
        self.ended_by_reason[reason] = self.ended_by_reason.get(reason, 0) + 1
        for watch in self.watchers:
            watch(reason)
        self._forget_if_done(rid, client)
        return client

    def cancel_arrived(self, rid: str) -> Client | None:
        client = self._by_rid.get(rid)
        if client is not None:
            client.cancel_pending = False
            self._forget_if_done(rid, client)
        return client

    def engine_released(self, rid: str) -> None:
        """The scheduler's last message for a request the tokenizer had ended already."""
        client = self._by_rid.get(rid)
        if client is not None and client.awaiting_engine:
            client.awaiting_engine = False
            self._forget_if_done(rid, client)

    def _forget_if_done(self, rid: str, client: Client) -> None:
        if client.ended and not client.cancel_pending and not client.awaiting_engine:
            del self._by_rid[rid]

    def live(self) -> list[tuple[str, Client]]:
        return [(rid, c) for rid, c in self._by_rid.items() if not c.ended]


@dataclass(eq=False, slots=True)
class _Output:
    prompt_ids: tuple[int, ...]
    echo_prompt: bool
    stream: bool
    want_logprobs: bool
    want_top: bool
    detok: IncrementalDetokenizer
    stops: StopMatcher
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    announced: bool = False  # a token event sent (the first carries the prompt's length)
    min_tokens: int = 0  # stop strings are not looked for in the text of the first min_tokens ids


@dataclass(eq=False)
class _Tokenizer:
    scheduler: trio.MemorySendChannel[SchedulerMsg]
    clients: Clients
    encode: Encode
    decoder: SupportsDecode
    max_model_len: int
    max_token_chars: int | None = None  # the longest token's text: longer prompts cannot fit
    vocab_size: int | None = None  # the model's: a tokenizer that yields ids past it is refused
    outputs: dict[str, _Output] = field(default_factory=dict)
    grammar_check: Callable[[StructuredOutput], None] = check_grammar  # the front's compile of a grammar
    log: structlog.typing.FilteringBoundLogger = field(
        default_factory=lambda: structlog.get_logger().bind(actor="tokenizer")
    )

    async def submit(self, msg: Submit) -> None:
        try:
            stops = StopMatcher(msg.params.stop)
        except ValueError as exc:  # TokenizerError: its message names `stop`
            await self.fail(msg.rid, "invalid_request", str(exc))
            return
        if msg.params.structured is not None:  # its grammar compiles (as the core's will)
            try:
                await trio.to_thread.run_sync(self.grammar_check, msg.params.structured)
            except ValueError as exc:
                await self.fail(msg.rid, "invalid_request", str(exc))
                return
            except Exception as exc:  # a fault of the grammar engine (or its import): this request's
                await self.fault(msg.rid, "grammar_failed", exc)
                return
        limit = None if self.max_token_chars is None else self.max_token_chars * self.max_model_len
        if msg.prompt is not None and limit is not None and len(msg.prompt) > limit:  # before encoding it
            why = f"prompt ({len(msg.prompt)} characters) cannot fit in max_model_len ({self.max_model_len})"
            await self.fail(
                msg.rid, "context_too_long", f"{why}: no token is longer than {self.max_token_chars}"
            )
            return
        try:
            ids = msg.prompt_token_ids
            if ids is None:
                assert msg.prompt is not None
                ids = tuple(await trio.to_thread.run_sync(self.encode, msg.prompt))
        except (ValueError, TypeError) as exc:  # TokenizerError, or text the tokenizer rejects
            why = str(exc) if str(exc).startswith("prompt") else f"prompt: {exc}"
            await self.fail(msg.rid, "invalid_request", why)
            return
        except Exception as exc:  # a tokenizer fault: contained to this request
            await self.fault(msg.rid, "encode_failed", exc)
            return
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:  # text prompts only
            why = f"prompt: the tokenizer gave token id {max(ids)}, outside the model's vocabulary"
            await self.fail(msg.rid, "invalid_request", f"{why} [0, {self.vocab_size})")
            return
        if len(ids) + msg.params.max_tokens > self.max_model_len:
            why = f"prompt ({len(ids)} tokens) + max_tokens ({msg.params.max_tokens}) > max_model_len"
            await self.fail(msg.rid, "context_too_long", f"{why} ({self.max_model_len})")
            return
        try:
            detok = IncrementalDetokenizer(self.decoder, ids)
        except Exception as exc:
            await self.fault(msg.rid, "detokenize_failed", exc)
            return
        spec = msg.params
        self.outputs[msg.rid] = _Output(
            ids, msg.echo_prompt, msg.stream, spec.logprobs, spec.top_logprobs > 0, detok, stops,
            min_tokens=spec.min_tokens,
        )  # fmt: skip
        await self.scheduler.send(Tokenized(rid=msg.rid, prompt_token_ids=ids, params=spec))

    async def tokens(self, msg: Detokenize) -> None:
        out = self.outputs.get(msg.rid)
        if out is None:  # ended here already (a detokenizer fault); the scheduler ends it too
            if msg.finish_reason is not None:
                self.clients.engine_released(msg.rid)
            return
        ids, text = list(msg.token_ids), ""
        if ids and out.first_token_at is None:
            out.first_token_at = trio.current_time()
        finishing = msg.finish_reason is not None
        if out.stops.matched is None:
            try:
                text, hit = _new_text(out, ids, msg.finish_reason)
            except Exception as exc:  # a detokenizer fault: contained to this request
                await self.fault(msg.rid, "detokenize_failed", exc, engine_holds=not finishing)
                return
            out.token_ids += ids
            out.logprobs += msg.logprobs or ()
            out.top_logprobs += msg.top_logprobs or ()
            if hit and not finishing:
                await self.scheduler.send(StopHit(rid=msg.rid))
            out.texts.append(text)
        else:
            ids = []  # generated after the stop string: dropped
        if out.stream and (ids or text):
            prompt = None if out.announced else len(out.prompt_ids)
            out.announced = True
            await self.emit(
                msg.rid, TokenEvent(id=msg.rid, token_ids=tuple(ids), text=text, prompt_tokens=prompt)
            )
        if msg.finish_reason is not None:
            reason: FinishReason = "stop" if out.stops.matched is not None else msg.finish_reason
            await self.done(msg.rid, reason, msg.num_preemptions)

    async def done(self, rid: str, reason: FinishReason, num_preemptions: int) -> None:
        out = self.outputs.pop(rid)
        client = self.clients.end(rid, reason)
        now = trio.current_time()
        total_ms = (now - client.arrival) * 1e3
        ttft_ms = ((out.first_token_at or now) - client.arrival) * 1e3
        usage = Usage(prompt_tokens=len(out.prompt_ids), completion_tokens=len(out.token_ids))
        self.log.info(
            "request",
            rid=rid,
            finish_reason=reason,
            prompt_tokens=len(out.prompt_ids),
            completion_tokens=usage.completion_tokens,
            ttft_ms=round(ttft_ms, 3),
            total_ms=round(total_ms, 3),
            preemptions=num_preemptions,
        )
        event = DoneEvent(
            id=rid,
            finish_reason=reason,
            token_ids=tuple(out.token_ids),
            text="".join(out.texts),
            usage=usage,
            timing=Timing(ttft_ms=ttft_ms, total_ms=total_ms),
            logprobs=tuple(out.logprobs) if out.want_logprobs else None,
            top_logprobs=tuple(out.top_logprobs) if out.want_top else None,
            prompt_token_ids=out.prompt_ids if out.echo_prompt else None,
        )
        await self.emit_terminal(rid, event, client)

    async def fault(self, rid: str, what: str, exc: Exception, engine_holds: bool = False) -> None:
        """End `rid` with an `internal` error after a fault in the tokenizer's own work; if the
        scheduler still holds it, cancel it there (its last message is then dropped)."""
        self.log.exception(what, rid=rid)
        client = self.clients.get(rid)
        assert client is not None, rid
        client.awaiting_engine = engine_holds
        await self.fail(rid, "internal", f"{what.replace('_', ' ')}: {type(exc).__name__}: {exc}")
        if engine_holds:
            await self.scheduler.send(CancelRequest(rid=rid))

    async def fail(self, rid: str, code: ErrorCode, message: str) -> None:
        client = self.clients.get(rid)
        if client is not None and client.ended and client.awaiting_engine:  # the scheduler's last word
            self.clients.engine_released(rid)
            return
        self.outputs.pop(rid, None)
        client = self.clients.end(rid, "error")
        self.log.info("request", rid=rid, finish_reason="error", code=code, message=message)
        await self.emit_terminal(rid, ErrorEvent(id=rid, code=code, message=message), client)

    async def emit_terminal(self, rid: str, event: DoneEvent | ErrorEvent, client: Client) -> None:
        """The client is ended already: a shutdown that cancels this send would leave the request
        with no terminal event (`_fail_live` skips ended ones), so then it goes in without waiting."""
        try:
            await self.emit(rid, event, client)
        except trio.Cancelled:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                client.events.send_nowait(event)
            raise

    async def cancel(self, msg: CancelRequest) -> None:
        client = self.clients.cancel_arrived(msg.rid)
        if client is not None and not client.ended and msg.rid in self.outputs:
            await self.scheduler.send(msg)

    async def emit(self, rid: str, event: Event, client: Client | None = None) -> None:
        """Send to the request's client; a client that went away gets its request cancelled."""
        client = client or self.clients.get(rid)
        assert client is not None, rid
        try:
            await client.events.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if not client.ended and not client.cancelled:
                self.log.info("client_gone", rid=rid)
                client.cancelled = True
                await self.scheduler.send(CancelRequest(rid=rid))


def _new_text(out: _Output, ids: list[int], finish_reason: FinishReason | None) -> tuple[str, bool]:
    """The text `ids` complete (stop strings applied; the tail flushed when the request finishes)."""
    # a "stop" that no stop string caused ends on a stop token: in the ids, not in the text
    stop_token = finish_reason == "stop" and bool(ids)
    delta = out.detok.push(ids[:-1] if stop_token else ids)
    if len(out.token_ids) + len(ids) <= out.min_tokens:  # as vLLM: no stop string within min_tokens
        if finish_reason is not None:
            delta += out.detok.flush()
        return delta, False
    text, hit = out.stops.push(delta)
    if finish_reason is not None and not hit:
        tail, hit = out.stops.push(out.detok.flush())
        text += tail if hit else tail + out.stops.flush()
    return text, hit


async def run_tokenizer(
    inbox: trio.MemoryReceiveChannel[TokenizerMsg],
    scheduler: trio.MemorySendChannel[SchedulerMsg],
    clients: Clients,
    encode: Encode,
    decoder: SupportsDecode,
    max_model_len: int,
    max_token_chars: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """The first Drain (from the handle, after every accepted Submit) goes on to the scheduler; the
    second (the scheduler's, after every request's last message) ends the actor."""
    state = _Tokenizer(scheduler, clients, encode, decoder, max_model_len, max_token_chars, vocab_size)
    if vocab_size is not None:  # the model's tokenizer: grammars compile against its vocabulary
        state.grammar_check = GrammarCheck(decoder, vocab_size)
    num_drains = 0
    async with inbox, scheduler:
        async for msg in inbox:
            match msg:
                case Submit():
                    await state.submit(msg)
                case Outputs(items=items):
                    for item in items:
                        if isinstance(item, Detokenize):
                            await state.tokens(item)
                        else:
                            await state.fail(item.rid, item.code, item.message)
                case Detokenize():
                    await state.tokens(msg)
                case FailRequest(rid=rid, code=code, message=message):
                    await state.fail(rid, code, message)
                case CancelRequest():
                    await state.cancel(msg)
                case Drain():
                    num_drains += 1
                    if num_drains == 2:
                        return
                    await scheduler.send(msg)
                case _:
                    assert_never(msg)
