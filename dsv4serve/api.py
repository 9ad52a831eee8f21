"""The embedded Python API: `AsyncEngine` for trio programs and `Engine`, its sync facade.

Both run the actor system of `actors/system.py`; `Engine` runs it under `trio.run` in a background
thread and calls in with `trio.from_thread`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import trio

from dsv4serve import logs, protocol
from dsv4serve.actors.front import run_engine
from dsv4serve.actors.system import EngineHandle, SystemOptions
from dsv4serve.backends import computes_on_host
from dsv4serve.config import EngineConfig
from dsv4serve.params import (
    Completion,
    Params,
    Prompt,
    Prompts,
    SamplingParams,
    one_prompt,
    params_list,
    prompt_list,
    to_completion,
    to_submit,
)
from dsv4serve.protocol import RequestError, StatsEvent, TokenEvent

T = TypeVar("T")
QUEUE_POLL_S = 0.05  # a queued `generate` retries at least this often


# ---------------------------------------------------------------- engines


def system_options(
    model: str | Path, engine: EngineConfig, core_process: bool | None = None
) -> SystemOptions:
    """The options of an engine of the API. `core_process` None: the engine core in a process of its own
    where it computes on an accelerator (its step's host work then never waits on the caller's tokenizing,
    detokenizing and stream handling: run 82, 64 / 256 streams on one H100, 5.30 / 11.51 ms a decode
    step against 7.68 / 27.45 in one process), in this process on the CPU (whose cores the two would
    share; and start-up loads torch once)."""
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    if core_process is None:
        core_process = not computes_on_host(engine.device)
    several = engine.data_parallel_size > 1  # each data-parallel rank is an engine-core process
    return SystemOptions(model_dir=model_dir, engine=engine, core_process=core_process or several)


@asynccontextmanager
async def _running(options: SystemOptions) -> AsyncIterator[EngineHandle]:
    """The system for the body's lifetime: drained after a normal exit, shut down after an error."""
    async with trio.open_nursery() as nursery:
        handle: EngineHandle = await nursery.start(run_engine, options)
        try:
            yield handle
        except BaseException:
            handle.shutdown()
            raise
        await handle.drain()
    handle.raise_if_failed()


class _Configured:
    """The constructor `AsyncEngine` and `Engine` share: `model` (a checkpoint directory) and, as
    keywords, any EngineConfig field (`device="cuda"`, `max_num_seqs=128`, `max_model_len=8192`, ...);
    `core_process=True` runs the engine core (scheduler .. executor) in a process of its own, False in
    this one; left out, apart on a GPU or NPU and here on the CPU (`system_options`).

    `options` are built (and checked) once; a subclass sets up the rest in `_setup`.
    """

    options: SystemOptions

    def __init__(self, model: str | Path, *, core_process: bool | None = None, **knobs: Any) -> None:
        self.options = system_options(model, EngineConfig(**knobs), core_process)
        logs.configure_default()
        self._setup()

    @classmethod
    def _of(cls, options: SystemOptions) -> Self:
        """An instance for `options` built already."""
        instance = cls.__new__(cls)
        instance.options = options
        instance._setup()
        return instance

    def _setup(self) -> None:
        raise NotImplementedError


class AsyncEngine(_Configured):
    """`async with AsyncEngine(model_dir, ...) as engine:` runs the engine inside the caller's trio run.

    Leaving the block finishes every accepted request (graceful drain); an exception cancels them.
    Cancelling a task that waits on `generate` or `stream` cancels its requests and frees their memory.
    """

    def _setup(self) -> None:
        self._stack: AsyncExitStack | None = None
        self._handle: EngineHandle | None = None
        self._num_requests = 0
        self._ended = trio.Event()  # set (and replaced) whenever a request of this engine ends

    async def __aenter__(self) -> AsyncEngine:
        if self._stack is not None:
            raise RuntimeError("AsyncEngine: already running")
        async with AsyncExitStack() as stack:
            try:
                self._handle = await stack.enter_async_context(_running(self.options))
            except BaseExceptionGroup as group:  # a start-up failure: raise the error itself
                if len(group.exceptions) != 1:
                    raise
                raise group.exceptions[0] from None
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None, "__aexit__ without __aenter__"
        try:
            return await stack.__aexit__(exc_type, exc, tb)
        finally:
            self._handle = None

    @property
    def handle(self) -> EngineHandle:
        if self._handle is None:
            raise RuntimeError("AsyncEngine: not running (use `async with AsyncEngine(...) as engine`)")
        return self._handle

    def stats(self) -> StatsEvent:
        return self.handle.stats()

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        """Pool -> (used, capacity) slots."""
        return self.handle.pool_usage()

    async def generate(self, prompts: Prompts, params: Params = None) -> list[Completion]:
        """Completions of `prompts` in input order; raises RequestError if any request fails.

        A batch larger than the engine's admission bound queues: each prompt is submitted as soon as
        capacity frees up (never `overloaded`)."""
        handle, items = self.handle, prompt_list(prompts)
        per_prompt = params_list(params, len(items))
        results: list[Completion | RequestError | None] = [None] * len(items)
        opened: list[tuple[str, trio.MemoryReceiveChannel[protocol.Event]]] = []
        refused: RequestError | None = None
        try:
            async with trio.open_nursery() as nursery:
                for i, (prompt, p) in enumerate(zip(items, per_prompt, strict=True)):
                    try:
                        opened.append(await self._open_queued(prompt, p))
                    except RequestError as err:  # refused at submission: the others are cancelled
                        refused = err
                        nursery.cancel_scope.cancel()
                        break
                    nursery.start_soon(self._collect, opened[-1][1], results, i, nursery.cancel_scope)
        finally:
            for (rid, events), result in zip(opened, results, strict=False):
                events.close()
                if result is None:  # failed or cancelled meanwhile
                    handle.cancel(rid)
        for result in (refused, *results):
            if isinstance(result, RequestError):
                raise result
        return results  # type: ignore[return-value]

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[TokenEvent | Completion]:
        """Yield a `TokenEvent` per text delta, then the `Completion`; raises RequestError on failure."""
        item = one_prompt("prompt", prompt)
        rid, events = self._open(item, params or SamplingParams(), stream=True)
        finished = False
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    yield event
                    continue
                finished = True
                self._note_end()
                yield to_completion(event)
                return
        finally:
            events.close()
            if not finished and self._handle is not None:  # None: finalized after the engine stopped
                self._handle.cancel(rid)

    def _open(
        self, prompt: Prompt, params: SamplingParams, stream: bool
    ) -> tuple[str, trio.MemoryReceiveChannel[protocol.Event]]:
        self._num_requests += 1
        rid = f"api-{self._num_requests}"
        # unbounded: at most max_tokens + 1 events, and the tokenizer actor must never wait on one client
        send, recv = trio.open_memory_channel[protocol.Event](math.inf)
        self.handle.submit(to_submit(rid, prompt, params, stream), send)
        return rid, recv

    async def _open_queued(
        self, prompt: Prompt, params: SamplingParams
    ) -> tuple[str, trio.MemoryReceiveChannel[protocol.Event]]:
        """`_open`, waiting while the engine is full: until one of this engine's requests ends, or a
        short poll (capacity may also free up from requests nobody here watches any more)."""
        while True:
            try:
                return self._open(prompt, params, stream=False)
            except RequestError as err:
                if err.code != "overloaded":
                    raise
            with trio.move_on_after(QUEUE_POLL_S):
                await self._ended.wait()

    def _note_end(self) -> None:
        self._ended.set()
        self._ended = trio.Event()

    async def _collect(
        self,
        events: trio.MemoryReceiveChannel[protocol.Event],
        results: list[Completion | RequestError | None],
        index: int,
        scope: trio.CancelScope,
    ) -> None:
        async for event in events:
            if isinstance(event, TokenEvent):
                continue
            self._note_end()
            try:
                results[index] = to_completion(event)
            except RequestError as err:
                results[index] = err
                scope.cancel()
            return


# ---------------------------------------------------------------- sync engine


class Engine(_Configured):
    """The sync API: `with Engine(model_dir, ...) as engine: engine.generate(prompts, params)`.

    The engine runs in a background thread (its own trio run); `close()` waits for the calls in
    flight (so every accepted request finishes), stops it and joins the thread. Its methods may be
    called from several threads at once.
    """

    def _setup(self) -> None:
        self._engine = AsyncEngine._of(self.options)
        self._started: Future[trio.lowlevel.TrioToken] = Future()
        self._stop: trio.Event | None = None
        self._failure: BaseException | None = None
        self._calls = threading.Condition()  # guards _closed and _num_calls
        self._closed = False
        self._num_calls = 0
        self._thread = threading.Thread(target=self._run, name="dsv4serve-engine", daemon=True)
        self._thread.start()
        try:
            self._token = self._started.result()
        except BaseException:
            self._closed = True
            self._thread.join()
            raise

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompts: Prompts, params: Params = None) -> list[Completion]:
        """Completions of `prompts` in input order; raises RequestError if any request fails."""
        return self._call(self._engine.generate, prompts, params)

    def stats(self) -> StatsEvent:
        return self._call(_as_async(self._engine.stats))

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        return self._call(_as_async(self._engine.pool_usage))

    def close(self) -> None:
        """Wait for the calls in flight, stop the engine and join its thread (idempotent)."""
        with self._calls:
            if self._closed:
                return
            self._closed = True  # refuse new calls
            self._calls.wait_for(lambda: self._num_calls == 0)
        if self._stop is not None:
            with suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()
        if self._failure is not None:
            raise RuntimeError("Engine: the engine failed") from self._failure

    def _call(self, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        with self._calls:
            if self._closed:
                raise RuntimeError("Engine: closed")
            self._num_calls += 1
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("Engine: the engine thread has stopped") from self._failure or exc
        finally:
            with self._calls:
                self._num_calls -= 1
                self._calls.notify_all()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported by __init__ or close(), never swallowed
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                self._failure = exc

    async def _main(self) -> None:
        stop = trio.Event()
        async with self._engine:
            self._stop = stop
            self._started.set_result(trio.lowlevel.current_trio_token())
            await stop.wait()


def _as_async(fn: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    async def call() -> T:
        return fn()

    return call
