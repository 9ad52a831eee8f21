"""Regressions found in review: each test failed before its fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import trio
import trio.testing
from test_actors import ENGINE, FakeDevice, letters, make_parts

from dsv4serve import stdio
from dsv4serve.actors.system import EngineHandle, SystemOptions, run_actors
from dsv4serve.memory import KVAllocator, Refusal
from dsv4serve.protocol import CacheLocs, DoneEvent, ErrorEvent, Event, SamplingParams, Submit, TokenEvent


async def test_shutdown_racing_a_terminal_send_still_ends_the_request(autojump_clock: object) -> None:
    """The tokenizer ended the client, then its DoneEvent send was cancelled by shutdown: the request
    got no terminal event at all (and `_fail_live` skipped it as ended)."""
    send, recv = trio.open_memory_channel[Event](2)
    filler = TokenEvent(id="filler", token_ids=(), text="")
    send.send_nowait(filler)
    send.send_nowait(filler)  # full: the tokenizer will block on the request's TokenEvent
    async with trio.open_nursery() as nursery:
        opts = SystemOptions(Path("unused"), ENGINE)
        handle: EngineHandle = await nursery.start(run_actors, make_parts(FakeDevice()), opts)
        handle.submit(
            Submit(
                rid="a",
                prompt=None,
                prompt_token_ids=tuple(letters("abc")),
                params=SamplingParams(max_tokens=1),
                stream=True,
            ),
            send,
        )
        while recv.statistics().tasks_waiting_send == 0:
            await trio.sleep(0.001)
        # room for two more events: the tokenizer's send completes, then (same tick) the engine stops
        assert recv.receive_nowait() == filler and recv.receive_nowait() == filler
        handle.shutdown()
    events = []
    while True:
        try:
            events.append(recv.receive_nowait())
        except trio.WouldBlock:
            break
    assert isinstance(events[0], TokenEvent) and events[0].id == "a"
    ends = [e for e in events if isinstance(e, DoneEvent | ErrorEvent)]
    assert len(ends) == 1, events


async def test_stdio_engine_crash_still_writes_the_accepted_requests_errors(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: object
) -> None:
    """When the engine crashed, `_fail_live` queued an `error` per accepted request, but the writer
    had been cancelled with the rest of the nursery: stdout never got them."""

    class BrokenAllocator(KVAllocator):  # a bug in a pure core still stops the engine
        def allocate(self, rid: str, prefix_len: int, seq_len: int, step: int) -> CacheLocs | Refusal:
            raise RuntimeError("allocator bug")

    parts = make_parts(FakeDevice())
    parts = dataclasses.replace(parts, allocator=BrokenAllocator(parts.model, ENGINE))

    async def fake_system(options: SystemOptions, *, task_status: trio.TaskStatus[EngineHandle]) -> None:
        await run_actors(parts, options, task_status=task_status)

    monkeypatch.setattr(stdio, "run_engine", fake_system)
    stdin_send, stdin_recv = trio.testing.memory_stream_one_way_pair()
    stdout = trio.testing.MemorySendStream()
    request = {"type": "generate", "id": "r", "prompt_token_ids": letters("abc"), "max_tokens": 2}
    await stdin_send.send_all(json.dumps(request).encode() + b"\n")
    with pytest.raises(BaseExceptionGroup):
        await stdio.serve(SystemOptions(Path("unused"), ENGINE), stdin_recv, stdout)
    try:
        written = stdout.get_data_nowait()
    except trio.WouldBlock:  # nothing was written
        written = b""
    lines = [json.loads(line) for line in written.splitlines()]
    assert [(e["type"], e["id"], e["code"]) for e in lines] == [("error", "r", "internal")], lines


async def test_failing_live_requests_waits_for_room_in_a_full_shared_channel(autojump_clock: object) -> None:
    """stdio's requests share one event channel: when the engine stopped while it was full (a slow
    stdout), the live requests' errors were dropped and those requests never ended."""
    from dsv4serve.actors.system import deliver, fail_live
    from dsv4serve.actors.tokenizer import Client, Clients
    from dsv4serve.protocol import Event

    send, recv = trio.open_memory_channel[Event](2)
    clients = Clients()
    for rid in ("a", "b", "c"):
        clients.add(rid, Client(send, arrival=0.0))
    send.send_nowait(ErrorEvent(id="x", code="internal", message="filler"))
    send.send_nowait(ErrorEvent(id="y", code="internal", message="filler"))
    got: list[Event] = []

    async def slow_reader() -> None:
        await trio.sleep(1.0)
        async for event in recv:
            got.append(event)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(slow_reader)
        undelivered = fail_live(clients, "stopped")  # every request ended at once; no room for their errors
        assert clients.live() == [] and len(undelivered) == 3
        await deliver(undelivered)
        send.close()
    assert [e.id for e in got] == ["x", "y", "a", "b", "c"]
    assert clients.live() == [] and clients.ended_by_reason == {"error": 3}
