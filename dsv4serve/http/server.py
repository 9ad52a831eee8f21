"""`serve --http`: hypercorn (trio worker) serving the OpenAI app, in the same trio run as the actors.

`serve_http` starts the engine, then the server, and hands back an `HttpServer`. Drain (SIGINT or
SIGTERM under `run`, or `HttpServer.begin_drain()`): new generation requests get 503 while the ones in
flight finish; then the server stops listening and the engine drains and stops.

Several front processes (`HttpOptions.api_server_count`, `serve --http --api-server-count N`): each
runs this server, its own tokenizer and detokenizer, and accepts on one port through a listening socket
of its own (SO_REUSEPORT: the kernel spreads new connections over the fronts); the first one binds them
all, starts the engine cores (one socket per front each: `FrontLinks`) and the other fronts
(`python -m dsv4serve.http.server`), forwards every signal to them and exits after them. A front that
dies is logged (`front_died`); the cores cancel its requests and the others go on serving.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

import h11
import hypercorn.protocol.h11 as hypercorn_h11
import msgspec
import structlog
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from dsv4serve import logs
from dsv4serve.actors.core_process import EXIT_WAIT_S, CoreOptions
from dsv4serve.actors.front import FrontLinks, run_engine
from dsv4serve.actors.system import EngineHandle, SystemOptions, is_core_death
from dsv4serve.http.app import MAX_BODY_BYTES, AppOptions, OpenAIApp
from dsv4serve.models.registry import spec_for

REASONS = {status.value: status.phrase for status in HTTPStatus}
FRONT_OPTIONS_ENV = "DSV4SERVE_FRONT_OPTIONS"
ORPHAN_CHECK_S = 0.5  # how often a front after the first checks that the first one lives
LISTEN_BACKLOG = 4096  # hypercorn's default (100) has the kernel drop connections of a larger burst


def _response_with_reason(**fields: Any) -> h11.Response:
    """An h11 response whose status line carries its standard reason phrase ("HTTP/1.1 429 Too Many
    Requests"): hypercorn sends none over HTTP/1.1 (HTTP/2 has no reason phrases)."""
    if not fields.get("reason"):
        fields["reason"] = REASONS.get(fields["status_code"], "")  # a non-standard code keeps none
    return h11.Response(**fields)


def _give_hypercorn_reason_phrases() -> None:
    """hypercorn's HTTP/1.1 protocol builds its responses through the `h11` name of its own module:
    that name (and only it) becomes h11 with `Response` filling in the reason phrase."""
    if getattr(hypercorn_h11.h11, "Response", None) is _response_with_reason:
        return
    shim = types.SimpleNamespace(**{k: getattr(h11, k) for k in dir(h11) if not k.startswith("__")})
    shim.Response = _response_with_reason
    hypercorn_h11.h11 = shim  # type: ignore[assignment]


@dataclass(frozen=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (see HttpServer.urls)
    model_name: str | None = None  # None: the model directory's name
    max_body_bytes: int = MAX_BODY_BYTES
    api_key: str | None = None  # every /v1/* request needs it as a bearer token
    ssl_certfile: str | None = None  # both: HTTPS (hypercorn's own TLS)
    ssl_keyfile: str | None = None
    stream_interval: int = 1  # a stream's tokens per chunk after its first (`AppOptions`)
    api_server_count: int = 1  # front processes sharing the port (`run`; the engine core apart)


@dataclass(frozen=True)
class HttpServer:
    app: OpenAIApp
    handle: EngineHandle
    urls: tuple[str, ...]  # e.g. ("http://127.0.0.1:8000",)

    def begin_drain(self) -> None:
        self.app.begin_drain()


@dataclass(frozen=True)
class _Front:
    """How this process's server is joined to the others (several fronts): its listening socket's
    descriptor and its links to the cores (`links` in the first front, `attach` in the others)."""

    listen_fd: int
    links: FrontLinks | None = None
    attach: tuple[socket.socket, ...] = ()
    parent_pid: int | None = None  # the first front's, in the others (whose death drains them)
    index: int = 0  # this front's (0: the first)


async def serve_http(
    options: SystemOptions,
    http: HttpOptions,
    front: _Front | None = None,
    *,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until drained (see the module docstring); the engine stops with it."""
    log = structlog.get_logger().bind(actor="http")
    async with trio.open_nursery() as nursery:
        engine = (
            run_engine
            if front is None
            else partial(
                run_engine,
                links=front.links,
                attach=front.attach,
                index=front.index,
                num_fronts=http.api_server_count,
            )
        )
        handle: EngineHandle = await nursery.start(engine, options)
        app_options = AppOptions(
            model_name=http.model_name or options.model_dir.name,
            max_model_len=handle.max_model_len,
            max_body_bytes=http.max_body_bytes,
            api_key=http.api_key,
            stream_interval=http.stream_interval,
        )
        template = spec_for(handle.model.model_type).chat_template(options.model_dir)
        app = OpenAIApp(handle, template, app_options)
        _give_hypercorn_reason_phrases()
        config = Config()
        config.bind = [f"{http.host}:{http.port}" if front is None else f"fd://{front.listen_fd}"]
        config.backlog = LISTEN_BACKLOG
        config.accesslog = None
        config.errorlog = None  # unexpected failures reach our logs through the nursery
        config.certfile, config.keyfile = http.ssl_certfile, http.ssl_keyfile
        urls = await nursery.start(partial(serve, app, config, shutdown_trigger=app.drained.wait))  # type: ignore[arg-type]
        log.info("ready", model=str(options.model_dir), urls=list(urls), pid=os.getpid())
        gc.collect()  # what start-up left stays out of every later collection: fewer, shorter pauses
        gc.freeze()
        task_status.started(HttpServer(app, handle, tuple(urls)))
        nursery.start_soon(_drain_when_stopped, handle, app)
        await app.drained.wait()
        await handle.drain()
    handle.raise_if_failed()
    log.info("stopped")


async def _drain_when_stopped(handle: EngineHandle, app: OpenAIApp) -> None:
    """An engine that stopped on its own (its core process died) has failed every live request: the
    server stops taking new ones, lets the answers in flight finish, and stops."""
    await handle.stopped.wait()
    app.begin_drain()


def run(options: SystemOptions, http: HttpOptions, front: _Front | None = None) -> int:
    """The `serve --http` process body (one front, or the first of several): exit status 0 after a
    signal-triggered drain, 1 when the engine core died (every request in flight got an error)."""
    try:
        if http.api_server_count > 1 and front is None:
            trio.run(_main_of_fronts, options, http)
        else:
            trio.run(_main, options, http, front, ())
    except BaseException as exc:
        if not is_core_death(exc):
            raise
        return 1
    return 0


async def _main(
    options: SystemOptions, http: HttpOptions, front: _Front | None, others: Sequence[trio.Process]
) -> None:
    """A first signal drains, a second one stops the engine at once (requests in flight fail); each
    signal goes to the other fronts too."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            serve = partial(_serve_then_stop, options, http, front, nursery.cancel_scope)
            server: HttpServer = await nursery.start(serve)
            for index, other in enumerate(others, 1):
                nursery.start_soon(_watch_front, index, other, server.app)
            if front is not None and front.parent_pid is not None:
                nursery.start_soon(_drain_when_orphaned, front.parent_pid, server.app)
            async for signum in signals:
                for other in others:
                    if other.returncode is None:
                        other.send_signal(signum)
                if server.app.draining:
                    server.handle.shutdown()
                server.begin_drain()


async def _serve_then_stop(
    options: SystemOptions,
    http: HttpOptions,
    front: _Front | None,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[HttpServer],
) -> None:
    await serve_http(options, http, front, task_status=task_status)
    scope.cancel()


# ---------------------------------------------------------------- several front processes


class FrontProcessOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a front process after the first is started with (its command line's JSON)."""

    engine: CoreOptions  # the engine's options, as a core gets them
    http: dict[str, Any]  # HttpOptions' fields
    index: int  # 1.. (the first front is 0)
    parent_pid: int
    listen_fd: int
    core_fds: list[int]  # one per engine core


async def _main_of_fronts(options: SystemOptions, http: HttpOptions) -> None:
    """The first front: bind, link the cores to every front, start the other fronts, serve; then wait
    for the others to exit (killed after EXIT_WAIT_S)."""
    if not options.core_process:
        raise ValueError("api_server_count > 1 needs the engine core in a process of its own")
    structlog.contextvars.bind_contextvars(front=0)
    listeners = _bind(http.host, http.port, http.api_server_count)
    links = FrontLinks.make(http.api_server_count, len(options.engine.host_cores))
    others: list[trio.Process] = []
    try:
        for index in range(1, http.api_server_count):
            others.append(await _start_front(options, http, index, listeners[index], links.fronts[index]))
    finally:
        for ends in links.fronts[1:]:
            for end in ends:
                end.close()
        for listener in listeners[1:]:
            listener.close()
    try:
        await _main(options, http, _Front(listeners[0].detach(), links=links), others)
    finally:
        with trio.CancelScope(shield=True):
            for other in others:
                with trio.move_on_after(EXIT_WAIT_S):
                    await other.wait()
                if other.returncode is None:
                    other.kill()
                    await other.wait()


def _bind(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to one port, one per front (TCP_NODELAY, as hypercorn sets on its own).

    Each has SO_REUSEPORT, so the kernel spreads new connections over the fronts by address hash: from
    one shared socket, whichever front is awake would accept a whole burst alone. The port is first
    bound without SO_REUSEPORT, so one that another server holds (with SO_REUSEPORT or not) fails here
    instead of sharing its connections with it; the first front's socket listens at once, which keeps
    the port ours. The others listen once their server is up: no connection waits on a front still
    starting."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    def bound(address: Any, reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind(address)
        except BaseException:
            sock.close()
            raise
        return sock

    with bound(address, reuse_port=False) as probe:
        address = probe.getsockname()  # the port the kernel chose, for port 0
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(bound(address, reuse_port=True))
        socks[0].listen(LISTEN_BACKLOG)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


async def _start_front(
    options: SystemOptions, http: HttpOptions, index: int, listener: socket.socket, ends: list[socket.socket]
) -> trio.Process:
    engine = CoreOptions.of(options)
    fds = [end.fileno() for end in ends]
    front = FrontProcessOptions(
        engine=engine,
        http=asdict(http),
        index=index,
        parent_pid=os.getpid(),
        listen_fd=listener.fileno(),
        core_fds=fds,
    )
    env = os.environ | {FRONT_OPTIONS_ENV: msgspec.json.encode(front).decode()}  # not argv: the API key
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "dsv4serve.http.server"],
        env=env,
        pass_fds=(listener.fileno(), *fds),
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # signals reach it through the first front
    )


async def _watch_front(index: int, process: trio.Process, app: OpenAIApp) -> None:
    code = await process.wait()
    if code != 0 or not app.draining:
        structlog.get_logger().bind(actor="http").error("front_died", front=index, exit_code=code)


async def _drain_when_orphaned(parent_pid: int, app: OpenAIApp) -> None:
    """A front after the first drains once the first is gone (it forwards the signals)."""
    while os.getppid() == parent_pid:
        await trio.sleep(ORPHAN_CHECK_S)
    structlog.get_logger().bind(actor="http").warning("first_front_gone")
    app.begin_drain()


def front_main() -> int:
    """A front process after the first (`python -m dsv4serve.http.server`, its options as JSON in
    $DSV4SERVE_FRONT_OPTIONS)."""
    given = msgspec.json.decode(os.environ.pop(FRONT_OPTIONS_ENV), type=FrontProcessOptions)
    logs.configure(given.engine.log_level, stream=sys.stderr)
    structlog.contextvars.bind_contextvars(front=given.index)
    attach = tuple(socket.socket(fileno=fd) for fd in given.core_fds)
    http = HttpOptions(**given.http)
    return run(
        given.engine.system(),
        http,
        _Front(given.listen_fd, attach=attach, parent_pid=given.parent_pid, index=given.index),
    )


if __name__ == "__main__":
    sys.exit(front_main())
