"""The executor actor: launches each ready step on the device and reports `StepDone` to the scheduler.

Two tasks keep the device busy: the launcher queues each step as soon as its tables are ready
(`launch`: in the system, `ModelRunner.launch` under the device's limiter, in a worker thread unless
it replays a captured graph; it returns without waiting for the device), and the reporter waits for
the launched steps' results in order (`collect`, the GIL released meanwhile) and sends their
`StepDone`. So while step N runs, step
N + 1 (with its lookahead decodes) is already queued behind it. A step whose launch or collect
raises fails every one of its items (`StepDone.failed`); the engine keeps serving the others, unless
the ranks of a tensor-parallel engine fell out of step (`RanksBroken`): that stops the engine. One
canonical log line per step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import assert_never

import structlog
import trio

from dsv4serve.executor.ranks import RanksBroken
from dsv4serve.protocol import (
    Drain,
    ExecutorMsg,
    RequestFailure,
    SampledToken,
    SchedulerMsg,
    StepDone,
    StepItem,
    StepPlan,
    TablesReady,
)

Collect = Callable[[], Awaitable[Sequence[SampledToken]]]
LaunchFn = Callable[[StepPlan], Awaitable[Collect]]  # queue the step; the awaitable gives its tokens
ExecuteFn = Callable[[StepPlan], Awaitable[Sequence[SampledToken]]]


def at_once(execute: ExecuteFn) -> LaunchFn:
    """A one-phase `execute` as a launch whose collect does all the work (test doubles)."""

    async def launch(plan: StepPlan) -> Collect:
        async def collect() -> Sequence[SampledToken]:
            return await execute(plan)

        return collect

    return launch


@dataclass(frozen=True, slots=True)
class _Launched:
    plan: StepPlan
    collect: Collect
    pool_used: dict[str, int]
    start: float


class TablesFailed(RuntimeError):
    """The KV writer could not write a step's tables; the step is not run."""


def _raising(exc: Exception) -> Collect:
    async def collect() -> Sequence[SampledToken]:
        raise exc

    return collect


async def run_step(collect: Collect, plan: StepPlan, log: structlog.typing.FilteringBoundLogger) -> StepDone:
    ran = tuple(item.rid for item in plan.items)
    try:
        outputs = tuple(await collect())
    except RanksBroken:  # the ranks are out of step: the engine stops (every live request errs)
        raise
    except Exception as exc:  # contained: the step's requests fail, the engine goes on
        log.exception("step_failed", step=plan.step, rids=list(ran))
        message = f"step {plan.step} failed: {type(exc).__name__}: {exc}"
        failed = tuple(RequestFailure(rid=rid, message=message) for rid in ran)
        return StepDone(step=plan.step, outputs=(), ran=ran, failed=failed)
    return StepDone(step=plan.step, outputs=outputs, ran=ran)


async def run_executor(
    inbox: trio.MemoryReceiveChannel[ExecutorMsg],
    scheduler: trio.MemorySendChannel[SchedulerMsg],
    launch: LaunchFn,
    max_inflight_steps: int = 2,
) -> None:
    log = structlog.get_logger().bind(actor="executor")
    to_report, launched = trio.open_memory_channel[_Launched](max_inflight_steps)
    async with inbox, scheduler, trio.open_nursery() as nursery:
        nursery.start_soon(_report, launched, scheduler, log)
        async with to_report:
            async for msg in inbox:
                match msg:
                    case TablesReady(plan=plan, pool_used=used, error=error):
                        start = trio.current_time()
                        try:
                            if error is not None:
                                raise TablesFailed(error)
                            collect = await launch(plan)
                        except Exception as exc:  # reported (and contained) in order, by the reporter
                            collect = _raising(exc)
                        await to_report.send(_Launched(plan, collect, used, start))
                    case Drain():
                        break
                    case _:
                        assert_never(msg)


async def _report(
    launched: trio.MemoryReceiveChannel[_Launched],
    scheduler: trio.MemorySendChannel[SchedulerMsg],
    log: structlog.typing.FilteringBoundLogger,
) -> None:
    async with launched:
        async for job in launched:
            done = await run_step(job.collect, job.plan, log)
            items = job.plan.items
            log.info(
                "step",
                step=job.plan.step,
                num_reqs=len(items),
                num_prefill_tokens=sum(len(i.token_ids) for i in items if not _is_decode(i)),
                num_decode=sum(1 for i in items if _is_decode(i)),
                duration_ms=round((trio.current_time() - job.start) * 1e3, 3),
                num_failed=len(done.failed),
                pool_used=job.pool_used,
            )
            await scheduler.send(done)


def _is_decode(item: StepItem) -> bool:
    """A one-token item that samples (a final one-token prefill chunk counts as a decode too)."""
    return item.sample and len(item.token_ids) == 1
