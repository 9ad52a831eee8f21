"""The engine core in a process of its own (`SystemOptions.core_process`, `serve`'s default).

The front process keeps the handle, the tokenizer (and so every detokenization) and the front doors;
the engine-core process runs the scheduler, allocator, KV writer and executor (`start_engine_actors`,
the same wiring as in one process). The two channels that cross (tokenizer -> scheduler, scheduler ->
tokenizer) become one Unix socket pair carrying frames: a 4-byte length, then a msgpack list of the
channels' own messages (`FrontToCore`, `CoreToFront`). A bridge task on each side moves every message
waiting in its channel into one frame, so a step's `Outputs` crosses as one frame; the core appends a
`CoreStatus` (gauges, pool usage) to each frame it writes, and writes one alone while idle, so the
front's `stats` never waits on the core.

Faults: when the engine-core process dies its socket end closes; the front then ends every live request
with an error event, refuses new ones, and stops with `EngineHandle.failure` set (the servers exit
non-zero). When the front's end closes (the front died or stopped), the core cancels every request it
holds, frees their memory, drains and exits. Signals go to the front (the core runs in its own session
and ignores SIGINT, SIGTERM and SIGHUP): SIGTERM's drain crosses as the tokenizer's Drain.

    python -m dsv4serve.actors.core_process FD OPTIONS_JSON   (started by `run_front`, not by hand)
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import structlog
import trio

from dsv4serve import logs
from dsv4serve.actors.scheduler import SchedulerGauges
from dsv4serve.actors.system import (
    EngineCoreDied,
    EngineHandle,
    FrontParts,
    SystemOptions,
    channel_sizes,
    device_parts,
    run_front_actors,
    run_system,
    start_engine_actors,
)
from dsv4serve.actors.tokenizer_core import encode_prompt, load_tokenizer, max_token_chars
from dsv4serve.config import EngineConfig
from dsv4serve.executor.ranks import Place, free_port
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.models.registry import config_from_dir, spec_for
from dsv4serve.protocol import (
    CancelRequest,
    CoreReady,
    CoreStatus,
    CoreToFront,
    Detokenize,
    Drain,
    FailRequest,
    FrontToCore,
    Outputs,
    SchedulerMsg,
    Tokenized,
    TokenizerMsg,
)

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
SPLIT_FRAME_BYTES = 64 << 20  # a batch bigger than this goes as several frames
STATUS_EVERY_S = 0.5  # an idle core's status frames (the front's tokens_per_s decays, pools show frees)
EXIT_WAIT_S = 10.0  # how long the front waits for the core to exit after closing its socket
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


class CoreOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine-core process is started with (its command line's JSON)."""

    model_dir: str
    engine: dict[str, Any]  # EngineConfig's fields
    max_waiting: int
    max_inflight_steps: int
    log_level: str
    dp_rank: int = 0  # which data-parallel core this is (`data_parallel_size` > 1)
    port: int | None = None  # where every rank of the engine rendezvouses (several cores)

    def system(self) -> SystemOptions:
        return SystemOptions(
            model_dir=Path(self.model_dir),
            engine=EngineConfig(**self.engine),
            max_waiting=self.max_waiting,
            max_inflight_steps=self.max_inflight_steps,
        )


class Frames:
    """Length-prefixed msgpack frames, each a list of messages, over a byte stream."""

    def __init__(self, stream: trio.abc.Stream, incoming: Any) -> None:
        self.stream = stream
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[incoming])
        self._buffer = bytearray()

    async def send(self, messages: list[Any]) -> None:
        """One frame, or (a batch over SPLIT_FRAME_BYTES) several, each message whole and in order."""
        payload = self._encoder.encode(messages)
        if len(payload) > SPLIT_FRAME_BYTES and len(messages) > 1:
            half = len(messages) // 2
            await self.send(messages[:half])
            await self.send(messages[half:])
            return
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"a message of {len(payload)} bytes is over the frame limit")
        await self.stream.send_all(_HEADER.pack(len(payload)) + payload)

    async def receive(self) -> list[Any] | None:
        """The next frame's messages; None at the end of the stream (or a reset connection)."""
        while True:
            if len(self._buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self._buffer)
                if size > MAX_FRAME_BYTES:
                    raise ValueError(f"frame of {size} bytes: the other process is not a dsv4serve peer")
                end = _HEADER.size + size
                if len(self._buffer) >= end:
                    frame = bytes(self._buffer[_HEADER.size : end])
                    del self._buffer[:end]
                    return self._decoder.decode(frame)
            try:
                data = await self.stream.receive_some(1 << 16)
            except (*_GONE, OSError):
                data = b""
            if not data:
                return None
            self._buffer += data


async def _take_waiting(
    outbox: trio.MemoryReceiveChannel[Any], idle_s: float | None = None
) -> list[Any] | None:
    """Every message waiting in `outbox`, at least one (None at its end); with `idle_s`, after that long
    without one, none (the caller then writes a status alone)."""
    try:
        with trio.move_on_after(math.inf if idle_s is None else idle_s):
            return [await outbox.receive(), *_nowait(outbox)]
    except trio.EndOfChannel:
        return None
    return []


def _nowait(outbox: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(outbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


# ---------------------------------------------------------------- the engine-core process


def main(argv: list[str]) -> int:
    fd, options = int(argv[0]), msgspec.json.decode(argv[1], type=CoreOptions)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the front's (a service manager
        signal.signal(signum, signal.SIG_IGN)  # signals the whole group): it drains us over the socket
    logs.configure(options.log_level, stream=sys.stderr)
    trio.run(_core_main, socket.socket(fileno=fd), options)
    return 0


async def _core_main(sock: socket.socket, options: CoreOptions) -> None:
    log = structlog.get_logger().bind(actor="core")
    sock.set_inheritable(False)  # a child of ours holding it would hide our death from the front
    frames = Frames(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), FrontToCore)
    system = options.system()
    place = None if options.port is None else Place(options.dp_rank, 0, options.port)
    runner = await trio.to_thread.run_sync(partial(ModelRunner, system.model_dir, system.engine, place=place))
    device = device_parts(runner)
    allocator = device[0]
    kv = {"max_total_tokens": runner.engine.kv_tokens, "max_model_len": allocator.max_model_len}
    log.info(
        "loaded", model_dir=options.model_dir, pool_pages=allocator.sizes.as_dict(), pid=os.getpid(), **kv
    )
    tokenizer_size, scheduler_size = channel_sizes(system)
    to_scheduler, scheduler_inbox = trio.open_memory_channel[SchedulerMsg](scheduler_size)
    to_front, outbox = trio.open_memory_channel[TokenizerMsg](tokenizer_size)
    gauges, live = SchedulerGauges(), set[str]()

    def status() -> CoreStatus:
        return CoreStatus(
            running=gauges.running,
            waiting=gauges.waiting,
            num_steps=gauges.num_steps,
            num_preemptions=gauges.num_preemptions,
            num_generated=gauges.num_generated,
            pools={name: (u.used, u.capacity) for name, u in allocator.usage().items()},
        )

    try:
        async with trio.open_nursery() as nursery:
            scheduler = (to_scheduler.clone(), scheduler_inbox)
            start_engine_actors(nursery, runner.model_cfg, system, device, scheduler, to_front, gauges)
            kv_tokens = runner.engine.kv_tokens
            ready = CoreReady(runner.weight_bytes, os.getpid(), allocator.max_model_len, kv_tokens)
            await frames.send([ready, status()])
            nursery.start_soon(_write_to_front, outbox, frames, live, status)
            await _read_from_front(frames, to_scheduler, live, log)
    except BaseException:
        runner.close(abort=True)  # the other ranks; the other data-parallel cores stop too
        raise
    runner.close()
    log.info("stopped", pools_used={name: u.used for name, u in allocator.usage().items()})


async def _read_from_front(
    frames: Frames,
    to_scheduler: trio.MemorySendChannel[SchedulerMsg],
    live: set[str],
    log: structlog.typing.FilteringBoundLogger,
) -> None:
    """The front's messages into the scheduler until its end closes; then every request still live is
    cancelled (nobody reads it any more) and the core drains."""
    drained = False
    async with to_scheduler:
        while (messages := await frames.receive()) is not None:
            for msg in messages:
                if isinstance(msg, Tokenized):
                    live.add(msg.rid)
                drained |= isinstance(msg, Drain)
                await to_scheduler.send(msg)
        if live:
            log.warning("front_gone", cancelled=len(live))
        for rid in sorted(live):
            await to_scheduler.send(CancelRequest(rid=rid))
        if not drained:
            await to_scheduler.send(Drain())


async def _write_to_front(
    outbox: trio.MemoryReceiveChannel[TokenizerMsg], frames: Frames, live: set[str], status: Any
) -> None:
    """The scheduler's messages to the front, all that wait in one frame, each frame with the status;
    once the front is gone the messages are dropped (the reader has cancelled their requests)."""
    gone = False
    async with outbox:
        while (messages := await _take_waiting(outbox, STATUS_EVERY_S)) is not None:
            for msg in messages:
                for item in msg.items if isinstance(msg, Outputs) else ():
                    if isinstance(item, FailRequest) or (
                        isinstance(item, Detokenize) and item.finish_reason is not None
                    ):
                        live.discard(item.rid)
            if gone:
                continue
            try:
                await frames.send([*messages, status()])
            except (*_GONE, OSError):
                gone = True
    with contextlib.suppress(*_GONE, OSError):
        await frames.stream.send_eof()  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the front process


async def run_engine(
    options: SystemOptions, *, task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """The engine every front door runs: in this process, or (`options.core_process`) with its core in
    a process of its own; returns after drain or shutdown."""
    if options.core_process:
        await run_front(options, task_status=task_status)
    else:
        await run_system(options, task_status=task_status)


@dataclass(eq=False)
class _Core:
    """One engine-core process as the front holds it."""

    process: trio.Process
    frames: Frames
    ready: CoreReady | None = None
    status: CoreStatus | None = None
    drained: bool = False


@dataclass(eq=False)
class Router:
    """Which core holds each live request: a new one goes to the core with the fewest live tokens
    (prompt and output so far); cancels and stop hits follow their request; a drain goes to every core."""

    num_cores: int
    core_of: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    load: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.load = [0] * self.num_cores

    def route(self, msg: FrontToCore) -> list[int]:
        """The cores `msg` goes to (none: its request has ended)."""
        if isinstance(msg, Drain):
            return list(range(self.num_cores))
        if isinstance(msg, Tokenized):
            core = min(range(self.num_cores), key=lambda c: (self.load[c], c))
            self.core_of[msg.rid], self.tokens[msg.rid] = core, len(msg.prompt_token_ids)
            self.load[core] += len(msg.prompt_token_ids)
            return [core]
        core_of = self.core_of.get(msg.rid)
        return [] if core_of is None else [core_of]

    def saw(self, msg: CoreToFront) -> None:
        """A core's report: its requests' new tokens and ends."""
        for item in msg.items if isinstance(msg, Outputs) else ():
            core = self.core_of.get(item.rid)
            if core is None:
                continue
            if isinstance(item, FailRequest) or item.finish_reason is not None:
                self.load[core] -= self.tokens.pop(item.rid)
                del self.core_of[item.rid]
            else:
                self.load[core] += len(item.token_ids)
                self.tokens[item.rid] += len(item.token_ids)


async def run_front(
    options: SystemOptions, *, task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Start the engine-core processes (one, or one per data-parallel rank), then run the handle and
    the tokenizer against them."""
    if options.prebuilt is not None:
        raise ValueError("core_process: a prebuilt model cannot cross into the engine-core process")
    log = structlog.get_logger().bind(actor="system")
    model = config_from_dir(options.model_dir)
    bos = spec_for(model.model_type).prompt_bos
    tok = await trio.to_thread.run_sync(lambda: load_tokenizer(options.model_dir, require_bos=bos))
    num = options.engine.data_parallel_size
    port = free_port() if num > 1 else None
    cores: list[_Core] = []
    try:
        for dp_rank in range(num):
            cores.append(await _start_core(options, dp_rank, port))
        for core in cores:
            first = await core.frames.receive()
            if not first or not isinstance(first[0], CoreReady):
                code = await core.process.wait()
                raise EngineCoreDied(f"the engine-core process exited with code {code} before it was ready")
            core.ready = first[0]
            _apply(first[1:], core, cores, [])
        ready = [c.ready for c in cores if c.ready is not None]
        pids = [r.pid for r in ready]
        log.info("loaded", model_dir=str(options.model_dir), core_pid=pids[0], core_pids=pids)
        weight_bytes: dict[str, int] = {}
        for r in ready:
            for fmt, n in r.weight_bytes.items():
                weight_bytes[fmt] = weight_bytes.get(fmt, 0) + n
        parts = FrontParts(
            model=model,
            encode=lambda text: encode_prompt(tok, text, prepend_bos=bos),
            decoder=tok,
            max_model_len=min(r.max_model_len for r in ready),
            max_token_chars=max_token_chars(tok),
            weight_bytes=weight_bytes,
        )
        gauges_box: list[SchedulerGauges] = []
        router = Router(num)

        def start_bridge(
            nursery: trio.Nursery,
            *,
            scheduler: tuple[trio.MemorySendChannel[SchedulerMsg], trio.MemoryReceiveChannel[SchedulerMsg]],
            tokenizer: trio.MemorySendChannel[TokenizerMsg],
            gauges: SchedulerGauges,
            handle: EngineHandle,
        ) -> None:
            to_core, core_outbox = scheduler
            to_core.close()  # the tokenizer holds its own clone
            gauges_box.append(gauges)
            nursery.start_soon(_write_to_cores, core_outbox, cores, router)
            for core in cores:
                nursery.start_soon(
                    _read_from_core, core, cores, router, tokenizer.clone(), gauges_box, handle
                )
            tokenizer.close()

        await run_front_actors(parts, lambda: _pools(cores), options, start_bridge, task_status=task_status)
    finally:
        with trio.CancelScope(shield=True):
            for core in cores:
                await core.frames.stream.aclose()
            for core in cores:
                with trio.move_on_after(EXIT_WAIT_S):
                    await core.process.wait()
                if core.process.returncode is None:
                    log.error("core_killed", reason=f"still running {EXIT_WAIT_S} s after its socket closed")
                    core.process.kill()
                    await core.process.wait()


async def _start_core(options: SystemOptions, dp_rank: int, port: int | None) -> _Core:
    front_sock, core_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    core_options = CoreOptions(
        model_dir=str(options.model_dir),
        engine=asdict(options.engine),
        max_waiting=options.max_waiting,
        max_inflight_steps=options.max_inflight_steps,
        log_level=logs.current_level(),
        dp_rank=dp_rank,
        port=port,
    )
    argv = [sys.executable, "-m", "dsv4serve.actors.core_process", str(core_sock.fileno())]
    with core_sock:
        process = await trio.lowlevel.open_process(
            [*argv, msgspec.json.encode(core_options).decode()],
            pass_fds=(core_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # stdout may be the stdio front door's protocol stream
            start_new_session=True,  # a terminal's Ctrl-C reaches the front only
        )
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(front_sock))
    return _Core(process, Frames(stream, CoreToFront))


def _pools(cores: list[_Core]) -> dict[str, tuple[int, int]]:
    """Every core's pools, summed: (used, capacity) slots by pool."""
    out: dict[str, tuple[int, int]] = {}
    for core in cores:
        for name, (used, capacity) in (core.status.pools if core.status else {}).items():
            was = out.get(name, (0, 0))
            out[name] = (was[0] + used, was[1] + capacity)
    return out


async def _write_to_cores(
    outbox: trio.MemoryReceiveChannel[SchedulerMsg], cores: list[_Core], router: Router
) -> None:
    async with outbox:
        while (messages := await _take_waiting(outbox)) is not None:
            batches: list[list[Any]] = [[] for _ in cores]
            for msg in messages:
                for c in router.route(msg):
                    batches[c].append(msg)
            for core, batch in zip(cores, batches, strict=True):
                if batch:
                    with contextlib.suppress(*_GONE, OSError):  # the core died: its reader says so
                        await core.frames.send(batch)
    for core in cores:
        with contextlib.suppress(*_GONE, OSError):
            await core.frames.stream.send_eof()  # type: ignore[attr-defined]


async def _read_from_core(
    core: _Core,
    cores: list[_Core],
    router: Router,
    tokenizer: trio.MemorySendChannel[TokenizerMsg],
    gauges_box: list[SchedulerGauges],
    handle: EngineHandle,
) -> None:
    """A core's messages into the tokenizer, its status into the gauges; the Drain goes on once every
    core has drained. If its stream ends before its Drain did, the core died: every live request errs
    and the front stops."""
    async with tokenizer:
        while (messages := await core.frames.receive()) is not None:
            for msg in messages:
                router.saw(msg)
            for msg in _apply(messages, core, cores, gauges_box):
                if isinstance(msg, Drain):
                    core.drained = True
                    if not all(c.drained for c in cores):
                        continue
                with contextlib.suppress(*_GONE):  # the tokenizer ended (shutdown): nothing reads
                    await tokenizer.send(msg)
    if core.drained:
        return
    with trio.move_on_after(1.0):
        await core.process.wait()
    code = core.process.returncode
    message = f"the engine-core process died (exit code {code}) before the request finished"
    structlog.get_logger().bind(actor="system").error("engine_core_died", exit_code=code)
    handle.core_died(message)


def _apply(
    messages: list[CoreToFront], core: _Core, cores: list[_Core], gauges_box: list[SchedulerGauges]
) -> list[TokenizerMsg]:
    """Take the CoreStatus messages into the core's status and the gauges (every core's summed);
    return the others, in order."""
    out: list[TokenizerMsg] = []
    for msg in messages:
        if isinstance(msg, CoreStatus):
            core.status = msg
            statuses = [c.status for c in cores if c.status is not None]
            for gauges in gauges_box:
                gauges.running = sum(s.running for s in statuses)
                gauges.waiting = sum(s.waiting for s in statuses)
                gauges.num_steps = max(s.num_steps for s in statuses)
                gauges.num_preemptions = sum(s.num_preemptions for s in statuses)
                generated = sum(s.num_generated for s in statuses)
                if generated > gauges.num_generated:
                    gauges.add_tokens(trio.current_time(), generated - gauges.num_generated)
        elif not isinstance(msg, CoreReady):
            out.append(msg)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
