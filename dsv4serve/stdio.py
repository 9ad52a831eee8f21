"""`serve --stdio`: JSON-lines requests on stdin, one event per line on stdout.

Stdout carries protocol lines only: `run` moves the process's fd 1 onto stderr before anything
else can print, and writes events to a private duplicate of the original stdout. One writer task
owns that stream, so lines never interleave. Every bad line gets exactly one `error` event; every
accepted request ends with exactly one `done` or `error` (the system's promise). At EOF or on a
`shutdown` request the server stops reading, finishes what it accepted, and returns. SIGTERM and
SIGINT do the same, but give the drain `DRAIN_GRACE_S` (then, or at a second signal, every request
still live ends with an `internal` error). A client that closes stdout gets its requests cancelled.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeAlias, assert_never

import structlog
import trio

from dsv4serve import protocol
from dsv4serve.actors.front import run_engine
from dsv4serve.actors.system import EngineHandle, SystemOptions, is_core_death
from dsv4serve.protocol import ErrorEvent, Event, RequestError

MAX_LINE_BYTES = 64 << 20  # one request line (a long prompt_token_ids list fits comfortably)
EVENT_BUFFER = 4096  # events waiting for the writer; beyond it the producers wait (stdout pushes back)
MAX_WRITE_BATCH = 256  # events joined into one write
CRASH_FLUSH_S = 5.0  # after an engine crash, how long the writer may take to flush its errors
DRAIN_GRACE_S = 30.0  # after SIGTERM / SIGINT, how long accepted requests may take to finish
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130}  # after a signal's drain (128 + 2: shells' Ctrl-C)

EventSink: TypeAlias = trio.MemorySendChannel[Event]
Log: TypeAlias = structlog.typing.FilteringBoundLogger
Signals: TypeAlias = AsyncIterator[int]


def run(options: SystemOptions, drain_grace_s: float = DRAIN_GRACE_S) -> int:
    """The `serve --stdio` process body: its exit status (0 after EOF, `shutdown` or SIGTERM; 130
    after SIGINT; 1 when the engine core died, every request in flight answered with an error)."""
    out_fd = take_stdout()
    try:
        return trio.run(_main, options, out_fd, drain_grace_s)
    except BaseException as exc:
        if not is_core_death(exc):
            raise
        return 1


def take_stdout() -> int:
    """Return a private duplicate of fd 1 and point fd 1 at stderr, so stray prints cannot corrupt it."""
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    return out_fd


async def _main(options: SystemOptions, out_fd: int, drain_grace_s: float) -> int:
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:  # from here on, no KeyboardInterrupt
        stdin = trio.lowlevel.FdStream(os.dup(0))
        stdout = trio.lowlevel.FdStream(out_fd)
        async with stdin, stdout:
            return await serve(options, stdin, stdout, signals, drain_grace_s)


@dataclass
class _Stop:
    """How serving ends: the signal that asked (if any), and the scopes a signal cancels."""

    reading: trio.CancelScope = field(default_factory=trio.CancelScope)
    draining: trio.CancelScope = field(default_factory=trio.CancelScope)
    signum: int | None = None


async def serve(
    options: SystemOptions,
    stdin: trio.abc.ReceiveStream,
    stdout: trio.abc.SendStream,
    signals: Signals | None = None,
    drain_grace_s: float = DRAIN_GRACE_S,
) -> int:
    """Serve requests from `stdin` until EOF, `shutdown` or a stop signal, then drain; the exit status."""
    log: Log = structlog.get_logger().bind(actor="stdio")  # bound after logs.configure, not at import
    send, recv = trio.open_memory_channel[Event](EVENT_BUFFER)
    failure: Exception | None = None
    stop, engine = _Stop(), trio.CancelScope()
    async with trio.open_nursery() as writer:
        writer.start_soon(write_events, recv, stdout, engine, log)
        async with send:
            try:
                with engine:
                    await serve_engine(options, stdin, send, log, stop, signals, drain_grace_s)
            except Exception as exc:  # a crash: the writer still flushes the errors the engine queued
                failure = exc
                writer.cancel_scope.deadline = trio.current_time() + CRASH_FLUSH_S
    if failure is not None:
        raise failure
    log.info("stopped", signal=None if stop.signum is None else signal.Signals(stop.signum).name)
    return 0 if stop.signum is None else EXIT_STATUS[signal.Signals(stop.signum)]


async def serve_engine(
    options: SystemOptions,
    stdin: trio.abc.ReceiveStream,
    events: EventSink,
    log: Log,
    stop: _Stop,
    signals: Signals | None = None,
    drain_grace_s: float = DRAIN_GRACE_S,
) -> None:
    async with trio.open_nursery() as nursery:
        handle: EngineHandle = await nursery.start(run_engine, options)
        log.info("ready", model=str(options.model_dir))
        nursery.start_soon(_stop_reading_when_stopped, handle, stop)
        watching = trio.CancelScope()
        if signals is not None:
            nursery.start_soon(_watch_signals, signals, stop, drain_grace_s, log, watching)
        with stop.reading:
            await read_requests(LineReader(stdin), handle, events, log)
        log.info("draining")
        with stop.draining:
            await handle.drain()
        if stop.draining.cancelled_caught:  # the grace period ran out, or a second signal came
            log.warning("drain_cut_short")
            handle.shutdown()  # every request still live ends with an `internal` error
        watching.cancel()
    handle.raise_if_failed()


async def _stop_reading_when_stopped(handle: EngineHandle, stop: _Stop) -> None:
    """An engine that stopped on its own (its core process died) has failed every live request: stop
    reading (the process then exits non-zero)."""
    await handle.stopped.wait()
    if handle.failure is not None:
        stop.reading.cancel()


async def _watch_signals(
    signals: Signals, stop: _Stop, grace_s: float, log: Log, watching: trio.CancelScope
) -> None:
    """The first stop signal stops reading and gives the drain `grace_s`; a second one ends it now."""
    with watching:
        async for signum in signals:
            log.info("signal", signal=signal.Signals(signum).name)
            if stop.signum is None:
                stop.signum = signum
                stop.reading.cancel()
                stop.draining.deadline = trio.current_time() + grace_s
            else:
                stop.draining.cancel()


async def read_requests(lines: LineReader, handle: EngineHandle, events: EventSink, log: Log) -> None:
    """Answer request lines until EOF or a `shutdown` request."""
    while True:
        try:
            line = await lines.receive_line()
            if line is None:
                log.info("eof")
                return
            if not line.strip():
                continue  # blank lines are not requests
            request = protocol.decode_request(line)
        except RequestError as err:
            log.info("bad_request", rid=err.id, message=err.message)
            await events.send(err.to_event())
            continue
        if not await answer(request, handle, events):
            log.info("shutdown_requested")
            return


async def answer(
    request: protocol.Request, handle: EngineHandle, events: trio.MemorySendChannel[Event]
) -> bool:
    """Act on one decoded request; False after `shutdown`."""
    match request:
        case protocol.Generate():
            try:
                handle.submit(protocol.submit_of(request), events)
            except RequestError as err:
                await events.send(ErrorEvent(id=request.id, code=err.code, message=err.message))
        case protocol.Cancel(id=rid):
            if not handle.cancel(rid):
                message = f"id: no live request with id {rid!r}"
                await events.send(ErrorEvent(id=rid, code="unknown_id", message=message))
        case protocol.Stats():
            await events.send(handle.stats())
        case protocol.Shutdown():
            return False
        case _:
            assert_never(request)
    return True


async def write_events(
    events: trio.MemoryReceiveChannel[Event], out: trio.abc.SendStream, engine: trio.CancelScope, log: Log
) -> None:
    """The only writer of `out`: one JSON line per event, whatever is waiting joined into one write.

    If the client closes its end of stdout, nobody can hear the answers: the engine is stopped
    (`engine` cancelled), which cancels every live request, and the server exits quietly."""
    async with events:
        async for event in events:
            batch = [protocol.encode_event(event)]
            while len(batch) < MAX_WRITE_BATCH:
                try:
                    batch.append(protocol.encode_event(events.receive_nowait()))
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            try:
                await out.send_all(b"".join(batch))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("stdout_closed")
                engine.cancel()
                return


class LineReader:
    """Splits a byte stream into lines (without the newline); a last line without one counts.

    A line longer than `max_line_bytes` raises RequestError once and is skipped up to its newline.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._stream = stream
        self._max = max_line_bytes
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no newline
        self._skipping = False
        self._eof = False

    async def receive_line(self) -> bytes | None:
        """The next line, or None at the end of the stream."""
        while True:
            end = self._buf.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 1]
                self._scanned, skipped, self._skipping = 0, self._skipping, False
                if skipped:
                    continue
                self._check_length(len(line))
                return line
            if self._eof:
                line, self._buf = bytes(self._buf), bytearray()
                if self._skipping or not line:
                    return None
                self._check_length(len(line))
                return line
            self._scanned = len(self._buf)
            if len(self._buf) > self._max:
                self._buf.clear()
                self._scanned = 0
                if not self._skipping:
                    self._skipping = True
                    self._check_length(self._max + 1)
            chunk = await self._stream.receive_some(1 << 16)
            self._eof = not chunk
            self._buf += chunk

    def _check_length(self, length: int) -> None:
        if length > self._max:
            raise RequestError("invalid_request", f"request line longer than {self._max} bytes")
