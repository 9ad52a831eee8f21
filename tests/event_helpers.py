"""Reading a request's event channel to its end, for the actor and system tests."""

from __future__ import annotations

import math

import trio

from dsv4serve.protocol import DoneEvent, ErrorEvent, Event


async def events_of(recv: trio.MemoryReceiveChannel[Event], timeout_s: float = math.inf) -> list[Event]:
    """Every event up to and including the terminal one. Leave `timeout_s` unbounded under the
    autojump clock: it jumps to the deadline while the system waits on a worker thread."""
    out: list[Event] = []
    with trio.fail_after(timeout_s):
        async for event in recv:
            out.append(event)
            if isinstance(event, DoneEvent | ErrorEvent):
                return out
    raise AssertionError(f"no terminal event: {out}")
