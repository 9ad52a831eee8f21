"""The OpenAI-compatible ASGI app: routing, drain, and the completions / chat endpoints.

Every generation request holds its engine requests in a `Generation` that is closed (cancelling what
still runs) whether the request ends, fails, or its client disconnects. While draining, new
generation requests get 503 and `/health` says so; `drained` is set once none is in flight.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from dsv4serve.actors.system import EngineHandle
from dsv4serve.chat import ChatError, ChatTemplate
from dsv4serve.chat.grammar import json_output, strict_tools, tools_output, unforced
from dsv4serve.chat.messages import ChatPrompt, RenderedPrompt, prompt_of
from dsv4serve.http import schema as s
from dsv4serve.http.asgi import (
    ClientGone,
    HttpError,
    Receive,
    Responder,
    Scope,
    Send,
    read_body,
    until_disconnect,
)
from dsv4serve.http.generation import Generation, http_error
from dsv4serve.http.metrics import CONTENT_TYPE, Metrics
from dsv4serve.http.streams import ChatStream, CompletionStream, Stream
from dsv4serve.protocol import (
    DoneEvent,
    ErrorEvent,
    SamplingFields,
    SamplingParams,
    StructuredOutput,
    Submit,
    TokenEvent,
)

DEFAULT_CHAT_MAX_TOKENS = 1024
MAX_BODY_BYTES = 64 << 20
Handler = Callable[[Scope, Receive, Responder], Awaitable[None]]


@dataclass(frozen=True)
class AppOptions:
    model_name: str
    max_model_len: int
    max_body_bytes: int = MAX_BODY_BYTES
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    api_key: str | None = None  # every /v1/* request then needs `Authorization: Bearer <key>`
    stream_interval: int = 1  # a stream's tokens per chunk after its first (its end flushes the rest)


class OpenAIApp:
    def __init__(self, handle: EngineHandle, template: ChatTemplate, options: AppOptions) -> None:
        self.handle, self.template, self.options = handle, template, options
        self.metrics = Metrics(handle.stats, handle.on_end)
        self.draining = False
        self.drained = trio.Event()
        self.num_in_flight = 0
        self._log = structlog.get_logger().bind(actor="http")
        self._routes: dict[str, tuple[str, Handler]] = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/metrics": ("GET", self._metrics),
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
        }

    def begin_drain(self) -> None:
        """Refuse new generation requests (503); `drained` is set when the last one in flight ends."""
        if not self.draining:
            self.draining = True
            self._log.info("draining", in_flight=self.num_in_flight)
        if self.num_in_flight == 0:
            self.drained.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        out, path = Responder(send), scope["path"]
        try:
            _, handler = self._route(path, scope["method"])
            if path.startswith("/v1/"):
                self._authorize(scope)
            await handler(scope, receive, out)
        except HttpError as err:
            await out.error(err)
        except ClientGone:
            pass
        except Exception:  # a bug: logged, answered 500 if still possible; the server keeps serving
            self._log.exception("http_failed", path=path)
            if not out.started:
                await out.error(HttpError(500, "internal server error", "internal"))
        finally:
            endpoint = path if path in self._routes else "other"
            self.metrics.http_requests.labels(endpoint, str(out.status or 499)).inc()

    def _authorize(self, scope: Scope) -> None:
        """With an API key set: the request's bearer token must equal it (compared in constant time);
        /health and /metrics stay open, as in vLLM."""
        key = self.options.api_key
        if key is None:
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
        if not hmac.compare_digest(given, key.encode()):
            raise HttpError(401, "a valid API key is needed: Authorization: Bearer <key>", "invalid_api_key")

    def _route(self, path: str, method: str) -> tuple[str, Handler]:
        route = self._routes.get(path)
        if route is None:
            raise HttpError(404, f"no endpoint {path}", "not_found")
        if method != route[0]:
            raise HttpError(405, f"{path} takes {route[0]}, not {method}", "method_not_allowed")
        return route

    # ------------------------------------------------------------ small endpoints

    async def _health(self, scope: Scope, receive: Receive, out: Responder) -> None:
        await out.json({"status": "draining" if self.draining else "ok"}, 503 if self.draining else 200)

    async def _models(self, scope: Scope, receive: Receive, out: Responder) -> None:
        card = s.ModelCard(id=self.options.model_name, max_model_len=self.options.max_model_len)
        await out.json(s.ModelList(data=[card]))

    async def _metrics(self, scope: Scope, receive: Receive, out: Responder) -> None:
        await out.full(200, self.metrics.render(), CONTENT_TYPE.encode())

    # ------------------------------------------------------------ generation

    async def _completions(self, scope: Scope, receive: Receive, out: Responder) -> None:
        req = await self._read(scope, receive, s.CompletionRequest)
        rid = f"cmpl-{uuid.uuid4().hex}"
        submits = []
        try:
            prompts = req.prompts()
        except s.BadBody as err:
            raise HttpError(400, str(err), "invalid_request", err.param) from None
        if req.echo and req.logprobs is not None:
            why = "echo: with logprobs (the prompt's logprobs) is not supported; echo alone is"
            raise HttpError(400, why, "invalid_request", "echo")
        answer = req.response_format
        try:
            grammar = None if answer is None or answer.type == "text" else json_output(answer.schema(), False)
        except ChatError as err:
            raise HttpError(400, str(err), "invalid_request", "response_format") from None
        echoes = [self._echo_text(prompt) for prompt in prompts for _ in range(req.n)] if req.echo else None
        for p, prompt in enumerate(prompts):
            for j in range(req.n):
                text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
                logprobs = req.logprobs is not None
                top = req.logprobs or 0
                k = p * req.n + j
                one = _submit(f"{rid}-{k}", text, ids, req, req.max_tokens, j, logprobs, top, grammar)
                submits.append(one)
        stream = CompletionStream(rid, req, self.handle.decoder, echoes)
        await self._generate(scope, receive, out, submits, stream)

    def _echo_text(self, prompt: str | list[int]) -> str:
        """What `echo` puts before a choice's text: a text prompt as given, token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return "".join(self.handle.decoder.decode(prompt))  # one list of ids decodes to one str

    async def _chat(self, scope: Scope, receive: Receive, out: Responder) -> None:
        req = await self._read(scope, receive, s.ChatRequest)
        try:
            prompt = prompt_of(
                tuple(req.messages),
                tuple(req.tools or ()),
                req.tool_choice or ("auto" if req.tools else "none"),
                req.thinking,
                req.reasoning_effort,
                req.chat_template_kwargs,
            )
            rendered, structured = self._render(req, prompt)
        except ChatError as err:
            raise HttpError(400, str(err), "invalid_request") from None
        max_tokens = req.max_completion_tokens or req.max_tokens or self.options.default_chat_max_tokens
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        top = req.top_logprobs or 0
        submits = [
            _submit(f"{rid}-{j}", rendered.text, None, req, max_tokens, j, req.logprobs, top, structured)
            for j in range(req.n)
        ]
        stream = ChatStream(rid, req, self.handle.decoder, self.template, rendered)
        await self._generate(scope, receive, out, submits, stream)

    def _render(
        self, req: s.ChatRequest, prompt: ChatPrompt
    ) -> tuple[RenderedPrompt, StructuredOutput | None]:
        """The prompt and its grammar: a JSON answer (`response_format`), or strict tool calls (the
        grammar, not a prefill, then forces `required` / a named tool)."""
        answer = req.response_format is not None and req.response_format.type != "text"
        grammar_format = self.template.grammar_format
        strict = grammar_format is not None and strict_tools(prompt)
        if answer and strict:
            why = "response_format: not with strict tools (each would constrain the whole answer)"
            raise HttpError(400, why, "invalid_request", "response_format")
        rendered = self.template.render(unforced(prompt) if strict else prompt)
        if answer and rendered.prefill:
            why = "response_format: not with a forced tool call (tool_choice required or a named tool)"
            raise HttpError(400, why, "invalid_request", "response_format")
        if answer:
            assert req.response_format is not None
            return rendered, json_output(req.response_format.schema(), rendered.thinking)
        if strict:
            assert grammar_format is not None
            parallel = req.parallel_tool_calls is not False
            return rendered, tools_output(grammar_format, prompt, rendered.thinking, parallel)
        return rendered, None

    async def _read(
        self, scope: Scope, receive: Receive, kind: type[s.CompletionRequest] | type[s.ChatRequest]
    ) -> Any:
        if self.draining:
            raise HttpError(503, "the server is draining; retry on another replica", "draining")
        body = await read_body(scope, receive, self.options.max_body_bytes)
        try:
            req = s.decode(body, kind)
        except s.BadBody as err:
            raise HttpError(400, str(err), "invalid_request", err.param) from None
        if req.model != self.options.model_name:
            raise HttpError(
                404,
                f"model: {req.model!r} is not served here (try {self.options.model_name!r})",
                "model_not_found",
                "model",
            )
        return req

    async def _generate(
        self, scope: Scope, receive: Receive, out: Responder, submits: list[Submit], stream: Stream
    ) -> None:
        if self.draining:
            raise HttpError(503, "the server is draining; retry on another replica", "draining")
        self.num_in_flight += 1
        generation: Generation | None = None
        try:
            generation = Generation(self.handle, submits)
            body = self._stream if stream.streaming else self._whole
            run = generation

            async def answer() -> None:
                await body(run, out, stream)

            if await until_disconnect(receive, out, answer):
                self._log.info("client_gone", id=stream.id)
        finally:
            if generation is not None:
                generation.close()
            self.num_in_flight -= 1
            if self.draining and self.num_in_flight == 0:
                self.drained.set()

    async def _whole(self, generation: Generation, out: Responder, stream: Stream) -> None:
        done: dict[int, DoneEvent] = {}
        async for index, event in generation.events():
            if isinstance(event, ErrorEvent):
                raise http_error(event.code, event.message)
            if isinstance(event, DoneEvent):
                done[index] = event
                self.metrics.finished(event)
        await out.json(stream.whole([done[i] for i in range(len(done))]))

    async def _stream(self, generation: Generation, out: Responder, stream: Stream) -> None:
        """Server-sent events, one per chunk; the chunks of every event that has arrived go out in one
        write, a choice's tokens that arrived together in one chunk (one chunk a token while the client
        keeps up; fewer, larger ones when the writer falls behind the engine). With `stream_interval`
        n > 1, a choice's tokens after its first wait until n are there (or it ends): fewer writes."""
        held = _Held(self.options.stream_interval)
        try:
            async for batch in generation.batches():
                events: list[object] = []
                for index, event in held.release(_merged(batch)):
                    if isinstance(event, ErrorEvent):
                        await out.sse(*events)
                        raise http_error(event.code, event.message)
                    if not out.started:
                        await out.sse_start()
                        events += stream.opening()
                    if isinstance(event, DoneEvent):
                        self.metrics.finished(event)
                    events += stream.chunks(index, event)
                await out.sse(*events)
        except HttpError as err:
            await out.error(err)
            return
        usage = stream.usage_chunk()
        await out.sse_done(*([] if usage is None else [usage]))


Indexed = tuple[int, TokenEvent | DoneEvent | ErrorEvent]


class _Held:
    """`stream_interval`: a choice's first token passes at once; later ones are held until `interval`
    of them are there, and go as one event; an end (or an error) releases what its choice holds."""

    def __init__(self, interval: int) -> None:
        self.interval, self.held, self.started = interval, dict[int, TokenEvent](), set[int]()

    def release(self, batch: list[Indexed]) -> list[Indexed]:
        if self.interval <= 1:
            return batch
        out: list[Indexed] = []
        for index, event in batch:
            if not isinstance(event, TokenEvent):
                if (held := self.held.pop(index, None)) is not None:
                    out.append((index, held))
                out.append((index, event))
            elif index not in self.started:
                self.started.add(index)
                out.append((index, event))
            else:
                held = self.held.get(index)
                joined = event if held is None else _joined(held, event)
                if len(joined.token_ids) >= self.interval:
                    self.held.pop(index, None)
                    out.append((index, joined))
                else:
                    self.held[index] = joined
        return out


def _merged(batch: list[Indexed]) -> list[Indexed]:
    """The batch with each run of one choice's consecutive token events as one event."""
    out: list[Indexed] = []
    for index, event in batch:
        if out and isinstance(event, TokenEvent) and isinstance(out[-1][1], TokenEvent):
            last = out[-1][1]
            if last.id == event.id:
                out[-1] = (index, _joined(last, event))
                continue
        out.append((index, event))
    return out


def _joined(a: TokenEvent, b: TokenEvent) -> TokenEvent:
    return TokenEvent(
        id=a.id, token_ids=a.token_ids + b.token_ids, text=a.text + b.text, prompt_tokens=a.prompt_tokens
    )


def _submit(
    rid: str,
    text: str | None,
    ids: tuple[int, ...] | None,
    req: s.CompletionRequest | s.ChatRequest,
    max_tokens: int,
    j: int,
    logprobs: bool,
    top_logprobs: int,
    structured: StructuredOutput | None,
) -> Submit:
    """One choice's engine request; choice j of a seeded request gets seed + j (choices differ)."""
    shared = {name: getattr(req, name) for name in SamplingFields.__struct_fields__}
    seed = None if req.seed is None else req.seed + j
    fields = {"max_tokens": max_tokens, "stop": req.stops, "logprobs": logprobs, "top_logprobs": top_logprobs}
    fields["structured"] = structured
    try:
        params = SamplingParams(**{**shared, "seed": seed, **fields})
    except ValueError as err:
        raise HttpError(400, str(err), "invalid_request", str(err).split(":")[0]) from None
    return Submit(rid=rid, prompt=text, prompt_token_ids=ids, params=params, stream=req.stream)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
