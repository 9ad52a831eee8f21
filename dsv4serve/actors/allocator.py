"""The allocator actor: a thin loop around `KVAllocator` (pools, free lists, slot messages).

For each step it decides the items in plan order: a refused item allocates nothing and is dropped
from the plan (a lookahead decode whose previous step was refused is refused too, pool 'base'); the
step's `AllocRefused` goes to the scheduler before its granted part goes on to the kv_writer (so a
fully refused step still returns its credit, and never reaches the executor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

import msgspec
import structlog
import trio

from dsv4serve.memory import KVAllocator, Refusal
from dsv4serve.protocol import (
    Allocate,
    AllocatorMsg,
    AllocRefused,
    CacheLocs,
    Drain,
    Free,
    KVWriterMsg,
    RefusedItem,
    SchedulerMsg,
    StepItem,
    StepPlan,
    WriteLocs,
)


@dataclass(frozen=True, slots=True)
class StepGrant:
    items: tuple[StepItem, ...]  # the granted items, rows filled
    locs: tuple[CacheLocs, ...]  # one per granted item
    refusals: tuple[RefusedItem, ...]


def allocate_step(alloc: KVAllocator, plan: StepPlan) -> StepGrant:
    items: list[StepItem] = []
    locs: list[CacheLocs] = []
    refusals: list[RefusedItem] = []
    for item in plan.items:
        held = alloc.length_of(item.rid) if alloc.holds(item.rid) else 0
        if held != item.prefix_len:  # a lookahead decode whose previous step was refused
            assert item.is_lookahead, (item.rid, held, item.prefix_len)
            refusals.append(RefusedItem(rid=item.rid, pool="base", reason="its previous step was refused"))
            continue
        got = alloc.allocate(item.rid, item.prefix_len, item.seq_len, plan.step)
        if isinstance(got, Refusal):
            reason = f"{got.reason}: needs {got.needed_slots}, has {got.free_slots}"
            pool = "rows" if got.pool == "row" else got.pool
            refusals.append(RefusedItem(rid=item.rid, pool=pool, reason=reason))
        else:
            items.append(msgspec.structs.replace(item, row=got.row))
            locs.append(got)
    return StepGrant(tuple(items), tuple(locs), tuple(refusals))


def pool_used(alloc: KVAllocator) -> dict[str, int]:
    return {name: usage.used for name, usage in alloc.usage().items()}


async def run_allocator(
    inbox: trio.MemoryReceiveChannel[AllocatorMsg],
    kv_writer: trio.MemorySendChannel[KVWriterMsg],
    scheduler: trio.MemorySendChannel[SchedulerMsg],
    alloc: KVAllocator,
) -> None:
    log = structlog.get_logger().bind(actor="allocator")
    async with inbox, kv_writer, scheduler:
        async for msg in inbox:
            match msg:
                case Allocate(step=step, plan=plan):
                    grant = allocate_step(alloc, plan)
                    if grant.refusals:
                        log.info("refused", step=step, refusals=[(r.rid, r.pool) for r in grant.refusals])
                        await scheduler.send(AllocRefused(step=step, refusals=grant.refusals))
                    if grant.items:
                        granted = StepPlan(step=step, items=grant.items)
                        await kv_writer.send(
                            WriteLocs(step=step, plan=granted, locs=grant.locs, pool_used=pool_used(alloc))
                        )
                case Free(rid=rid):
                    alloc.free(rid)
                case Drain():
                    assert alloc.num_requests == 0, f"{alloc.num_requests} requests hold cache at drain"
                    await kv_writer.send(msg)
                    return
                case _:
                    assert_never(msg)
