"""`serve --http`: hypercorn (trio worker) serving the OpenAI app, in the same trio run as the actors.

`serve_http` starts the engine, then the server, and hands back an `HttpServer`. Drain (SIGINT or
SIGTERM under `run`, or `HttpServer.begin_drain()`): new generation requests get 503 while the ones in
flight finish; then the server stops listening and the engine drains and stops.
"""

from __future__ import annotations

import gc
import signal
import types
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

import h11
import hypercorn.protocol.h11 as hypercorn_h11
import structlog
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from dsv4serve.actors.front import run_engine
from dsv4serve.actors.system import EngineHandle, SystemOptions, is_core_death
from dsv4serve.http.app import MAX_BODY_BYTES, AppOptions, OpenAIApp
from dsv4serve.models.registry import spec_for

REASONS = {status.value: status.phrase for status in HTTPStatus}
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


@dataclass(frozen=True)
class HttpServer:
    app: OpenAIApp
    handle: EngineHandle
    urls: tuple[str, ...]  # e.g. ("http://127.0.0.1:8000",)

    def begin_drain(self) -> None:
        self.app.begin_drain()


async def serve_http(
    options: SystemOptions,
    http: HttpOptions,
    *,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until drained (see the module docstring); the engine stops with it."""
    log = structlog.get_logger().bind(actor="http")
    async with trio.open_nursery() as nursery:
        handle: EngineHandle = await nursery.start(run_engine, options)
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
        config.bind = [f"{http.host}:{http.port}"]
        config.backlog = LISTEN_BACKLOG
        config.accesslog = None
        config.errorlog = None  # unexpected failures reach our logs through the nursery
        config.certfile, config.keyfile = http.ssl_certfile, http.ssl_keyfile
        urls = await nursery.start(partial(serve, app, config, shutdown_trigger=app.drained.wait))  # type: ignore[arg-type]
        log.info("ready", model=str(options.model_dir), urls=list(urls))
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


def run(options: SystemOptions, http: HttpOptions) -> int:
    """The `serve --http` process body: exit status 0 after a signal-triggered drain, 1 when the engine
    core died (every request in flight got an error)."""
    try:
        trio.run(_main, options, http)
    except BaseException as exc:
        if not is_core_death(exc):
            raise
        return 1
    return 0


async def _main(options: SystemOptions, http: HttpOptions) -> None:
    """A first signal drains, a second one stops the engine at once (requests in flight fail)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            server: HttpServer = await nursery.start(_serve_then_stop, options, http, nursery.cancel_scope)
            async for _ in signals:
                if server.app.draining:
                    server.handle.shutdown()
                server.begin_drain()


async def _serve_then_stop(
    options: SystemOptions,
    http: HttpOptions,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[HttpServer],
) -> None:
    await serve_http(options, http, task_status=task_status)
    scope.cancel()
