"""The executor actor: runs each ready step on the device and reports `StepDone` to the scheduler.

`execute` is the device work (in the system: `ModelRunner.execute` in a worker thread under the
device's CapacityLimiter(1)). A step that raises fails every one of its items (`StepDone.failed`);
the engine keeps serving the others. One canonical log line per step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import assert_never

import structlog
import trio

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

ExecuteFn = Callable[[StepPlan], Awaitable[Sequence[SampledToken]]]


async def run_step(
    execute: ExecuteFn, plan: StepPlan, log: structlog.typing.FilteringBoundLogger
) -> StepDone:
    ran = tuple(item.rid for item in plan.items)
    try:
        outputs = tuple(await execute(plan))
    except Exception as exc:  # contained: the step's requests fail, the engine goes on
        log.exception("step_failed", step=plan.step, rids=list(ran))
        message = f"step {plan.step} failed: {type(exc).__name__}: {exc}"
        failed = tuple(RequestFailure(rid=rid, message=message) for rid in ran)
        return StepDone(step=plan.step, outputs=(), ran=ran, failed=failed)
    return StepDone(step=plan.step, outputs=outputs, ran=ran)


async def run_executor(
    inbox: trio.MemoryReceiveChannel[ExecutorMsg],
    scheduler: trio.MemorySendChannel[SchedulerMsg],
    execute: ExecuteFn,
) -> None:
    log = structlog.get_logger().bind(actor="executor")
    async with inbox, scheduler:
        async for msg in inbox:
            match msg:
                case TablesReady(step=step, plan=plan, pool_used=used):
                    start = trio.current_time()
                    done = await run_step(execute, plan, log)
                    items = plan.items
                    log.info(
                        "step",
                        step=step,
                        num_reqs=len(items),
                        num_prefill_tokens=sum(len(i.token_ids) for i in items if not _is_decode(i)),
                        num_decode=sum(1 for i in items if _is_decode(i)),
                        duration_ms=round((trio.current_time() - start) * 1e3, 3),
                        num_failed=len(done.failed),
                        pool_used=used,
                    )
                    await scheduler.send(done)
                case Drain():
                    return
                case _:
                    assert_never(msg)


def _is_decode(item: StepItem) -> bool:
    """A one-token item that samples (a final one-token prefill chunk counts as a decode too)."""
    return item.sample and len(item.token_ids) == 1
