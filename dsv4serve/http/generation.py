"""The engine requests behind one HTTP request (one per choice), through the `EngineHandle`.

They are submitted together (one refused: the others are cancelled and the HTTP request fails), their
events arrive on one channel, and `close()` cancels every one that has not ended, which frees its
memory: the HTTP request's end, its client's disconnect or an error all go through it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence

import trio

from dsv4serve.actors.system import EngineHandle
from dsv4serve.http.asgi import HttpError
from dsv4serve.protocol import DoneEvent, ErrorEvent, Event, RequestError, Submit, TokenEvent

STATUS_OF_CODE = {
    "invalid_request": 400,
    "context_too_long": 400,
    "unknown_id": 404,
    "duplicate_id": 409,
    "overloaded": 429,
    "internal": 500,
}


def http_error(code: str, message: str) -> HttpError:
    return HttpError(STATUS_OF_CODE.get(code, 500), message, code)


class Generation:
    def __init__(self, handle: EngineHandle, submits: Sequence[Submit]) -> None:
        self._handle = handle
        self._index = {s.rid: i for i, s in enumerate(submits)}
        self._live: set[str] = set()
        # unbounded: at most max_tokens + 1 events per choice; the tokenizer must never wait on a client
        self._send, self._recv = trio.open_memory_channel[Event](math.inf)
        try:
            for submit in submits:
                handle.submit(submit, self._send)
                self._live.add(submit.rid)
        except RequestError as err:
            self.close()
            raise http_error(err.code, err.message) from None

    async def events(self) -> AsyncIterator[tuple[int, TokenEvent | DoneEvent | ErrorEvent]]:
        """(choice index, event) until every choice has ended."""
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[tuple[int, TokenEvent | DoneEvent | ErrorEvent]]]:
        """The events as they come, each batch all that had arrived (one at least) when it was taken:
        a stream whose writer falls behind the engine catches up in fewer, larger writes."""
        while self._live:
            batch = [self._take(await self._recv.receive())]
            while self._live:
                try:
                    batch.append(self._take(self._recv.receive_nowait()))
                except trio.WouldBlock:
                    break
            yield batch

    def _take(self, event: Event) -> tuple[int, TokenEvent | DoneEvent | ErrorEvent]:
        assert isinstance(event, TokenEvent | DoneEvent | ErrorEvent), event
        if not isinstance(event, TokenEvent):
            self._live.discard(event.id or "")
        return self._index[event.id or ""], event

    def close(self) -> None:
        """Cancel what is still running (idempotent)."""
        self._recv.close()
        for rid in self._live:
            self._handle.cancel(rid)
        self._live.clear()
