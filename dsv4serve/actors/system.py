"""The root: loads the model, opens one nursery, wires the five actors, hands out an `EngineHandle`.

Flow (bounded channels; capacities below):
  handle --Submit/Cancel/Drain--> tokenizer --Tokenized/StopHit/Cancel--> scheduler
  scheduler --Allocate/Free--> allocator --WriteLocs--> kv_writer --TablesReady--> executor
  allocator --AllocRefused--> scheduler;  executor --StepDone--> scheduler
  scheduler --Detokenize/FailRequest--> tokenizer --events--> client channels
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
from dsv4serve.executor.runner import ModelRunner
from dsv4serve.memory import KVAllocator, write_cache_locs_batch
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


@dataclass(frozen=True)
class SystemOptions:
    model_dir: Path
    engine: EngineConfig
    max_waiting: int = 1024  # admission bound: live requests <= max_waiting + max_num_seqs
    max_inflight_steps: int = 2  # credit rule K
    # a model already built (benchmarks build random weights on the device): used instead of loading
    prebuilt: tuple[ModelRunner, PreTrainedTokenizerFast] | None = field(default=None, compare=False)


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


def load_model(options: SystemOptions) -> tuple[ModelRunner, PreTrainedTokenizerFast]:
    if options.prebuilt is not None:
        return options.prebuilt
    bos = spec_for(config_from_dir(options.model_dir).model_type).prompt_bos
    tokenizer = load_tokenizer(
        options.model_dir, require_bos=bos
    )  # first: a bad one fails before the weights
    return ModelRunner(options.model_dir, options.engine), tokenizer


def parts_of(runner: ModelRunner, tok: PreTrainedTokenizerFast) -> Parts:
    """Launches run under one CapacityLimiter(1) for the device: in a worker thread, except the replay
    of a captured decode graph (~0.1-0.4 ms of host work, less than a thread's round trip costs on top:
    ~0.17 ms on a 2-core machine); collects of steps still on the device wait in worker threads (the
    GIL released)."""
    limiter = trio.CapacityLimiter(1)

    async def write_locs(locs: Sequence[CacheLocs]) -> None:
        # on the trio thread: index arithmetic and an asynchronous copy + store, queued on the device's
        # stream ahead of the step that reads them; it never waits for the device
        write_cache_locs_batch(runner.tables, locs)

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

    return Parts(
        model=runner.model_cfg,
        allocator=KVAllocator(runner.model_cfg, runner.engine, runner.sizes),
        encode=partial(encode_prompt, tok, prepend_bos=spec_for(runner.model_cfg.model_type).prompt_bos),
        decoder=tok,
        max_token_chars=max_token_chars(tok),
        write_locs=write_locs,
        launch=launch,
        weight_bytes=runner.weight_bytes,
    )


class EngineHandle:
    """The front door; every method is called from trio tasks of the system's trio run."""

    def __init__(
        self,
        parts: Parts,
        options: SystemOptions,
        front: trio.MemorySendChannel[TokenizerMsg],
        clients: Clients,
        gauges: SchedulerGauges,
        nursery: trio.Nursery,
    ) -> None:
        self.model = parts.model
        self.decoder = parts.decoder  # token strings for front doors (logprobs)
        self._allocator = parts.allocator
        self._weight_bytes = parts.weight_bytes
        self._front, self._clients, self._gauges, self._nursery = front, clients, gauges, nursery
        self._max_live = options.max_waiting + options.engine.max_num_seqs
        self._started_at = trio.current_time()
        self._draining = False
        self.stopped = trio.Event()

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
            waiting=max(0, self._clients.num_live - gauges.running),
            pools=pools,
            tokens_per_s=gauges.tokens_per_s(now, uptime),
            num_steps=gauges.num_steps,
            num_finished=gauges.num_finished,
            num_preemptions=gauges.num_preemptions,
            uptime_s=uptime,
            weight_bytes=dict(self._weight_bytes),
            finished_by_reason=dict(gauges.finished_by_reason),
            num_generated=gauges.num_generated,
        )

    def pool_usage(self) -> dict[str, tuple[int, int]]:
        return {name: (u.used, u.capacity) for name, u in self._allocator.usage().items()}

    async def drain(self) -> None:
        if not self._draining and not self.stopped.is_set():
            self._draining = True
            with contextlib.suppress(*_GONE):
                await self._front.send(Drain())
        await self.stopped.wait()

    def shutdown(self) -> None:
        self._draining = True
        self._nursery.cancel_scope.cancel()


async def run_system(
    options: SystemOptions, *, task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Load the model (in a worker thread), then run the actors; returns after drain or shutdown."""
    log = structlog.get_logger().bind(actor="system")
    runner, tok = await trio.to_thread.run_sync(load_model, options)
    parts = parts_of(runner, tok)
    log.info(
        "loaded",
        model_dir=str(options.model_dir),
        pool_pages=parts.allocator.sizes.as_dict(),
        weight_bytes=parts.weight_bytes,
    )
    await run_actors(parts, options, task_status=task_status)


async def run_actors(
    parts: Parts,
    options: SystemOptions,
    *,
    task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    engine, k = options.engine, options.max_inflight_steps
    max_live = options.max_waiting + engine.max_num_seqs
    max_model_len = engine.resolved_max_model_len(parts.model)
    front, tokenizer_inbox = trio.open_memory_channel[TokenizerMsg](2 * max_live + 64)
    to_scheduler, scheduler_inbox = trio.open_memory_channel[SchedulerMsg](4 * max_live + 4 * k + 64)
    to_allocator, allocator_inbox = trio.open_memory_channel[AllocatorMsg](2 * engine.max_num_seqs + k + 16)
    to_writer, writer_inbox = trio.open_memory_channel[KVWriterMsg](k)
    to_executor, executor_inbox = trio.open_memory_channel[ExecutorMsg](k)
    core = SchedulerCore(
        engine.max_num_seqs,
        engine.max_num_batched_tokens,
        max_model_len,
        k,
        parts.model.eos_token_ids,
        lookahead=True,
    )
    clients, gauges = Clients(), SchedulerGauges()
    handle: EngineHandle | None = None
    try:
        async with trio.open_nursery() as nursery:
            handle = EngineHandle(parts, options, front, clients, gauges, nursery)
            async with to_scheduler:  # the actors hold clones
                nursery.start_soon(
                    run_tokenizer,
                    tokenizer_inbox,
                    to_scheduler.clone(),
                    clients,
                    parts.encode,
                    parts.decoder,
                    max_model_len,
                    parts.max_token_chars,
                )
                nursery.start_soon(run_scheduler, scheduler_inbox, to_allocator, front.clone(), core, gauges)
                nursery.start_soon(
                    run_allocator, allocator_inbox, to_writer, to_scheduler.clone(), parts.allocator
                )
                nursery.start_soon(run_kv_writer, writer_inbox, to_executor, parts.write_locs)
                nursery.start_soon(run_executor, executor_inbox, to_scheduler.clone(), parts.launch, k)
            task_status.started(handle)
    except Exception:
        structlog.get_logger().bind(actor="system").exception("engine_crashed")
        raise
    finally:
        _fail_live(clients, "the engine stopped before the request finished")
        front.close()
        if handle is not None:
            handle.stopped.set()


def _fail_live(clients: Clients, message: str) -> None:
    for rid, client in clients.live():
        clients.end(rid)
        try:
            client.events.send_nowait(ErrorEvent(id=rid, code="internal", message=message))
        except (trio.WouldBlock, *_GONE):
            pass
