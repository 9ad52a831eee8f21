"""ASGI plumbing for the OpenAI app: bodies with a size limit, JSON and SSE responses, OpenAI error
objects, and running a handler until it ends or its client disconnects."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import msgspec
import trio

from dsv4serve.http.schema import ErrorBody, ErrorResponse

Scope: TypeAlias = dict[str, Any]
Message: TypeAlias = dict[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
_ENCODER = msgspec.json.Encoder()
DRAIN_FACTOR = 4


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> bytes:
        kind = ERROR_TYPES.get(self.status, "internal_error")
        return _ENCODER.encode(
            ErrorResponse(error=ErrorBody(message=self.message, type=kind, param=self.param, code=self.code))
        )


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body; 413 past `limit` bytes. The rest of a too-large body is read and dropped
    (up to DRAIN_FACTOR * limit), so that the client, still sending, gets to read the 413."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > DRAIN_FACTOR * limit:
            break
    if size > limit:
        raise HttpError(413, f"request body larger than {limit} bytes", "request_too_large")
    return b"".join(chunks)


class Responder:
    """One response: `started` once its status line is out (after that, errors go in the body)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False  # the last body message is out (or going)
        self.status = 0

    async def start(
        self, status: int, content_type: bytes, extra: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        assert not self.started, "one response per request"
        self.started, self.status = True, status
        headers = [(b"content-type", content_type), *extra]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = False) -> None:
        self.complete = not more
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def full(self, status: int, data: bytes, content_type: bytes = b"application/json") -> None:
        await self.start(status, content_type)
        await self.body(data)

    async def json(self, value: object, status: int = 200) -> None:
        await self.full(status, _ENCODER.encode(value))

    async def error(self, err: HttpError) -> None:
        if not self.started:
            await self.full(err.status, err.body())
        else:  # a stream already under way: the error is its last event
            await self.body(b"data: " + err.body() + b"\n\ndata: [DONE]\n\n")

    async def sse_start(self) -> None:
        await self.start(200, b"text/event-stream", ((b"cache-control", b"no-cache"),))

    async def sse(self, *values: object) -> None:
        """One event per value, in one write (none for no values)."""
        if values:
            await self.body(_events(values), more=True)

    async def sse_done(self, *values: object) -> None:
        """The last events, then the stream's end."""
        await self.body(_events(values) + b"data: [DONE]\n\n")


def _events(values: tuple[object, ...]) -> bytes:
    return b"".join(b"data: " + _ENCODER.encode(v) + b"\n\n" for v in values)


async def until_disconnect(receive: Receive, out: Responder, body: Callable[[], Awaitable[None]]) -> bool:
    """Run `body` until it returns or the client disconnects before the response is complete (then it
    is cancelled); True if it did."""
    disconnected = False
    failure: Exception | None = None  # raised as itself, not in an exception group

    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            if out.complete:
                return
            disconnected = True
            nursery.cancel_scope.cancel()

        async def run() -> None:
            nonlocal failure
            try:
                await body()
            except Exception as exc:
                failure = exc
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        nursery.start_soon(run)
    if failure is not None:
        raise failure
    return disconnected
