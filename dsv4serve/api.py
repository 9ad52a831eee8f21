"""The embedded Python API: `AsyncEngine` for trio programs and `Engine`, its sync facade.

Both run the actor system of `actors/system.py`; `Engine` runs it under `trio.run` in a background
thread and calls in with `trio.from_thread`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias, TypeGuard, TypeVar

import trio

from dsv4serve import logs, protocol
from dsv4serve.actors.system import EngineHandle, SystemOptions, run_system
from dsv4serve.config import EngineConfig
from dsv4serve.protocol import FinishReason, RequestError, StatsEvent, TokenEvent

Prompt: TypeAlias = str | Sequence[int]
T = TypeVar("T")


# ---------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request; bad values raise ValueError naming the field.

    temperature 0 = greedy; top_k 0 = off; seed None = derived from the engine seed and the request id.
    `stop` strings end the request and are cut from the text (a single string is one stop string).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        n, t, p, k = self.max_tokens, self.temperature, self.top_p, self.top_k
        _check("max_tokens", _is_int(n) and n >= 1, "an int >= 1", n)
        _check("temperature", _is_number(t) and t >= 0, "a number >= 0", t)
        _check("top_p", _is_number(p) and 0 < p <= 1, "a number in (0, 1]", p)
        _check("top_k", _is_int(k) and k >= 0, "an int >= 0 (0 = off)", k)
        _check("seed", self.seed is None or _is_int(self.seed), "an int or None", self.seed)
        _check("logprobs", isinstance(self.logprobs, bool), "a bool", self.logprobs)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        ok = _is_list(stop) and all(isinstance(s, str) and s for s in stop)
        _check("stop", ok, "a list of non-empty strings", self.stop)
        ids = self.stop_token_ids
        _check("stop_token_ids", _is_token_ids(ids, empty_ok=True), "a list of token ids (ints >= 0)", ids)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))


Prompts: TypeAlias = Prompt | Sequence[Prompt]  # a bare string is one prompt
Params: TypeAlias = SamplingParams | Sequence[SamplingParams] | None  # one for all, or one per prompt


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished request. `prompt_token_ids` are the ids the model saw (BOS included)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # one per token id, when asked


def _check(name: str, ok: bool, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_list(value: object) -> TypeGuard[Sequence[object]]:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _is_token_ids(value: object, empty_ok: bool) -> TypeGuard[Sequence[int]]:
    return _is_list(value) and (empty_ok or len(value) > 0) and all(_is_int(t) and t >= 0 for t in value)


def _prompt_list(prompts: Prompts) -> list[Prompt]:
    """A list of prompts (a bare string is one prompt); each a string or a non-empty list of ids."""
    items = [prompts] if isinstance(prompts, str) else prompts
    _check("prompts", _is_list(items) and len(items) > 0, "a non-empty list of prompts", prompts)
    return [_prompt(f"prompts[{i}]", prompt) for i, prompt in enumerate(items)]


def _prompt(name: str, prompt: object) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt, empty_ok=False):
        return list(prompt)
    raise ValueError(f"{name}: expected a string or a non-empty list of token ids, got {prompt!r}")


def _params_list(params: Params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"params: expected one SamplingParams per prompt ({n}), got {len(params)}")
    for i, p in enumerate(params):
        _check(f"params[{i}]", isinstance(p, SamplingParams), "a SamplingParams", p)
    return list(params)


def _submit(rid: str, prompt: Prompt, params: SamplingParams, stream: bool) -> protocol.Submit:
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
    spec = protocol.SamplingSpec(
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=params.top_k,
        seed=params.seed,
        logprobs=params.logprobs,
    )
    return protocol.Submit(
        rid=rid,
        prompt=text,
        prompt_token_ids=ids,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        stream=stream,
        sampling=spec,
        echo_prompt=True,
    )


# ---------------------------------------------------------------- async engine


def _completion(event: protocol.Event) -> Completion:
    match event:
        case protocol.DoneEvent():
            assert event.prompt_token_ids is not None, "every Submit asks for them"
            return Completion(
                token_ids=event.token_ids,
                text=event.text,
                finish_reason=event.finish_reason,
                prompt_token_ids=event.prompt_token_ids,
                logprobs=event.logprobs,
            )
        case protocol.ErrorEvent():
            raise RequestError(event.code, event.message, event.id)
        case _:
            raise AssertionError(f"unexpected event {event!r}")


def system_options(model: str | Path, engine: EngineConfig) -> SystemOptions:
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model: no config.json in {model_dir}")
    return SystemOptions(model_dir=model_dir, engine=engine)


@asynccontextmanager
async def _running(options: SystemOptions) -> AsyncIterator[EngineHandle]:
    """The system for the body's lifetime: drained after a normal exit, shut down after an error."""
    async with trio.open_nursery() as nursery:
        handle: EngineHandle = await nursery.start(run_system, options)
        try:
            yield handle
        except BaseException:
            handle.shutdown()
            raise
        await handle.drain()


class AsyncEngine:
    """`async with AsyncEngine(model_dir, ...) as engine:` runs the engine inside the caller's trio run.

    Leaving the block finishes every accepted request (graceful drain); an exception cancels them.
    Cancelling a task that waits on `generate` or `stream` cancels its requests and frees their memory.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_total_tokens: int = 65536,
        page_size: int = 128,
        state_mode: str = "paged",
        seed: int | None = None,
    ) -> None:
        knobs: dict[str, Any] = {"device": device, "dtype": dtype, "max_num_seqs": max_num_seqs}
        knobs |= {"max_num_batched_tokens": max_num_batched_tokens, "max_total_tokens": max_total_tokens}
        knobs |= {"page_size": page_size, "state_mode": state_mode}
        knobs |= {} if seed is None else {"seed": seed}  # None: EngineConfig's default seed
        self.options = system_options(model, EngineConfig(**knobs))
        logs.configure_default()
        self._stack: AsyncExitStack | None = None
        self._handle: EngineHandle | None = None
        self._num_requests = 0

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
        """Completions of `prompts` in input order; raises RequestError if any request fails."""
        handle, items = self.handle, _prompt_list(prompts)
        opened = self._open_all(items, _params_list(params, len(items)))
        results: list[Completion | RequestError | None] = [None] * len(items)
        try:
            async with trio.open_nursery() as nursery:
                for i, (_, events) in enumerate(opened):
                    nursery.start_soon(self._collect, events, results, i, nursery.cancel_scope)
        finally:
            for (rid, events), result in zip(opened, results, strict=True):
                events.close()
                if result is None:  # failed or cancelled meanwhile
                    handle.cancel(rid)
        for result in results:
            if isinstance(result, RequestError):
                raise result
        return results  # type: ignore[return-value]

    async def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> AsyncIterator[TokenEvent | Completion]:
        """Yield a `TokenEvent` per text delta, then the `Completion`; raises RequestError on failure."""
        item = _prompt("prompt", prompt)
        rid, events = self._open(item, params or SamplingParams(), stream=True)
        finished = False
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    yield event
                    continue
                finished = True
                yield _completion(event)
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
        self.handle.submit(_submit(rid, prompt, params, stream), send)
        return rid, recv

    def _open_all(
        self, prompts: list[Prompt], params: list[SamplingParams]
    ) -> list[tuple[str, trio.MemoryReceiveChannel[protocol.Event]]]:
        opened: list[tuple[str, trio.MemoryReceiveChannel[protocol.Event]]] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                opened.append(self._open(prompt, p, stream=False))
        except BaseException:
            for rid, _ in opened:
                self.handle.cancel(rid)
            raise
        return opened

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
            try:
                results[index] = _completion(event)
            except RequestError as err:
                results[index] = err
                scope.cancel()
            return


# ---------------------------------------------------------------- sync engine


class Engine:
    """The sync API: `with Engine(model_dir, ...) as engine: engine.generate(prompts, params)`.

    The engine runs in a background thread (its own trio run); `close()` waits for the calls in
    flight (so every accepted request finishes), stops it and joins the thread. Its methods may be
    called from several threads at once.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_total_tokens: int = 65536,
        page_size: int = 128,
        state_mode: str = "paged",
        seed: int | None = None,
    ) -> None:
        self._engine = AsyncEngine(
            model,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_total_tokens=max_total_tokens,
            page_size=page_size,
            state_mode=state_mode,
            seed=seed,
        )
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
