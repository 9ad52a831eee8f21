"""The root: loads the model, opens one nursery, wires the five actors, hands out an `EngineHandle`.

Flow (bounded channels; capacities below):
  handle --Submit/Cancel/Drain--> tokenizer --Tokenized/StopHit/Cancel--> scheduler
  scheduler --Allocate/Free--> allocator --WriteLocs--> kv_writer --TablesReady--> executor
  allocator --AllocRefused--> scheduler;  executor --StepDone--> scheduler
  scheduler --Outputs (a step's Detokenize/FailRequest)--> tokenizer --events--> client channels
With `SystemOptions.core_process` the tokenizer <-> scheduler edges cross a process boundary
(core_process.py): the handle and the tokenizer stay in the front process, the rest run in the
engine core, and the channels' messages travel as msgpack frames over a Unix socket.
Deadlock freedom: the scheduler's inbox is sized never to fill (at most 2 messages per in-flight step,
K steps by the credit rule, and at most 3 per live request, whose number the handle caps), so the
executor, allocator and tokenizer never block on it, and every other edge drains downstream. The
tokenizer awaits each client's event channel: a client that stops reading slows the engine down
(close the channel to go away: the request is then cancelled).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import structlog
import trio
from transformers import PreTrainedTokenizerFast

from dsv4serve.actors.allocator import run_allocator
from dsv4serve.actors.executor import Collect, LaunchFn, run_executor
from dsv4serve.actors.kv_writer import WriteLocsFn, run_kv_writer
from dsv4serve.actors.scheduler import SchedulerGauges, run_scheduler
from dsv4serve.actors.tokenizer import Client, Clients, run_tokenizer
from dsv4serve.actors.tokenizer_core import SupportsDecode, encode_prompt, load_tokenizer, max_token_chars
from dsv4serve.config import EngineConfig
from dsv4serve.executor.ranks import RanksBroken
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.memory import KVAllocator
from dsv4serve.memory.layout import ServedModelConfig
from dsv4serve.models.registry import config_from_dir, spec_for
from dsv4serve.protocol import (
    AllocatorMsg,
    CacheLocs,
    CancelRequest,
    Drain,
    ErrorEvent,
    Event,
    ExecutorMsg,
    KVWriterMsg,
    PoolStat,
    RequestError,
    SampledToken,
    SchedulerMsg,
    StatsEvent,
    StepPlan,
    Submit,
    TokenizerMsg,
    check_submit,
)
from dsv4serve.scheduler import SchedulerCore

_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)
FULL_WAIT_S = 5.0  # how long the last errors of live requests wait, in all, for room in full channels


@dataclass(frozen=True)
class SystemOptions:
    model_dir: Path
    engine: EngineConfig
    max_waiting: int = 1024  # admission bound: live requests <= max_waiting + max_num_seqs
    max_inflight_steps: int = 2  # credit rule K
    core_process: bool = False  # the engine core (scheduler .. executor) in a process of its own
    # a model already built (benchmarks build random weights on the device): used instead of loading
    prebuilt: tuple[ModelRunner, PreTrainedTokenizerFast] | None = field(default=None, compare=False)


class EngineCoreDied(RuntimeError):
    """The engine core stopped while it still held requests: its process exited, or its ranks fell out
    of step (`RanksBroken`) (`EngineHandle.failure` says how)."""


def rank_break(exc: BaseException) -> RanksBroken | None:
    """The RanksBroken that `exc` is, alone or as the only kind in (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        found = [rank_break(e) for e in exc.exceptions]
        return found[0] if found and all(found) else None
    return exc if isinstance(exc, RanksBroken) else None


def is_core_death(exc: BaseException) -> bool:
    """Whether `exc` is EngineCoreDied, alone or as the only kind in (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_core_death(e) for e in exc.exceptions)
    return isinstance(exc, EngineCoreDied)


@dataclass(frozen=True)
class FrontParts:
    """What the handle and the tokenizer drive (the front process's share of `Parts`)."""

    model: ServedModelConfig
    encode: Callable[[str], list[int]]
    decoder: SupportsDecode
    max_model_len: int  # the engine core's (its KV sized when it loaded)
    max_token_chars: int | None = None
    weight_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Parts:
    """What the actors drive, built once; tests substitute fakes for the two device functions."""

    model: ServedModelConfig
    allocator: KVAllocator
    encode: Callable[[str], list[int]]
    decoder: SupportsDecode
    write_locs: WriteLocsFn
    launch: LaunchFn
    max_token_chars: int | None = None  # the longest token's text (None: no early length check)
    weight_bytes: dict[str, int] = field(default_factory=dict)  # resident weight bytes by format

    @property
    def front(self) -> FrontParts:
        return FrontParts(
            self.model,
            self.encode,
            self.decoder,
            self.allocator.max_model_len,
            self.max_token_chars,
            self.weight_bytes,
        )


def load_model(options: SystemOptions) -> tuple[ModelRunner, PreTrainedTokenizerFast]:
    if options.prebuilt is not None:
        return options.prebuilt
    bos = spec_for(config_from_dir(options.model_dir).model_type).prompt_bos
    tokenizer = load_tokenizer(
        options.model_dir, require_bos=bos
    )  # first: a bad one fails before the weights
    return ModelRunner(options.model_dir, options.engine), tokenizer


def parts_of(runner: ModelRunner, tok: PreTrainedTokenizerFast) -> Parts:
    allocator, write_locs, launch = device_parts(runner)
    return Parts(
        model=runner.model_cfg,
        allocator=allocator,
        encode=partial(encode_prompt, tok, prepend_bos=spec_for(runner.model_cfg.model_type).prompt_bos),
        decoder=tok,
        max_token_chars=max_token_chars(tok),
        write_locs=write_locs,
        launch=launch,
        weight_bytes=runner.weight_bytes,
    )


def device_parts(runner: ModelRunner) -> tuple[KVAllocator, WriteLocsFn, LaunchFn]:
    """What the engine-core actors drive: the allocator and the two device functions.

    Launches run under one CapacityLimiter(1) for the device: in a worker thread, except the replay
    of a captured decode graph (~0.1-0.4 ms of host work, less than a thread's round trip costs on top:
    ~0.17 ms on a 2-core machine); collects of steps still on the device wait in worker threads (the
    GIL released)."""
    limiter = trio.CapacityLimiter(1)

    async def write_locs(locs: Sequence[CacheLocs]) -> None:
        # on the trio thread: index arithmetic and an asynchronous copy + store, queued on the device's
        # stream ahead of the step that reads them; it never waits for the device
        runner.write_locs(locs)  # (and to the other ranks, under tensor parallelism)

    async def launch(plan: StepPlan) -> Collect:
        if runner.replays(plan):  # a captured decode step: launched here, without two thread hops
            async with limiter:
                pending = runner.launch(plan)
        else:
            pending = await trio.to_thread.run_sync(runner.launch, plan, limiter=limiter)

        async def collect() -> Sequence[SampledToken]:  # waits for the device, not for the limiter
            if pending.ready():
                return pending.wait().outputs
            return (await trio.to_thread.run_sync(pending.wait)).outputs

        return collect

    allocator = KVAllocator(runner.model_cfg, runner.engine, runner.sizes)
    return allocator, write_locs, launch


PoolUsageFn = Callable[[], dict[str, tuple[int, int]]]  # pool name -> (used, capacity) slots


class EngineHandle:
    """The front door; every method is called from trio tasks of the system's trio run."""

    def __init__(
        self,
        model: ServedModelConfig,
        decoder: SupportsDecode,
        pool_usage: PoolUsageFn,
        weight_bytes: dict[str, int],
        options: SystemOptions,
        front: trio.MemorySendChannel[TokenizerMsg],
        clients: Clients,
        gauges: SchedulerGauges,
        nursery: trio.Nursery,
        max_model_len: int,
    ) -> None:
        self.model, self.max_model_len = model, max_model_len
        self.decoder = decoder  # token strings for front doors (logprobs)
        self._pool_usage = pool_usage
        self._weight_bytes = weight_bytes
        self._front, self._clients, self._gauges, self._nursery = front, clients, gauges, nursery
        self._max_live = options.max_waiting + options.engine.max_num_seqs
        self._started_at = trio.current_time()
        self._draining = False
        self.stopped = trio.Event()
        self.failure: str | None = None  # why the engine stopped on its own (its core process died)
        self.undelivered: list[tuple[trio.MemorySendChannel[Event], ErrorEvent]] = []  # full channels'

    def submit(self, req: Submit, events: trio.MemorySendChannel[Event]) -> None:
        if self._draining or self.stopped.is_set():
            raise RequestError("internal", "the engine is draining or stopped", req.rid or None)
        if self._clients.get(req.rid) is not None:
            raise RequestError("duplicate_id", f"id: a request with id {req.rid!r} is running", req.rid)
        check_submit(req, self.model.vocab_size)
        busy = RequestError("overloaded", f"the engine holds {self._max_live} requests; retry later", req.rid)
        if self._clients.num_live >= self._max_live:
            raise busy
        try:
            self._front.send_nowait(req)
        except trio.WouldBlock:
            raise busy from None
        except _GONE:
            raise RequestError("internal", "the engine is stopped", req.rid) from None
        self._clients.add(req.rid, Client(events, trio.current_time()))

    def cancel(self, rid: str) -> bool:
        client = self._clients.get(rid)
        if client is None or client.ended:
            return False
        if not client.cancelled:
            client.cancelled = client.cancel_pending = True
            msg = CancelRequest(rid=rid)
            try:
                self._front.send_nowait(msg)
            except trio.WouldBlock:
                self._nursery.start_soon(self._send_late, msg)
            except _GONE:
                client.cancel_pending = False
        return True

    async def _send_late(self, msg: TokenizerMsg) -> None:
        with contextlib.suppress(*_GONE):  # the system stopped meanwhile: every request has ended
            await self._front.send(msg)

    def stats(self) -> StatsEvent:
        now, gauges = trio.current_time(), self._gauges
        uptime = now - self._started_at
        pools = {name: PoolStat(used=u, capacity=c) for name, (u, c) in self.pool_usage().items()}
        return StatsEvent(
            running=gauges.running,
            # this front's requests not running, or (several fronts) the core's count if larger
            waiting=max(gauges.waiting, self._clients.num_live - gauges.running),
            pools=pools,
            tokens_per_s=gauges.tokens_per_s(now, uptime),
            num_steps=gauges.num_steps,
            num_finished=sum(self._clients.ended_by_reason.values()),
            num_preemptions=gauges.num_preemptions,
            uptime_s=uptime,
            weight_bytes=dict(self._weight_bytes),
            finished_by_reason=dict(self._clients.ended_by_reason),  # also those the engine never saw
            num_generated=gauges.num_generated,
        )

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        return self._pool_usage()

    def on_end(self, watch: Callable[[str], None]) -> None:
        """`watch(reason)` at every accepted request's end (stop, length, cancelled, error, ...)."""
        self._clients.watchers.append(watch)

    async def drain(self) -> None:
        if not self._draining and not self.stopped.is_set():
            self._draining = True
            with contextlib.suppress(*_GONE):
                await self._front.send(Drain())
        await self.stopped.wait()

    def core_died(self, message: str) -> None:
        """The engine core is gone: every live request ends with `message` (at once, or once the system
        stopped where its client's channel is full), new ones are refused, and the system stops
        (`failure` set; the servers then exit non-zero). A second call (another core) changes nothing."""
        if self.failure is not None:
            return
        self.failure, self._draining = message, True
        self.undelivered += fail_live(self._clients, message)
        self._nursery.cancel_scope.cancel()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise EngineCoreDied(self.failure)

    def shutdown(self) -> None:
        self._draining = True
        self._nursery.cancel_scope.cancel()


async def run_system(
    options: SystemOptions, *, task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Load the model (in a worker thread), then run the actors in this process; returns after drain
    or shutdown. (`front.run_engine` is the entry that honours `options.core_process`.)"""
    log = structlog.get_logger().bind(actor="system")
    runner, tok = await trio.to_thread.run_sync(load_model, options)
    try:
        parts = parts_of(runner, tok)
        log.info(
            "loaded",
            model_dir=str(options.model_dir),
            pool_pages=parts.allocator.sizes.as_dict(),
            weight_bytes=parts.weight_bytes,
            max_total_tokens=runner.engine.kv_tokens,
            max_model_len=parts.allocator.max_model_len,
        )
        await run_actors(parts, options, task_status=task_status)
    finally:
        runner.close()  # the other ranks, under tensor parallelism


def channel_sizes(options: SystemOptions, fronts: int = 1) -> tuple[int, int]:
    """The tokenizer's and the scheduler's inbox capacities (the module docstring's rule); an engine
    core serving several front processes holds the live requests of each one's handle."""
    max_live = fronts * (options.max_waiting + options.engine.max_num_seqs)
    k = options.max_inflight_steps
    return 2 * max_live + 64, 4 * max_live + 4 * k + 64


def start_engine_actors(
    nursery: trio.Nursery,
    model: ServedModelConfig,
    options: SystemOptions,
    device: tuple[KVAllocator, WriteLocsFn, LaunchFn],
    scheduler: tuple[trio.MemorySendChannel[SchedulerMsg], trio.MemoryReceiveChannel[SchedulerMsg]],
    tokenizer: trio.MemorySendChannel[TokenizerMsg],
    gauges: SchedulerGauges,
    handle: EngineHandle | None = None,
) -> None:
    """The engine core: scheduler, allocator, KV writer and executor, in one process (with the
    tokenizer, or in the engine-core process). `scheduler`: its inbox's two ends (this function owns
    the send end: the allocator gets a clone, the executor the end itself); `tokenizer`: where the
    scheduler's outputs go."""
    del handle  # in one process the handle needs nothing from the core
    engine, k = options.engine, options.max_inflight_steps
    allocator, write_locs, launch = device
    to_scheduler, scheduler_inbox = scheduler
    to_allocator, allocator_inbox = trio.open_memory_channel[AllocatorMsg](2 * engine.max_num_seqs + k + 16)
    to_writer, writer_inbox = trio.open_memory_channel[KVWriterMsg](k)
    to_executor, executor_inbox = trio.open_memory_channel[ExecutorMsg](k)
    core = SchedulerCore(
        engine.max_num_seqs,
        engine.max_num_batched_tokens,
        allocator.max_model_len,
        k,
        model.eos_token_ids,
        lookahead=True,
    )
    nursery.start_soon(run_scheduler, scheduler_inbox, to_allocator, tokenizer, core, gauges)
    nursery.start_soon(run_allocator, allocator_inbox, to_writer, to_scheduler.clone(), allocator)
    nursery.start_soon(run_kv_writer, writer_inbox, to_executor, write_locs)
    nursery.start_soon(run_executor, executor_inbox, to_scheduler, launch, k)


async def run_actors(
    parts: Parts,
    options: SystemOptions,
    *,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Every actor in this trio run (the in-process engine)."""

    def pool_usage() -> dict[str, tuple[int, int]]:
        return {name: (u.used, u.capacity) for name, u in parts.allocator.usage().items()}

    device = (parts.allocator, parts.write_locs, parts.launch)
    start_core = partial(start_engine_actors, model=parts.model, options=options, device=device)
    await run_front_actors(parts.front, pool_usage, options, start_core, task_status=task_status)


StartCore = Callable[..., None]  # (nursery, scheduler=(send, receive), tokenizer=send, gauges=...) -> None


async def run_front_actors(
    parts: FrontParts,
    pool_usage: PoolUsageFn,
    options: SystemOptions,
    start_core: StartCore,
    *,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The handle and the tokenizer, and the engine core as `start_core` starts it: its actors here, or
    the bridge to its process. Every request still live when this returns has got an error event."""
    tokenizer_size, scheduler_size = channel_sizes(options)
    front, tokenizer_inbox = trio.open_memory_channel[TokenizerMsg](tokenizer_size)
    to_scheduler, scheduler_inbox = trio.open_memory_channel[SchedulerMsg](scheduler_size)
    clients, gauges = Clients(), SchedulerGauges()
    handle: EngineHandle | None = None
    try:
        async with trio.open_nursery() as nursery:
            handle = EngineHandle(
                parts.model, parts.decoder, pool_usage, parts.weight_bytes, options, front, clients, gauges,
                nursery, parts.max_model_len,
            )  # fmt: skip
            async with to_scheduler:  # the actors hold clones
                nursery.start_soon(
                    run_tokenizer,
                    tokenizer_inbox,
                    to_scheduler.clone(),
                    clients,
                    parts.encode,
                    parts.decoder,
                    parts.max_model_len,
                    parts.max_token_chars,
                    parts.model.vocab_size,
                )
                start_core(
                    nursery,
                    scheduler=(to_scheduler.clone(), scheduler_inbox),
                    tokenizer=front.clone(),
                    gauges=gauges,
                    handle=handle,
                )
            task_status.started(handle)
    except Exception as exc:
        broken = rank_break(exc)
        if broken is None or handle is None:
            structlog.get_logger().bind(actor="system").exception("engine_crashed")
            raise
        structlog.get_logger().bind(actor="system").error("ranks_broken", reason=str(broken))
        handle.failure = f"the engine stopped: {broken}"  # raised as EngineCoreDied by its owner
    finally:
        message = "the engine stopped before the request finished"
        if handle is not None and handle.failure is not None:
            message = handle.failure
        undelivered = fail_live(clients, message)
        if handle is not None:
            undelivered = handle.undelivered + undelivered
        with trio.CancelScope(shield=True):  # the actors are done: nothing else ends a request now
            await deliver(undelivered)
        front.close()
        if handle is not None:
            handle.stopped.set()


def fail_live(clients: Clients, message: str) -> list[tuple[trio.MemorySendChannel[Event], ErrorEvent]]:
    """End every live request with an `internal` error, now (no other task runs meanwhile); the
    events whose client channel is full (a slow reader, as stdio's shared one) are returned, for
    `deliver` once the system has stopped."""
    undelivered = []
    for rid, client in clients.live():
        clients.end(rid, "error")
        event = ErrorEvent(id=rid, code="internal", message=message)
        try:
            client.events.send_nowait(event)
        except trio.WouldBlock:
            undelivered.append((client.events, event))
        except _GONE:
            pass
    return undelivered


async def deliver(undelivered: list[tuple[trio.MemorySendChannel[Event], ErrorEvent]]) -> None:
    """Send the events that found no room, waiting for room up to FULL_WAIT_S in all."""
    with trio.move_on_after(FULL_WAIT_S):
        for channel, event in undelivered:
            with contextlib.suppress(*_GONE):
                await channel.send(event)
