"""The front process of an engine whose core runs apart (`SystemOptions.core_process`): it starts the
engine-core processes (`core_process.py`; one, or one per data-parallel rank), then runs the handle and
the tokenizer against them over their sockets. `run_engine` is every front door's entry: it runs the
engine in this process, or so.

Several cores: a new request goes to the core with the fewest live tokens (`Router`); its cancels and
stop hits follow it; a drain goes to every core, and the tokenizer sees one Drain once all drained; the
gauges and pools are the cores' sums. A core that dies (its socket ends before its Drain) fails every
live request and stops the engine (`EngineHandle.core_died`).

Several front processes (`serve --http --api-server-count N`): the first one makes every socket pair
(`FrontLinks`), starts the cores with one end per front and hands the other fronts their ends; each
front then runs as here, attached to cores it did not start (`run_front(attach=...)`).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import structlog
import trio

from dsv4serve.actors.core_process import (
    EXIT_WAIT_S,
    FRONT_PORT,
    CoreOptions,
    Frames,
    engine_digest,
    take_waiting,
)
from dsv4serve.actors.scheduler import SchedulerGauges
from dsv4serve.actors.system import (
    EngineCoreDied,
    EngineHandle,
    FrontParts,
    SystemOptions,
    run_front_actors,
    run_system,
)
from dsv4serve.actors.tokenizer_core import encode_prompt, load_tokenizer, max_token_chars
from dsv4serve.backends import check_device
from dsv4serve.config import ConfigError, EngineConfig
from dsv4serve.executor.ranks import HELLO_WAIT_S, RANK_TOKEN_ENV, READY_TIMEOUT_S, free_port
from dsv4serve.models.registry import config_from_dir, spec_for, with_index_quant
from dsv4serve.protocol import (
    CoreReady,
    CoreStatus,
    CoreToFront,
    Drain,
    FailRequest,
    FrontToCore,
    Outputs,
    SchedulerMsg,
    Tokenized,
    TokenizerMsg,
)

_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


async def run_engine(
    options: SystemOptions,
    *,
    links: FrontLinks | None = None,
    attach: Sequence[socket.socket] = (),
    index: int = 0,
    num_fronts: int = 1,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The engine every front door runs: in this process, or (`options.core_process`) with its core in
    a process of its own; returns after drain or shutdown. `links`, `attach`, `index`, `num_fronts`:
    see `run_front`."""
    if options.engine.node_rank:
        raise ConfigError("node_rank: host 0 serves the engine; the other hosts run `dsv4serve ranks`")
    if options.core_process or attach or index:
        await run_front(
            options, links=links, attach=attach, index=index, num_fronts=num_fronts, task_status=task_status
        )
    else:
        await run_system(options, task_status=task_status)


@dataclass(eq=False)
class FrontLinks:
    """The socket pairs joining N front processes to the engine cores: front f's end to core d is
    `fronts[f][d]`; core d is started with `cores[d]`, one end per front in front order. Whoever holds
    an end it does not use closes it (a peer's death shows as the end of its stream)."""

    fronts: list[list[socket.socket]]
    cores: list[list[socket.socket]]

    @classmethod
    def make(cls, num_fronts: int, num_cores: int) -> FrontLinks:
        pair = partial(socket.socketpair, socket.AF_UNIX, socket.SOCK_STREAM)
        pairs = [[pair() for _ in range(num_cores)] for _ in range(num_fronts)]
        fronts = [[front_end for front_end, _ in row] for row in pairs]
        cores = [[pairs[f][d][1] for f in range(num_fronts)] for d in range(num_cores)]
        return cls(fronts, cores)


@dataclass(eq=False)
class _Core:
    """One engine-core process as the front holds it (`process`: None where another front started it)."""

    process: trio.Process | None
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
    options: SystemOptions,
    *,
    links: FrontLinks | None = None,
    attach: Sequence[socket.socket] = (),
    index: int = 0,
    num_fronts: int = 1,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start this host's engine-core processes (one, or one per data-parallel rank), then run the
    handle and the tokenizer against them. With `links`, the cores are started with one socket per
    front and this front uses `links.fronts[0]`; with `attach` (one socket per core of this host, from
    the first front), no core is started: this is front `index` of `num_fronts` over cores that run
    already. With data parallelism over hosts, the other hosts' cores dial this front (`_accept_cores`)."""
    if options.prebuilt is not None:
        raise ValueError("core_process: a prebuilt model cannot cross into the engine-core process")
    log = structlog.get_logger().bind(actor="system")
    engine = options.engine
    if not attach:  # a device this machine lacks: the ConfigError here, not a core's crash
        check_device(engine.device)
    model = with_index_quant(config_from_dir(options.model_dir), engine.indexer_quant)  # (refused here)
    bos = spec_for(model.model_type).prompt_bos
    tok = await trio.to_thread.run_sync(lambda: load_tokenizer(options.model_dir, require_bos=bos))
    num, here = engine.data_parallel_size, engine.host_cores
    port = (engine.master_port if engine.nnodes > 1 else free_port()) if num > 1 and not attach else None
    cores: list[_Core] = [_Core(None, Frames(_stream(sock), CoreToFront)) for sock in attach]
    links = links or FrontLinks.make(1, 0 if attach else len(here))  # one front: a socket pair per core
    try:
        for i, dp_rank in enumerate(() if attach else here):
            cores.append(await _start_core(options, dp_rank, port, links.fronts[0][i], links.cores[i]))
        if len(here) < num:
            remote = [d for d in range(num) if d not in here]
            local = [core.process for core in cores if core.process is not None]
            cores += await _accept_cores(engine, index, num_fronts, remote, local)
        ready = await _ready(cores)
        log.info(
            "loaded",
            model_dir=str(options.model_dir),
            core_pid=ready[0].pid,
            core_pids=[r.pid for r in ready],
        )
        parts = FrontParts(
            model=model,
            encode=lambda text: encode_prompt(tok, text, prepend_bos=bos),
            decoder=tok,
            max_model_len=min(r.max_model_len for r in ready),
            max_token_chars=max_token_chars(tok),
            weight_bytes=_summed([r.weight_bytes for r in ready]),
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
                if core.process is None:  # another front's core: it exits once every front has gone
                    continue
                with trio.move_on_after(EXIT_WAIT_S):
                    await core.process.wait()
                if core.process.returncode is None:
                    log.error("core_killed", reason=f"still running {EXIT_WAIT_S} s after its socket closed")
                    core.process.kill()
                    await core.process.wait()


async def _ready(cores: list[_Core]) -> list[CoreReady]:
    """Each core's first frame: its CoreReady (and status); EngineCoreDied if one exits first."""
    for core in cores:
        first = await core.frames.receive()
        if not first or not isinstance(first[0], CoreReady):
            code = "unknown" if core.process is None else await core.process.wait()
            raise EngineCoreDied(f"the engine-core process exited with code {code} before it was ready")
        core.ready = first[0]
        _apply(first[1:], core, cores, [])
    return [c.ready for c in cores if c.ready is not None]


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            out[key] = out.get(key, 0) + n
    return out


def _stream(sock: socket.socket) -> trio.SocketStream:
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


async def _start_core(
    options: SystemOptions,
    dp_rank: int,
    port: int | None,
    front_sock: socket.socket,
    core_socks: Sequence[socket.socket],
) -> _Core:
    """A core process given `core_socks` (its ends, one per front; closed here once it holds them);
    this front speaks to it over `front_sock`."""
    core_options = CoreOptions.of(options, dp_rank=dp_rank, port=port)
    fds = [sock.fileno() for sock in core_socks]
    argv = [sys.executable, "-m", "dsv4serve.actors.core_process", ",".join(map(str, fds))]
    try:
        process = await trio.lowlevel.open_process(
            [*argv, msgspec.json.encode(core_options).decode()],
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),  # stdout may be the stdio front door's protocol stream
            start_new_session=True,  # a terminal's Ctrl-C reaches the front only
        )
    finally:
        for sock in core_socks:
            sock.close()
    return _Core(process, Frames(_stream(front_sock), CoreToFront))


async def _accept_cores(
    engine: EngineConfig, front: int, num_fronts: int, dp_ranks: list[int], local: Sequence[trio.Process]
) -> list[_Core]:
    """The other hosts' engine cores (data parallelism over hosts), in `dp_ranks` order, as each dials
    this front on master_port + FRONT_PORT + `front` (IPv4, as the ranks' port) and says its hello:
    its dp_rank, the hosts' token (RANK_TOKEN_ENV, required), how many fronts it dials and its engine
    flags' digest. A peer without the token, or silent for HELLO_WAIT_S, is closed on; a core whose
    fronts or flags differ from this host's stops the start (EngineCoreDied, naming it), as does a
    `local` core exiting while the others load, or their not all dialing within READY_TIMEOUT_S."""
    token = os.environ.get(RANK_TOKEN_ENV, "").encode()
    if not token:
        raise ConfigError(f"data parallelism over hosts needs ${RANK_TOKEN_ENV}, alike on every host")
    got: dict[int, Frames] = {}
    listeners = await trio.open_tcp_listeners(engine.master_port + FRONT_PORT + front, host="0.0.0.0")
    try:
        async with trio.open_nursery() as nursery:
            for process in local:
                nursery.start_soon(_fail_on_exit, process)
            with trio.move_on_after(READY_TIMEOUT_S):
                while len(got) < len(dp_ranks):
                    stream = await listeners[0].accept()
                    rank, frames = await _hello(stream, token, dp_ranks, engine, num_fronts)
                    if rank is None:
                        await stream.aclose()
                    elif rank in got:
                        await stream.aclose()
                        raise EngineCoreDied(f"two engine cores dialed front {front} as core {rank}")
                    else:
                        got[rank] = frames
            nursery.cancel_scope.cancel()
        missing = [d for d in dp_ranks if d not in got]
        if missing:
            raise EngineCoreDied(f"the engine cores {missing} of the other hosts never dialed front {front}")
    except BaseException:
        with trio.CancelScope(shield=True):
            for frames in got.values():
                await frames.stream.aclose()
        raise
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
    return [_Core(None, got[d]) for d in dp_ranks]


async def _hello(
    stream: trio.SocketStream, token: bytes, dp_ranks: list[int], engine: EngineConfig, num_fronts: int
) -> tuple[int | None, Frames]:
    """A dialing peer's hello: (its dp_rank, its frames after the hello), or (None, ..) for a stranger
    (no hello in HELLO_WAIT_S, bytes that are not one, a wrong token or rank)."""
    frames, hello = Frames(stream, dict[str, Any]), None
    with trio.move_on_after(HELLO_WAIT_S), contextlib.suppress(msgspec.DecodeError, ValueError):
        hello = await frames.receive()
    said = hello[0] if hello else {}
    rank = said.get("dp_rank")
    if not hmac.compare_digest(str(said.get("token")).encode(), token) or rank not in dp_ranks:
        return None, frames
    if said.get("engine") != engine_digest(engine):
        raise EngineCoreDied(f"the engine core {rank} of another host runs with other engine flags")
    if said.get("fronts") != num_fronts:
        raise EngineCoreDied(
            f"the engine core {rank} of another host dials {said.get('fronts')} fronts, this host runs "
            f"{num_fronts} (give `dsv4serve ranks` serve's --api-server-count)"
        )
    return rank, frames.retyped(CoreToFront)


async def _fail_on_exit(process: trio.Process) -> None:
    code = await process.wait()
    raise EngineCoreDied(f"the engine-core process exited with code {code} before it was ready")


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
        while (messages := await take_waiting(outbox)) is not None:
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
    code: int | str | None = "unknown"  # another front started it
    if core.process is not None:
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
