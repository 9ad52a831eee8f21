"""The scheduler's policy: continuous batching with chunked prefill, preemption by recompute.

Policy, in a few lines:
- A step is planned only while fewer than `max_inflight_steps` are in flight, and only from requests
  in no in-flight step (a request's next input comes from its previous step). While a step that
  had budget to spare is in flight, a new step takes prefill work only: decodes wait for it and then
  run together (else the decode batch splits into groups that never merge again); when the
  in-flight steps are full, the budget splits the decodes anyway and they go at once.
- Under the token budget: every decode-ready RUNNING request (1 token), then the next chunk of each
  RUNNING prefill, then WAITING requests are admitted (preempted first, then by arrival) while fewer
  than `max_num_seqs` run and no running request is short of memory (else newcomers could take the
  memory it waits for, forever). A chunk takes what is left of the budget; an item samples iff it
  reaches the end of the request's tokens.
- `num_computed` advances only when a step is done, so a refused item rolls back by forgetting it.
- When the allocator refuses a RUNNING request and no older step is in flight (whose end would free
  memory), the latest-arriving idle RUNNING request is preempted (never the oldest one holding
  memory; possibly the refused one itself). A preempted request keeps its tokens and later recomputes
  prompt + output as one prefill, sampling only at its end.
- After a refusal, short-of-memory requests wait until memory may have changed: a release (finish
  or preemption) since the refused step was planned, or no step in flight (then a refusal always
  ends in a preemption or an "error"); admissions wait for a finish (a preemption's room is for the
  running) or no step in flight. Retrying sooner spins scheduler and allocator on refusals.
- A request refused while nobody else held memory can never fit: it ends with "error".
- Cancel/stop of a request in an in-flight step waits for that step (its memory is in use).
- Lookahead (`lookahead=True`, as the engine runs it): a RUNNING request whose in-flight item samples
  and that cannot end by length with that token gets its next decode in the next step right away, as
  a lookahead item (input `LOOKAHEAD`: the token the in-flight step samples, taken on the device), so
  the device never waits for the host between decode steps. Decodes then never wait for an in-flight
  step (the whole decode batch moves together). If the in-flight step ends the request (a stop token,
  a stop string, cancel, failure) the end waits for the lookahead step and its token is dropped; if the
  allocator refuses the in-flight item, the lookahead item is dropped (the allocator refuses it too:
  pool 'base').

Driving it from the actor (one FIFO inbox):
  Tokenized -> add();  CancelRequest -> cancel();  StopHit -> stop()
  AllocRefused -> on_refused();  StepDone -> on_step_done()
  after each: Free every preempted rid and every Finished with holds_memory, report the Finished and
  stream the kept tokens, then `while (plan := core.plan()) is not None: send Allocate(plan)`.
The allocator handles its inbox in order, decides a step's items in plan order, allocates nothing
for a refused item, and sends a step's AllocRefused before that step can reach the executor.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dsv4serve.protocol import LOOKAHEAD, SampledToken, SamplingParams, StepItem, StepPlan
from dsv4serve.scheduler.request import (
    CancelOutcome,
    CancelStatus,
    EndReason,
    Finished,
    RefuseOutcome,
    Request,
    RequestState,
    StepOutcome,
)

UNSERVABLE = "the request needs more KV cache than the engine has, even running alone"


@dataclass(frozen=True, slots=True)
class _Planned:
    item: StepItem
    admitted: bool  # the request was WAITING before this plan


@dataclass(slots=True)
class _Step:
    items: dict[str, _Planned]  # the items not refused (so far)
    full_at: tuple[int, int]  # the core's (releases, finishes) when it was planned
    had_room: bool  # planned with token budget left over
    dropped: set[str] = field(default_factory=set)  # lookahead items dropped when their base was refused


class SchedulerCore:
    """Pure sync scheduling state machine, owned by the scheduler actor."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_inflight_steps: int = 2,
        eos_token_ids: Iterable[int] = (),
        lookahead: bool = False,
    ) -> None:
        assert min(max_num_seqs, max_num_batched_tokens, max_model_len, max_inflight_steps) >= 1
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_inflight_steps = max_inflight_steps
        self.eos_token_ids = frozenset(eos_token_ids)
        self.lookahead = lookahead
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []  # sorted by Request.queue_key
        self._running: dict[str, Request] = {}
        self._inflight: dict[int, _Step] = {}
        self._num_arrivals = 0
        self._num_releases = 0  # requests that gave memory back (finished or preempted)
        self._num_finishes = 0  # of those, the finished ones
        self._full_at = (-1, -1)  # (releases, finishes) when memory was last seen full
        self._next_step = 0

    # ------------------------------------------------------------------ introspection

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def has_work(self) -> bool:
        return bool(self._requests)

    def get(self, rid: str) -> Request | None:
        """The live request (read-only by convention), None once finished or if never added."""
        return self._requests.get(rid)

    # ------------------------------------------------------------------ events

    def add(
        self,
        rid: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingParams | None = None,
    ) -> None:
        """Queue a validated request (1 <= prompt length <= max_model_len, max_tokens >= 1)."""
        assert rid not in self._requests, f"duplicate rid {rid!r}"
        assert 1 <= len(prompt_token_ids) <= self.max_model_len and max_tokens >= 1
        sampling = sampling or SamplingParams()
        eos = frozenset() if sampling.ignore_eos else self.eos_token_ids  # ignore_eos: EOS ends nothing
        req = Request(
            rid=rid,
            arrival=self._num_arrivals,
            prompt_len=len(prompt_token_ids),
            all_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            stop_token_ids=eos.union(stop_token_ids),
            sampling=sampling,
        )
        self._num_arrivals += 1
        self._requests[rid] = req
        self._enqueue(req)

    def plan(self) -> StepPlan | None:
        """The next step, or None when the in-flight limit is reached or nothing can run."""
        if len(self._inflight) >= self.max_inflight_steps:
            return None
        budget = self.max_num_batched_tokens
        planned: list[_Planned] = []
        idle = not self._inflight
        hold_decodes = not self.lookahead and any(step.had_room for step in self._inflight.values())
        may_have_room = idle or self._num_releases > self._full_at[0]
        may_admit = idle or self._num_finishes > self._full_at[1]  # a preemption's room is not for newcomers
        for req in self._lookahead_ready() if self.lookahead else ():
            if budget == 0:
                break
            planned.append(_Planned(self._lookahead_item(req), admitted=False))
            budget -= 1
        for req in self._idle_running():
            if budget == 0:
                break
            if req.short_of_memory and not may_have_room:
                continue
            if hold_decodes and req.num_uncomputed == 1:  # a decode joins the next batch, see above
                continue
            planned.append(_Planned(req.next_item(budget), admitted=False))
            budget -= len(planned[-1].item.token_ids)
        while budget > 0 and self._waiting and may_admit and self._may_admit():
            req = self._waiting.pop(0)
            planned.append(_Planned(req.next_item(budget), admitted=True))
            budget -= len(planned[-1].item.token_ids)
            req.state = RequestState.RUNNING
            req.admitted_step = self._next_step
            self._running[req.rid] = req
        return self._launch(planned) if planned else None

    def on_refused(self, step: int, rids: Iterable[str]) -> RefuseOutcome:
        """The allocator refused these items of `step`: they did not run and are rolled back.
        A step whose items are all refused is retired here (an empty StepDone for it is ignored)."""
        record = self._inflight.get(step)
        if record is None:  # only dropped lookahead items were left: retired when they were dropped
            return RefuseOutcome()
        refused = self._take_refused(step, record, set(rids) - record.dropped)
        finished: list[Finished] = []
        tokens: list[SampledToken] = []
        needy: list[Request] = []
        for p in refused:
            if p.item.is_lookahead and self._requests[p.item.rid].lookahead_step == step:
                # its base step goes on; no new lookahead (nor admission) until that step is done
                self._requests[p.item.rid].lookahead_step = None
                self._requests[p.item.rid].short_of_memory = True
                continue
            req = self._roll_back(p)  # (a lookahead whose base is done: a refused decode like any other)
            if req.pending_end is not None:
                finished.append(self._end_pending(req, tokens))
            elif p is refused[0] and self._was_alone(req, step, record):
                finished.append(self._finish(req, "error", message=UNSERVABLE))
            else:
                self._full_at = max(self._full_at, record.full_at)
                if not p.admitted:
                    req.short_of_memory = True
                    needy.append(req)
        # An older in-flight step was granted something and frees memory as it ends; a newer one may
        # be refused too, so waiting for it could livelock.
        older_inflight = any(s < step for s in self._inflight)
        victims = [] if older_inflight else self._choose_victims(needy)
        for victim in victims:
            self._preempt(victim)
        return RefuseOutcome(tuple(v.rid for v in victims), tuple(finished), tuple(tokens))

    def on_step_done(
        self, step: int, outputs: Sequence[SampledToken], failed: Iterable[str] = ()
    ) -> StepOutcome:
        """`step` ran (its items not refused); `outputs` has one token per sampling item not failed."""
        record = self._inflight.pop(step, None)
        failed_rids = set(failed)
        if record is None:  # every item was refused: retired in on_refused
            assert not outputs and not failed_rids, f"step {step} is not in flight"
            return StepOutcome()
        items = record.items
        by_rid = {out.rid: out for out in outputs}
        expected = {rid for rid, p in items.items() if p.item.sample and rid not in failed_rids}
        assert by_rid.keys() == expected and failed_rids <= items.keys(), (step, by_rid.keys(), expected)
        tokens: list[SampledToken] = []
        finished: list[Finished] = []
        for rid, p in items.items():
            req = self._requests[rid]
            assert req.inflight_step == step and req.num_computed == p.item.prefix_len
            follow = req.lookahead_step  # a lookahead decode on this item's token, still in flight
            req.inflight_step, req.lookahead_step = follow, None
            req.short_of_memory = False
            req.num_computed = p.item.seq_len
            if req.pending_end is not None or rid in failed_rids:
                req.pending_end = req.pending_end or "error"
                if follow is None:
                    finished.append(self._end_pending(req, tokens))
            elif p.item.sample:
                token = by_rid[rid]
                req.all_token_ids.append(token.token_id)
                reason = req.end_reason(self.max_model_len)
                if reason is not None and follow is not None:
                    # ends with the lookahead step (whose token is dropped); its last token goes out then
                    req.pending_end, req.pending_token = reason, token
                    continue
                tokens.append(token)
                if reason is not None:
                    finished.append(self._finish(req, reason, token.token_id if reason == "stop" else None))
        return StepOutcome(tuple(tokens), tuple(finished))

    def cancel(self, rid: str) -> CancelOutcome:
        return self._end_early(rid, "cancelled")

    def stop(self, rid: str) -> CancelOutcome:
        """The tokenizer found a stop string: end as "stop" (same in-flight rule as cancel)."""
        return self._end_early(rid, "stop")

    # ------------------------------------------------------------------ helpers

    def _lookahead_ready(self) -> list[Request]:
        """RUNNING requests whose in-flight item samples and that go on after its token, by arrival
        (never one with structured output: its grammar's mask needs that token on the host)."""
        ready = []
        for req in self._running.values():
            if req.inflight_step is None or req.lookahead_step is not None or req.pending_end is not None:
                continue
            base = self._inflight[req.inflight_step].items.get(req.rid)
            if base is None or not base.item.sample or req.short_of_memory:
                continue
            if req.sampling.structured is not None:  # its grammar needs the token on the host first
                continue
            after = req.num_tokens + 1  # with the token the in-flight step samples
            if after - req.prompt_len < req.max_tokens and after < self.max_model_len:
                ready.append(req)
        return sorted(ready, key=lambda r: r.arrival)

    def _lookahead_item(self, req: Request) -> StepItem:
        assert req.inflight_step is not None
        base = self._inflight[req.inflight_step].items[req.rid].item
        return StepItem(
            rid=req.rid, prefix_len=base.seq_len, token_ids=(LOOKAHEAD,), sample=True, sampling=req.sampling
        )

    def _idle_running(self) -> list[Request]:
        """RUNNING requests in no in-flight step: decode-ready ones first, then prefills; by arrival."""
        idle = [r for r in self._running.values() if r.inflight_step is None]
        return sorted(idle, key=lambda r: (r.num_uncomputed > 1, r.arrival))

    def _may_admit(self) -> bool:
        running = self._running.values()
        return len(running) < self.max_num_seqs and not any(r.short_of_memory for r in running)

    def _launch(self, planned: list[_Planned]) -> StepPlan:
        step = self._next_step
        self._next_step += 1
        for p in planned:
            req = self._requests[p.item.rid]
            if p.item.is_lookahead:
                req.lookahead_step = step
            else:
                req.inflight_step = step
        counts = (self._num_releases, self._num_finishes)
        used = sum(len(p.item.token_ids) for p in planned)
        self._inflight[step] = _Step(
            {p.item.rid: p for p in planned}, counts, used < self.max_num_batched_tokens
        )
        return StepPlan(step=step, items=tuple(p.item for p in planned))

    def _roll_back(self, p: _Planned) -> Request:
        req = self._requests[p.item.rid]
        req.inflight_step = None
        later, req.lookahead_step = req.lookahead_step, None
        follow = self._inflight.get(later) if later is not None else None
        if follow is not None:  # its lookahead item has no base now: the allocator refuses it too
            del follow.items[req.rid]
            follow.dropped.add(req.rid)
            if not follow.items:
                del self._inflight[later]  # type: ignore[arg-type]
        if p.admitted:
            del self._running[req.rid]
            self._enqueue(req)
        return req

    def _take_refused(self, step: int, record: _Step, rids: set[str]) -> list[_Planned]:
        """Remove the refused items from the step (retired if none is left), in plan order."""
        assert rids <= record.items.keys(), (step, rids)
        refused = [p for rid, p in record.items.items() if rid in rids]
        for p in refused:
            del record.items[p.item.rid]
        if not record.items:
            del self._inflight[step]
        return refused

    def _was_alone(self, req: Request, step: int, record: _Step) -> bool:
        """Whether nobody else held memory when the allocator refused `req`, the first refused item
        of `step`. Refusals come in step order, so a RUNNING request admitted before `step` held
        memory then; one that released memory since may have held it too (then: unsure, retry)."""
        if self._num_releases != record.full_at[0] or any(r != req.rid for r in record.items):
            return False
        return not any(r is not req and r.admitted_step < step for r in self._running.values())

    def _choose_victims(self, needy: list[Request]) -> list[Request]:
        """One victim per refused request still running: the latest-arriving idle RUNNING request,
        never the oldest one holding memory (which therefore always makes progress)."""
        if not needy:
            return []
        oldest = min((r for r in self._running.values() if not r.being_admitted), key=lambda r: r.arrival)
        idle = [r for r in self._running.values() if r.inflight_step is None and r is not oldest]
        candidates = sorted(idle, key=lambda r: r.arrival)
        victims: list[Request] = []
        for req in needy:
            if req not in victims and candidates:
                victims.append(candidates.pop())
        return victims

    def _preempt(self, req: Request) -> None:
        assert req.state is RequestState.RUNNING and req.inflight_step is None
        del self._running[req.rid]
        self._num_releases += 1
        req.short_of_memory = False
        req.num_computed = 0
        req.num_preemptions += 1
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.state = RequestState.WAITING
        bisect.insort(self._waiting, req, key=Request.queue_key)

    def _end_early(self, rid: str, reason: EndReason) -> CancelOutcome:
        req = self._requests.get(rid)
        if req is None:
            return CancelOutcome(CancelStatus.UNKNOWN)
        if req.inflight_step is not None:
            req.pending_end = req.pending_end or reason
            return CancelOutcome(CancelStatus.DEFERRED)
        return CancelOutcome(CancelStatus.FINISHED, self._finish(req, reason))

    def _end_pending(self, req: Request, tokens: list[SampledToken]) -> Finished:
        """Finish a request whose end waited for its steps; its held last token (if any) goes out now."""
        assert req.pending_end is not None
        if req.pending_token is not None:
            tokens.append(req.pending_token)
        return self._finish(req, req.pending_end, req.stop_token_id(req.pending_end))

    def _finish(
        self, req: Request, reason: EndReason, stop_token_id: int | None = None, message: str = ""
    ) -> Finished:
        assert req.inflight_step is None, f"{req.rid} finished while in flight"
        holds_memory = req.state is RequestState.RUNNING
        if holds_memory:
            del self._running[req.rid]
            self._num_releases += 1
            self._num_finishes += 1
        else:
            self._waiting.remove(req)
        del self._requests[req.rid]
        req.state = RequestState.FINISHED
        return req.finished(reason, holds_memory, stop_token_id, message)
