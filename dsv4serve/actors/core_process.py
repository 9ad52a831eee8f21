"""The engine core in a process of its own (`SystemOptions.core_process`, `serve`'s default): this
process's side and the frames both sides speak; the front's side is `front.py`.

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

With data parallelism over hosts (`nnodes` > 1, `data_parallel_size` > 1), host 0's fronts start its
own cores; each other host's `dsv4serve ranks` starts that host's cores (`run_host_cores`), which dial
every front (front f on master_port + 1 + f) and open each connection with a hello frame (dp_rank,
the hosts' shared token); the frames are then the same over TCP.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
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
    SystemOptions,
    channel_sizes,
    device_parts,
    start_engine_actors,
)
from dsv4serve.backends import share_host
from dsv4serve.config import EngineConfig
from dsv4serve.executor.ranks import RANK_TOKEN_ENV, Place, dial, wait_all
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.protocol import (
    CancelRequest,
    CoreReady,
    CoreStatus,
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

    @classmethod
    def of(cls, options: SystemOptions, **fields: Any) -> CoreOptions:
        """`options` as a process of the engine's gets them (the log level this process's)."""
        return cls(
            model_dir=str(options.model_dir),
            engine=asdict(options.engine),
            max_waiting=options.max_waiting,
            max_inflight_steps=options.max_inflight_steps,
            log_level=logs.current_level(),
            **fields,
        )

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

    def retyped(self, incoming: Any) -> Frames:
        """The same stream, the frames after those read so far decoded as `incoming` (after a hello)."""
        frames = Frames(self.stream, incoming)
        frames._buffer = self._buffer
        return frames

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


async def take_waiting(
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
    """argv: the descriptors of the core's ends ("FD,FD,..", one per front), or "connect:N" (a core on
    another host, dialing host 0's N fronts), then the CoreOptions JSON."""
    options = msgspec.json.decode(argv[1], type=CoreOptions)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the front's (a service manager
        signal.signal(signum, signal.SIG_IGN)  # signals the whole group): it drains us over the socket
    logs.configure(options.log_level, stream=sys.stderr)
    engine = EngineConfig(**options.engine)
    share_host(engine.device, engine.ranks_per_node)
    if argv[0].startswith("connect:"):  # dialed once loaded (ranks joined): no idle links meanwhile
        links = partial(connect_to_fronts, options, int(argv[0].removeprefix("connect:")))
    else:
        socks = [socket.socket(fileno=int(fd)) for fd in argv[0].split(",")]
        for sock in socks:
            sock.set_inheritable(False)  # a child of ours holding it would hide our death from the front
        links = partial(list, socks)
    trio.run(_core_main, links, options)
    return 0


# ---------------------------------------------------------------- cores on other hosts

FRONT_PORT = 1  # front f of host 0 takes the other hosts' cores on master_port + FRONT_PORT + f


def hello_frame(dp_rank: int, fronts: int, engine: str) -> bytes:
    """What a core on another host sends first on each connection: its rank, the hosts' token, the
    fronts it dials and its engine flags' digest (`engine_digest`), which the front checks."""
    token = os.environ.get(RANK_TOKEN_ENV, "")
    hello = {"dp_rank": dp_rank, "token": token, "fronts": fronts, "engine": engine}
    payload = msgspec.msgpack.encode([hello])
    return _HEADER.pack(len(payload)) + payload


def engine_digest(engine: EngineConfig) -> str:
    """The engine flags every host must share (all but node_rank and master_addr), in 16 hex digits."""
    shared = asdict(engine) | {"node_rank": 0, "master_addr": ""}
    return hashlib.sha256(msgspec.json.encode(shared)).hexdigest()[:16]


def connect_to_fronts(options: CoreOptions, num_fronts: int) -> list[socket.socket]:
    """A core on another host (data parallelism over hosts): its connection to each front of host 0,
    in front order, each opened with its hello."""
    engine = EngineConfig(**options.engine)
    hello = hello_frame(options.dp_rank, num_fronts, engine_digest(engine))
    socks = []
    for front in range(num_fronts):
        sock = dial(engine.master_addr, engine.master_port + FRONT_PORT + front)
        sock.sendall(hello)
        socks.append(sock)
    return socks


def run_host_cores(model_dir: str, engine: EngineConfig, num_fronts: int) -> int:
    """`dsv4serve ranks` with data parallelism over hosts: this host's engine cores (`host_cores`, each
    with its tensor-parallel ranks), each dialing every front of host 0; returns once they all ended
    (0 if each did cleanly: a core ends when host 0's fronts close)."""
    system = SystemOptions(Path(model_dir), engine)
    return wait_all(
        [
            subprocess.Popen(
                [
                    sys.executable, "-m", "dsv4serve.actors.core_process", f"connect:{num_fronts}",
                    msgspec.json.encode(CoreOptions.of(system, dp_rank=d, port=engine.master_port)).decode(),
                ],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),
            )
            for d in engine.host_cores
        ]
    )  # fmt: skip


@dataclass(eq=False)
class _Front:
    """One front process's socket, as the core holds it."""

    index: int
    frames: Frames
    drained: bool = False  # its Drain came (or its end closed)
    gone: bool = False  # its end closed, or a write to it failed
    status_at: float = -math.inf  # when it was last sent a status


@dataclass(eq=False)
class _Fronts:
    """Every front process's socket (`--api-server-count`: several); which front each live request
    came from. The scheduler sees one Drain: once every front has drained or gone."""

    all: list[_Front]
    owner: dict[str, _Front] = field(default_factory=dict)  # live rid -> the front it came from
    drain_sent: bool = False

    def drain_due(self) -> bool:
        due = not self.drain_sent and all(f.drained for f in self.all)
        self.drain_sent |= due
        return due


async def _core_main(links: Callable[[], list[socket.socket]], options: CoreOptions) -> None:
    """The core: load (its ranks joined), take its links to the fronts, serve until every front has
    drained or gone."""
    log = structlog.get_logger().bind(actor="core")
    system = options.system()
    place = None if options.port is None else Place(options.dp_rank, 0, options.port)
    runner = await trio.to_thread.run_sync(partial(ModelRunner, system.model_dir, system.engine, place=place))
    try:
        socks = await trio.to_thread.run_sync(links)
    except BaseException:
        runner.close(abort=True)  # its ranks, and the other cores
        raise
    streams = [trio.SocketStream(trio.socket.from_stdlib_socket(sock)) for sock in socks]
    fronts = _Fronts([_Front(i, Frames(stream, FrontToCore)) for i, stream in enumerate(streams)])
    device = device_parts(runner)
    allocator = device[0]
    kv = {"max_total_tokens": runner.engine.kv_tokens, "max_model_len": allocator.max_model_len}
    log.info(
        "loaded",
        model_dir=options.model_dir,
        pool_pages=allocator.sizes.as_dict(),
        pid=os.getpid(),
        fronts=len(socks),
        **kv,
    )
    tokenizer_size, scheduler_size = channel_sizes(system, fronts=len(socks))
    to_scheduler, scheduler_inbox = trio.open_memory_channel[SchedulerMsg](scheduler_size)
    to_front, outbox = trio.open_memory_channel[TokenizerMsg](tokenizer_size)
    gauges = SchedulerGauges()

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
            for front in fronts.all:
                await _send(front, [ready, status()])
            gc.collect()  # what start-up left stays out of every later collection: fewer, shorter pauses
            gc.freeze()
            nursery.start_soon(_write_to_fronts, outbox, fronts, status)
            async with to_scheduler, trio.open_nursery() as readers:
                for front in fronts.all:
                    readers.start_soon(_read_from_front, front, fronts, to_scheduler.clone(), log)
    except BaseException:
        runner.close(abort=True)  # the other ranks; the other data-parallel cores stop too
        raise
    runner.close()
    log.info("stopped", pools_used={name: u.used for name, u in allocator.usage().items()})


async def _send(front: _Front, messages: list[Any]) -> None:
    """A frame to `front`, unless it is gone (a failed write makes it so: its reader cancels its
    requests once its end reads closed)."""
    if front.gone:
        return
    try:
        await front.frames.send(messages)
    except (*_GONE, OSError):
        front.gone = True
    front.status_at = trio.current_time()


async def _read_from_front(
    front: _Front,
    fronts: _Fronts,
    to_scheduler: trio.MemorySendChannel[SchedulerMsg],
    log: structlog.typing.FilteringBoundLogger,
) -> None:
    """A front's messages into the scheduler until its end closes; then every request of it still live
    is cancelled (nobody reads it any more). The core drains once every front has drained or gone."""
    async with to_scheduler:
        while (messages := await front.frames.receive()) is not None:
            for msg in messages:
                if isinstance(msg, Drain):
                    front.drained = True
                    if fronts.drain_due():
                        await to_scheduler.send(msg)
                    continue
                if isinstance(msg, Tokenized):
                    fronts.owner[msg.rid] = front
                await to_scheduler.send(msg)
        front.gone = front.drained = True
        if all(f.gone for f in fronts.all):
            _exit_after(EXIT_WAIT_S)
        orphans = sorted(rid for rid, owner in fronts.owner.items() if owner is front)
        if orphans:
            log.warning("front_gone", front=front.index, cancelled=len(orphans))
        for rid in orphans:
            await to_scheduler.send(CancelRequest(rid=rid))
        if fronts.drain_due():
            await to_scheduler.send(Drain())


def _exit_after(seconds: float) -> None:
    """Every front has gone: the core drains and exits, unless it hangs (in its ranks' collectives with
    a core that died, say): after `seconds` the process ends anyway. Its own fronts kill a core of this
    host then; nothing would end a core of another host."""
    timer = threading.Timer(seconds, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


async def _write_to_fronts(
    outbox: trio.MemoryReceiveChannel[TokenizerMsg], fronts: _Fronts, status: Any
) -> None:
    """The scheduler's messages to the fronts their requests came from, all that wait in one frame per
    front, each frame with the status (a front with nothing new gets the status alone every
    STATUS_EVERY_S); a gone front's messages are dropped (its reader cancelled their requests)."""
    async with outbox:
        while (messages := await take_waiting(outbox, STATUS_EVERY_S)) is not None:
            batches: dict[_Front, list[Any]] = {}
            for msg in messages:
                if isinstance(msg, Drain):
                    for front in fronts.all:
                        batches.setdefault(front, []).append(msg)
                    continue
                if not isinstance(msg, Outputs):  # (the scheduler sends the tokenizer nothing else)
                    continue
                split: dict[_Front, list[Detokenize | FailRequest]] = {}
                for item in msg.items:
                    owner = fronts.owner.get(item.rid)
                    if isinstance(item, FailRequest) or item.finish_reason is not None:
                        fronts.owner.pop(item.rid, None)
                    if owner is not None:
                        split.setdefault(owner, []).append(item)
                for front, items in split.items():  # one front (the usual case): the message as it is
                    whole = len(split) == 1 and len(items) == len(msg.items)
                    batches.setdefault(front, []).append(msg if whole else Outputs(items=tuple(items)))
            now, current = trio.current_time(), status()
            for front in fronts.all:
                batch = batches.get(front)
                if batch or now - front.status_at >= STATUS_EVERY_S:
                    await _send(front, [*(batch or ()), current])
    for front in fronts.all:
        with contextlib.suppress(*_GONE, OSError):
            await front.frames.stream.send_eof()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
