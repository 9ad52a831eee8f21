"""The scheduler actor: a thin loop around `SchedulerCore` (the policy lives there).

Each message updates the core; then every request that left it is reported (Free to the allocator
when it holds memory, Detokenize / FailRequest to the tokenizer) and new steps are planned while the
core allows (at most K in flight: the credit rule that keeps the scheduler <-> executor cycle from
deadlocking). Drain: once nothing is left, Drain goes to the allocator and the tokenizer, the send
ends close, and the actor reads its inbox until every producer has closed theirs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import assert_never

import structlog
import trio

from dsv4serve.protocol import (
    Allocate,
    AllocatorMsg,
    AllocRefused,
    CancelRequest,
    Detokenize,
    Drain,
    ErrorCode,
    FailRequest,
    FinishReason,
    Free,
    FreeReason,
    Outputs,
    SampledToken,
    SchedulerMsg,
    StepDone,
    StopHit,
    Tokenized,
    TokenizerMsg,
)
from dsv4serve.scheduler import CancelOutcome, Finished, SchedulerCore
from dsv4serve.scheduler.policy import UNSERVABLE

RATE_WINDOW_S = 10.0


@dataclass(eq=False, slots=True)
class SchedulerGauges:
    """Counters the scheduler updates and the engine handle reads (for `stats`)."""

    running: int = 0
    waiting: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_generated: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)  # cancelled and failed ones too
    _recent: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) per step

    @property
    def num_finished(self) -> int:
        return sum(self.finished_by_reason.values())

    def add_tokens(self, now: float, count: int) -> None:
        self.num_generated += count
        self._recent.append((now, count))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_s(self, now: float, uptime_s: float) -> float:
        window = min(RATE_WINDOW_S, uptime_s)
        recent = sum(n for t, n in self._recent if t >= now - window)
        return recent / window if window > 0 else 0.0


@dataclass(eq=False)
class _Scheduler:
    core: SchedulerCore
    allocator: trio.MemorySendChannel[AllocatorMsg]
    tokenizer: trio.MemorySendChannel[TokenizerMsg]
    gauges: SchedulerGauges
    failures: dict[str, str] = field(default_factory=dict)  # rid -> why its step failed, until it ends

    async def step_done(self, msg: StepDone) -> None:
        self.failures.update((f.rid, f.message) for f in msg.failed)  # a request may end a step later
        outcome = self.core.on_step_done(msg.step, msg.outputs, [f.rid for f in msg.failed])
        now = trio.current_time()
        self.gauges.add_tokens(now, len(outcome.tokens))
        await self.report(outcome.tokens, outcome.finished)

    async def refused(self, msg: AllocRefused) -> None:
        outcome = self.core.on_refused(msg.step, [r.rid for r in msg.refusals])
        for rid in outcome.preempted:
            self.gauges.num_preemptions += 1
            await self.allocator.send(Free(rid=rid, reason="preempted"))
        await self.report(outcome.tokens, outcome.finished)

    async def ended_early(self, outcome: CancelOutcome) -> None:
        if outcome.finished is not None:
            await self.report((), (outcome.finished,))

    async def report(self, tokens: Iterable[SampledToken], finished: Iterable[Finished]) -> None:
        """Free what the finished requests hold; send every request's new ids (and end) to the tokenizer
        in one `Outputs` message (the gauges first: an engine-core process sends them along)."""
        self.gauges.running, self.gauges.waiting = self.core.num_running, self.core.num_waiting
        new = {t.rid: t for t in tokens}
        items: list[Detokenize | FailRequest] = []
        for fin in finished:
            by_reason = self.gauges.finished_by_reason
            by_reason[fin.finish_reason] = by_reason.get(fin.finish_reason, 0) + 1
            if fin.holds_memory:
                reason: FreeReason = "finished" if fin.finish_reason in ("stop", "length") else "aborted"
                await self.allocator.send(Free(rid=fin.rid, reason=reason))
            token = new.pop(fin.rid, None)
            failure = self.failures.pop(fin.rid, "step failed")
            if fin.finish_reason == "error":
                code: ErrorCode = "context_too_long" if fin.message == UNSERVABLE else "internal"
                items.append(FailRequest(rid=fin.rid, code=code, message=fin.message or failure))
            else:
                items.append(_detokenize(fin.rid, token, fin.finish_reason, fin.num_preemptions))
        items.extend(_detokenize(token.rid, token) for token in new.values())
        if items:
            await self.tokenizer.send(Outputs(items=tuple(items)))

    async def launch(self) -> None:
        while (plan := self.core.plan()) is not None:
            self.gauges.num_steps += 1
            await self.allocator.send(Allocate(step=plan.step, plan=plan))
        self.gauges.running, self.gauges.waiting = self.core.num_running, self.core.num_waiting


def _detokenize(
    rid: str, token: SampledToken | None, finish_reason: FinishReason | None = None, num_preemptions: int = 0
) -> Detokenize:
    """The tokenizer's message for `rid`'s new token (none when it ended without one)."""
    if token is None:
        return Detokenize(rid=rid, token_ids=(), finish_reason=finish_reason, num_preemptions=num_preemptions)
    return Detokenize(
        rid=rid,
        token_ids=(token.token_id,),
        finish_reason=finish_reason,
        logprobs=None if token.logprob is None else (token.logprob,),
        top_logprobs=None if token.top_logprobs is None else (token.top_logprobs,),
        num_preemptions=num_preemptions,
    )


async def run_scheduler(
    inbox: trio.MemoryReceiveChannel[SchedulerMsg],
    allocator: trio.MemorySendChannel[AllocatorMsg],
    tokenizer: trio.MemorySendChannel[TokenizerMsg],
    core: SchedulerCore,
    gauges: SchedulerGauges,
) -> None:
    log = structlog.get_logger().bind(actor="scheduler")
    state = _Scheduler(core, allocator, tokenizer, gauges)
    draining = drained = False
    async with inbox, allocator, tokenizer:
        async for msg in inbox:
            match msg:
                case Tokenized():
                    p = msg.params
                    core.add(msg.rid, msg.prompt_token_ids, p.max_tokens, p.stop_token_ids, p)
                case CancelRequest(rid=rid):
                    await state.ended_early(core.cancel(rid))
                case StopHit(rid=rid):
                    await state.ended_early(core.stop(rid))
                case StepDone():
                    await state.step_done(msg)
                case AllocRefused():
                    await state.refused(msg)
                case Drain():
                    draining = True
                    log.info("draining", running=core.num_running, waiting=core.num_waiting)
                case _:
                    assert_never(msg)
            await state.launch()
            if draining and not drained and not core.has_work():
                assert core.num_inflight_steps == 0
                drained = True
                log.info("drained", num_steps=gauges.num_steps, num_finished=gauges.num_finished)
                for out in (allocator, tokenizer):
                    await out.send(Drain())
                    await out.aclose()
