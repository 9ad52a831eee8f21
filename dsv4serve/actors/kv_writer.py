"""The kv_writer actor (the pre-write hook): writes each step's slot messages (`CacheLocs`, one packed
field per pool of the model's layout) into the per-request slot tables the attention kernels read,
then tells the executor that the step's tables are ready.

`write` is the device work (in the system: `write_cache_locs_batch`, which only queues a copy and a
store on the device's stream, ahead of the step that reads them). It only writes table entries of
this step's new positions, which no step in flight reads. A write that raises fails only the
requests of its step (the executor reports them failed instead of running the step).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import assert_never

import structlog
import trio

from dsv4serve.protocol import CacheLocs, Drain, ExecutorMsg, KVWriterMsg, TablesReady, WriteLocs

WriteLocsFn = Callable[[Sequence[CacheLocs]], Awaitable[None]]


async def run_kv_writer(
    inbox: trio.MemoryReceiveChannel[KVWriterMsg],
    executor: trio.MemorySendChannel[ExecutorMsg],
    write: WriteLocsFn,
) -> None:
    log = structlog.get_logger().bind(actor="kv_writer")
    async with inbox, executor:
        async for msg in inbox:
            match msg:
                case WriteLocs(step=step, plan=plan, locs=locs, pool_used=used):
                    error = None
                    try:
                        await write(locs)
                    except Exception as exc:  # contained: the executor fails this step's requests
                        log.exception("write_failed", step=step, rids=[item.rid for item in plan.items])
                        error = f"KV table write failed: {type(exc).__name__}: {exc}"
                    await executor.send(TablesReady(step=step, plan=plan, pool_used=used, error=error))
                case Drain():
                    await executor.send(msg)
                    return
                case _:
                    assert_never(msg)
