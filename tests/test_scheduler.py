"""Scheduler policy core: unit tests, and a message-level simulation checked with hypothesis."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve.protocol import SampledToken, StepPlan
from dsv4serve.scheduler import CancelStatus, Finished, RefuseOutcome, RequestState, SchedulerCore

EOS = 0
VOCAB = 40


def next_token(seq: list[int]) -> int:
    """A deterministic fake model: the next token is a function of all previous tokens."""
    acc = 17
    for t in seq:
        acc = (acc * 31 + t + 1) % 1_000_003
    return acc % VOCAB


def reference(
    prompt: list[int], max_tokens: int, stop: set[int], max_model_len: int
) -> tuple[str, list[int]]:
    seq, out = list(prompt), []
    while True:
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
        if tok in stop:
            return "stop", out
        if len(out) >= max_tokens or len(seq) >= max_model_len:
            return "length", out


def outputs_for(plan: StepPlan, tokens: dict[str, int] | None = None) -> list[SampledToken]:
    tokens = tokens or {}
    return [SampledToken(rid=i.rid, token_id=tokens.get(i.rid, 5)) for i in plan.items if i.sample]


def core(**kw: int) -> SchedulerCore:
    args = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, max_inflight_steps=2)
    args.update(kw)
    return SchedulerCore(**args, eos_token_ids=(EOS,))


def next_plan(s: SchedulerCore) -> StepPlan:
    plan = s.plan()
    assert plan is not None
    return plan


def shape(plan: StepPlan | None) -> list[tuple[str, int, int, bool]]:
    assert plan is not None
    return [(i.rid, i.prefix_len, len(i.token_ids), i.sample) for i in plan.items]


# ---------------------------------------------------------------- planning


def test_chunked_prefill_then_decode_then_length() -> None:
    s = core(max_num_batched_tokens=4)
    s.add("a", list(range(1, 11)), max_tokens=2)
    p = next_plan(s)
    assert shape(p) == [("a", 0, 4, False)] and p.items[0].token_ids == (1, 2, 3, 4)
    assert s.plan() is None  # "a" is in flight, nothing else to do
    assert s.on_step_done(0, []).finished == ()
    assert shape(s.plan()) == [("a", 4, 4, False)]
    s.on_step_done(1, [])
    assert shape(s.plan()) == [("a", 8, 2, True)]
    out = s.on_step_done(2, [SampledToken(rid="a", token_id=7)])
    assert [t.token_id for t in out.tokens] == [7] and not out.finished
    p = next_plan(s)
    assert shape(p) == [("a", 10, 1, True)] and p.items[0].token_ids == (7,)
    out = s.on_step_done(3, [SampledToken(rid="a", token_id=8)])
    assert out.finished == (Finished("a", "length", (7, 8), 0, holds_memory=True),)
    assert not s.has_work() and s.num_running == 0


def test_decodes_first_then_prefill_chunks_then_admissions() -> None:
    s = core(max_num_batched_tokens=6, max_inflight_steps=1)
    s.add("a", [1, 2], max_tokens=5)
    s.on_step_done(next_plan(s).step, [SampledToken(rid="a", token_id=3)])
    s.add("b", [1] * 9, max_tokens=5)
    s.on_step_done(next_plan(s).step, [SampledToken(rid="a", token_id=3)])
    s.add("c", [4, 4], max_tokens=5)
    # a decodes (1 token), b's prefill continues (its last 4), c gets the 1 token left
    assert shape(s.plan()) == [("a", 3, 1, True), ("b", 5, 4, True), ("c", 0, 1, False)]


def test_max_num_seqs_and_arrival_order() -> None:
    s = core(max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        s.add(rid, [1, 2, 3], max_tokens=3)
    assert shape(s.plan()) == [("a", 0, 3, True), ("b", 0, 3, True)]
    assert s.plan() is None and s.num_running == 2 and s.num_waiting == 1


def test_inflight_limit_and_no_request_in_two_steps() -> None:
    s = core(max_num_batched_tokens=2, max_inflight_steps=2)
    for rid in "abcd":
        s.add(rid, [1], max_tokens=3)
    p0, p1 = next_plan(s), next_plan(s)
    assert shape(p0) == [("a", 0, 1, True), ("b", 0, 1, True)]
    assert shape(p1) == [("c", 0, 1, True), ("d", 0, 1, True)]
    assert s.plan() is None and s.num_inflight_steps == 2
    s.on_step_done(1, outputs_for(p1))
    assert shape(s.plan()) == [("c", 1, 1, True), ("d", 1, 1, True)]


# ---------------------------------------------------------------- finishing


def test_eos_and_stop_tokens_are_kept_in_ids() -> None:
    s = core()
    s.add("a", [1], max_tokens=9)
    s.add("b", [1], max_tokens=9, stop_token_ids=[33])
    p = next_plan(s)
    out = s.on_step_done(p.step, outputs_for(p, {"a": EOS, "b": 33}))
    assert [(f.rid, f.finish_reason, f.output_token_ids, f.stop_token_id) for f in out.finished] == [
        ("a", "stop", (EOS,), EOS),
        ("b", "stop", (33,), 33),
    ]
    assert [t.token_id for t in out.tokens] == [EOS, 33]


def test_max_model_len_ends_with_length() -> None:
    s = core(max_model_len=4)
    s.add("a", [1, 2, 3], max_tokens=9)
    p = next_plan(s)
    (f,) = s.on_step_done(p.step, outputs_for(p)).finished
    assert (f.finish_reason, f.output_token_ids) == ("length", (5,))


def test_failed_items_end_with_error_and_free() -> None:
    s = core()
    s.add("a", [1], max_tokens=9)
    s.add("b", [1], max_tokens=9)
    p = next_plan(s)
    out = s.on_step_done(p.step, outputs_for(p)[1:], failed=["a"])
    assert [(f.rid, f.finish_reason, f.holds_memory) for f in out.finished] == [("a", "error", True)]
    assert [t.rid for t in out.tokens] == ["b"]


# ---------------------------------------------------------------- cancel / stop


def test_cancel_waiting_idle_inflight_unknown() -> None:
    s = core(max_num_seqs=1)
    s.add("a", [1], max_tokens=9)
    s.add("b", [1], max_tokens=9)
    p = next_plan(s)
    assert s.cancel("a").status is CancelStatus.DEFERRED
    assert s.stop("a").status is CancelStatus.DEFERRED  # the first reason wins
    w = s.cancel("b")
    assert w.status is CancelStatus.FINISHED and w.finished is not None
    assert (w.finished.finish_reason, w.finished.holds_memory) == ("cancelled", False)
    out = s.on_step_done(p.step, outputs_for(p))
    assert out.tokens == ()  # the deferred request's token is dropped
    assert [(f.rid, f.finish_reason, f.output_token_ids, f.holds_memory) for f in out.finished] == [
        ("a", "cancelled", (), True)
    ]
    assert s.cancel("a").status is CancelStatus.UNKNOWN and s.cancel("zz").status is CancelStatus.UNKNOWN


def test_stop_of_idle_running_request_frees_now() -> None:
    s = core()
    s.add("a", [1], max_tokens=9)
    p = next_plan(s)
    s.on_step_done(p.step, outputs_for(p))
    got = s.stop("a")
    assert got.finished == Finished("a", "stop", (5,), 0, holds_memory=True)
    assert not s.has_work()


# ---------------------------------------------------------------- refusals and preemption


def run_to_decode(s: SchedulerCore, rids: str) -> None:
    for rid in rids:
        s.add(rid, [1, 2], max_tokens=50)
    p = next_plan(s)
    s.on_step_done(p.step, outputs_for(p))


def test_refused_admission_waits_in_place_and_alone_is_unservable() -> None:
    s = core(max_num_batched_tokens=100)
    s.add("a", [1] * 5, max_tokens=3)
    s.add("b", [2] * 5, max_tokens=3)
    p = next_plan(s)
    out = s.on_refused(p.step, ["a", "b"])
    # "a" was refused with nobody holding memory: it can never fit; "b" came after "a": it waits
    assert [(f.rid, f.finish_reason, f.holds_memory) for f in out.finished] == [("a", "error", False)]
    assert out.preempted == () and s.num_waiting == 1 and s.num_inflight_steps == 0
    assert s.on_step_done(p.step, []).finished == ()  # an empty StepDone of a retired step is ignored
    assert shape(s.plan()) == [("b", 0, 5, True)]


def test_refused_admissions_keep_their_queue_position() -> None:
    s = core(max_num_batched_tokens=100, max_inflight_steps=1)
    run_to_decode(s, "a")
    s.add("b", [1], max_tokens=3)
    s.add("c", [1], max_tokens=3)
    p = next_plan(s)
    out = s.on_refused(p.step, ["c", "b"])
    assert out.preempted == () and out.finished == () and s.num_waiting == 2
    s.add("d", [1], max_tokens=3)
    s.on_step_done(p.step, outputs_for(p)[:1])
    assert [i.rid for i in next_plan(s).items] == ["a", "b", "c", "d"]


def test_refused_decode_preempts_latest_idle_running() -> None:
    s = core(max_num_batched_tokens=100)
    run_to_decode(s, "abcd")
    p = next_plan(s)
    out = s.on_refused(p.step, ["b"])
    # only refused items are idle; the latest idle running request is "b" itself
    assert out.preempted == ("b",)
    b = s.get("b")
    assert b is not None and (b.state, b.num_computed, b.num_preemptions) == (RequestState.WAITING, 0, 1)
    assert b.output_token_ids == (5,)


def test_refused_decodes_preempt_latest_never_oldest() -> None:
    s = core(max_num_batched_tokens=100)
    run_to_decode(s, "abcd")
    p = next_plan(s)
    out = s.on_refused(p.step, ["a", "b", "c", "d"])
    assert out.preempted == ("d", "c") and s.num_inflight_steps == 0
    p = next_plan(s)  # no admission while "a" and "b" are short of memory
    assert shape(p) == [("a", 2, 1, True), ("b", 2, 1, True)]
    s.on_step_done(p.step, outputs_for(p))
    assert shape(s.plan()) == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 0, 3, True), ("d", 0, 3, True)]


def test_oldest_refused_alone_is_unservable() -> None:
    s = core()
    run_to_decode(s, "a")
    p = next_plan(s)
    out = s.on_refused(p.step, ["a"])
    assert [(f.rid, f.finish_reason, f.holds_memory, f.message != "") for f in out.finished] == [
        ("a", "error", True, True)
    ]


def two_decodes_in_two_steps() -> tuple[SchedulerCore, StepPlan, StepPlan]:
    s = core(max_num_batched_tokens=1)
    s.add("a", [1], max_tokens=9)
    s.add("b", [1], max_tokens=9)
    for p in (next_plan(s), next_plan(s)):
        s.on_step_done(p.step, outputs_for(p))
    p2, p3 = next_plan(s), next_plan(s)
    assert shape(p2) == [("a", 1, 1, True)] and shape(p3) == [("b", 1, 1, True)]
    return s, p2, p3


def test_no_preemption_while_an_older_step_is_in_flight() -> None:
    s, _, p3 = two_decodes_in_two_steps()
    assert s.on_refused(p3.step, ["b"]) == RefuseOutcome()  # step 2 will end and free memory
    b = s.get("b")
    assert b is not None and b.state is RequestState.RUNNING


def test_refused_requests_wait_for_memory_to_change_instead_of_spinning() -> None:
    s = core(max_num_batched_tokens=2)
    run_to_decode(s, "a")
    s.add("x", [1, 1, 1, 1], max_tokens=9)
    p1 = next_plan(s)  # full: a decode plus x's first chunk
    s.add("b", [1], max_tokens=9)
    s.on_step_done(next_plan(s).step, [SampledToken(rid="b", token_id=5)])
    p3 = next_plan(s)  # the step in flight is full, so b's decode need not wait for it
    s.add("c", [1], max_tokens=9)
    assert shape(p1) == [("a", 2, 1, True), ("x", 0, 1, False)] and shape(p3) == [("b", 1, 1, True)]
    assert s.on_refused(p3.step, ["b"]) == RefuseOutcome()  # step 1 is older: wait for it
    assert s.plan() is None  # "b" and "c" would only be refused again while step 1 runs
    s.on_step_done(p1.step, outputs_for(p1))
    # nothing in flight: retry; "c" waits until "b" got memory (a newcomer would take it)
    assert shape(s.plan()) == [("a", 3, 1, True), ("b", 1, 1, True)]


def test_decodes_wait_for_a_step_with_room_instead_of_splitting_the_batch() -> None:
    s = core(max_num_batched_tokens=100)
    run_to_decode(s, "a")
    p1 = next_plan(s)  # a's decode, with budget to spare
    s.add("b", [1], max_tokens=9)
    p2 = next_plan(s)  # prefill work may still overlap with step 1
    s.on_step_done(p2.step, outputs_for(p2))
    assert s.plan() is None  # b's decode waits for step 1 rather than forming a batch of its own
    s.on_step_done(p1.step, outputs_for(p1))
    assert [item.rid for item in next_plan(s).items] == ["a", "b"]


def test_newer_steps_in_flight_do_not_block_preemption() -> None:
    s = core(max_num_batched_tokens=1, max_inflight_steps=3)
    for rid in "abc":
        s.add(rid, [1], max_tokens=9)
    for p in [next_plan(s) for _ in range(3)]:
        s.on_step_done(p.step, outputs_for(p))
    p3, p4, _ = next_plan(s), next_plan(s), next_plan(s)
    assert s.on_refused(p3.step, ["a"]) == RefuseOutcome()  # "a" is the oldest; the rest in flight
    # step 4 is refused while only the newer step 5 is in flight: waiting for it could livelock
    assert s.on_refused(p4.step, ["b"]).preempted == ("b",)


def test_deferred_cancel_of_refused_item_finishes_there() -> None:
    s = core()
    run_to_decode(s, "ab")
    p = next_plan(s)
    assert s.cancel("b").status is CancelStatus.DEFERRED
    out = s.on_refused(p.step, ["b"])
    assert out.preempted == () and [(f.rid, f.finish_reason, f.holds_memory) for f in out.finished] == [
        ("b", "cancelled", True)
    ]


def test_preempted_request_recomputes_everything_and_samples_at_end() -> None:
    s = core(max_num_batched_tokens=4, max_inflight_steps=1)
    s.add("a", [1, 2], max_tokens=9)
    s.add("b", [3, 4], max_tokens=9)
    for tok in (10, 11):
        p = next_plan(s)
        s.on_step_done(p.step, outputs_for(p, {"a": tok, "b": tok}))
    p = next_plan(s)
    assert s.on_refused(p.step, ["a", "b"]).preempted == ("b",)
    p = next_plan(s)  # "a" is short of memory: "b" waits until "a" ran again
    assert shape(p) == [("a", 3, 1, True)]
    s.on_step_done(p.step, outputs_for(p, {"a": 12}))
    p = next_plan(s)  # "b" recomputes prompt + output ([3, 4, 10, 11]) in chunks, sampling at the end
    assert shape(p) == [("a", 4, 1, True), ("b", 0, 3, False)]
    assert p.items[1].token_ids == (3, 4, 10)
    s.on_step_done(p.step, outputs_for(p, {"a": 13}))
    p = next_plan(s)
    assert shape(p) == [("a", 5, 1, True), ("b", 3, 1, True)]
    assert p.items[1].token_ids == (11,)
    out = s.on_step_done(p.step, outputs_for(p, {"a": 14, "b": 12}))
    b = s.get("b")
    assert b is not None and b.output_token_ids == (10, 11, 12)
    assert [t.token_id for t in out.tokens] == [14, 12]  # nothing is streamed twice


def test_oldest_request_holding_memory_is_never_preempted() -> None:
    s = core(max_num_batched_tokens=100)
    s.add("x", [1], max_tokens=2)
    s.add("a", [1], max_tokens=9)
    p0 = next_plan(s)
    s.on_step_done(p0.step, outputs_for(p0))
    p1 = next_plan(s)
    s.add("c", [1], max_tokens=9)
    p2 = next_plan(s)
    assert shape(p1) == [("x", 1, 1, True), ("a", 1, 1, True)] and shape(p2) == [("c", 0, 1, True)]
    assert s.on_refused(p1.step, ["a"]).preempted == ("a",)
    assert s.on_step_done(p1.step, outputs_for(p1)[:1]).finished[0].rid == "x"
    s.on_step_done(p2.step, outputs_for(p2))
    p3 = next_plan(s)
    assert shape(p3) == [("c", 1, 1, True), ("a", 0, 2, True)]
    # "a" arrived first but is only being admitted: "c" is the oldest holding memory, so it stays
    assert s.on_refused(p3.step, ["c"]) == RefuseOutcome()


# ---------------------------------------------------------------- lookahead


def lookahead_core(**kw: int) -> SchedulerCore:
    args = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, max_inflight_steps=2)
    args.update(kw)
    return SchedulerCore(**args, eos_token_ids=(EOS,), lookahead=True)


def test_lookahead_plans_the_next_decode_while_the_step_is_in_flight() -> None:
    s = lookahead_core()
    s.add("a", [1, 2, 3], 5)
    first, second = next_plan(s), next_plan(s)
    assert shape(first) == [("a", 0, 3, True)]
    assert second.items[0].is_lookahead and shape(second) == [("a", 3, 1, True)]
    assert s.plan() is None  # the credit rule: two steps in flight
    done = s.on_step_done(first.step, outputs_for(first, {"a": 7}))
    assert [t.token_id for t in done.tokens] == [7] and not done.finished
    third = next_plan(s)  # the lookahead of the lookahead, planned as soon as a credit is back
    assert third.items[0].is_lookahead and shape(third) == [("a", 4, 1, True)]
    s.on_step_done(second.step, outputs_for(second, {"a": 8}))
    assert s.get("a").all_token_ids == [1, 2, 3, 7, 8]  # type: ignore[union-attr]


def test_stop_token_in_flight_ends_with_the_lookahead_step_whose_token_is_dropped() -> None:
    s = lookahead_core()
    s.add("a", [1, 2], 9)
    first, second = next_plan(s), next_plan(s)
    out = s.on_step_done(first.step, outputs_for(first, {"a": EOS}))
    assert not out.tokens and not out.finished  # memory still in use: the stop token waits with the end
    assert s.plan() is None  # nothing new for a request that ended
    end = s.on_step_done(second.step, outputs_for(second, {"a": 5}))
    assert [t.token_id for t in end.tokens] == [EOS] and len(end.finished) == 1
    f = end.finished[0]
    assert (f.finish_reason, f.output_token_ids, f.stop_token_id, f.holds_memory) == (
        "stop",
        (EOS,),
        EOS,
        True,
    )


def test_no_lookahead_past_max_tokens() -> None:
    s = lookahead_core()
    s.add("a", [1, 2], 1)  # its first token is its last
    first = next_plan(s)
    assert s.plan() is None
    assert s.on_step_done(first.step, outputs_for(first)).finished[0].finish_reason == "length"


def test_refused_base_drops_its_lookahead_and_the_base_refusal_is_ignored() -> None:
    s = lookahead_core()
    s.add("a", [1, 2], 9)
    s.add("b", [3], 9)
    first, second = next_plan(s), next_plan(s)
    assert {i.rid for i in second.items if i.is_lookahead} == {"a", "b"}
    s.on_refused(first.step, ["b"])  # b's admission refused: its lookahead in `second` is dropped
    assert s.get("b").state is RequestState.WAITING  # type: ignore[union-attr]
    assert s.on_refused(second.step, ["b"]) == RefuseOutcome()  # the allocator's 'base' refusal
    s.on_step_done(first.step, [SampledToken(rid="a", token_id=4)])
    s.on_step_done(second.step, [SampledToken(rid="a", token_id=6)])
    assert s.get("a").all_token_ids == [1, 2, 4, 6]  # type: ignore[union-attr]


def test_cancel_during_lookahead_ends_after_both_steps() -> None:
    s = lookahead_core()
    s.add("a", [1, 2], 9)
    first, second = next_plan(s), next_plan(s)
    assert s.cancel("a").status is CancelStatus.DEFERRED
    assert not s.on_step_done(first.step, outputs_for(first)).finished
    end = s.on_step_done(second.step, outputs_for(second))
    assert [f.finish_reason for f in end.finished] == ["cancelled"] and not end.tokens


# ---------------------------------------------------------------- simulation


@dataclass
class Arrival:
    rid: str
    prompt: list[int]
    max_tokens: int
    stop: tuple[int, ...]


@dataclass
class Sim:
    """The actor loop, a fake allocator (capacity in tokens, random refusals) and a fake executor
    running `next_token` on the tokens it actually cached, wired by FIFO inboxes as in the system."""

    core: SchedulerCore
    capacity: int
    rng: random.Random
    refuse_p: float
    fail_p: float
    alloc_inbox: deque[tuple] = field(default_factory=deque)
    sched_inbox: deque[tuple] = field(default_factory=deque)
    exec_inbox: deque[tuple] = field(default_factory=deque)
    held: dict[str, int] = field(default_factory=dict)  # allocator: tokens held per rid
    kv: dict[str, list[int]] = field(default_factory=dict)  # executor: tokens cached per rid
    sampled: dict[str, int] = field(default_factory=dict)  # executor: each rid's last sampled token
    inflight: dict[int, dict[str, bool]] = field(default_factory=dict)  # planned: rid -> lookahead
    executing: dict[int, set[str]] = field(default_factory=dict)  # granted, not yet done
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, Finished] = field(default_factory=dict)
    added: set[str] = field(default_factory=set)

    def add(self, a: Arrival) -> None:
        self.core.add(a.rid, a.prompt, a.max_tokens, a.stop)
        self.added.add(a.rid)
        self.pump()

    def pump(self) -> None:
        while (plan := self.core.plan()) is not None:
            c = self.core
            assert plan.num_tokens <= c.max_num_batched_tokens and c.num_running <= c.max_num_seqs
            assert c.num_inflight_steps <= c.max_inflight_steps
            rids = {i.rid: i.is_lookahead for i in plan.items}
            fresh = {i.rid for i in plan.items if not i.is_lookahead}
            assert len(rids) == len(plan.items) and all(
                not (fresh & s.keys()) for s in self.inflight.values()
            )
            for item in plan.items:  # a lookahead decode follows its request's one other in-flight item
                assert not item.is_lookahead or sum(item.rid in s for s in self.inflight.values()) == 1
            self.inflight[plan.step] = rids
            self.alloc_inbox.append(("allocate", plan))

    def end(self, f: Finished) -> None:
        assert f.rid not in self.finished, f"{f.rid} finished twice"
        assert f.output_token_ids == tuple(self.streamed.get(f.rid, ())), f.rid
        self.finished[f.rid] = f
        if f.holds_memory:
            self.alloc_inbox.append(("free", f.rid))

    def end_early(self, rid: str, stop: bool) -> None:
        got = self.core.stop(rid) if stop else self.core.cancel(rid)
        assert (got.status is CancelStatus.UNKNOWN) == (rid in self.finished or rid not in self.added)
        if got.finished is not None:
            self.end(got.finished)
        self.pump()

    def allocator(self) -> None:
        kind, arg = self.alloc_inbox.popleft()
        if kind == "free":
            assert all(arg not in s for s in self.executing.values()), f"{arg} freed while in use"
            del self.held[arg]
            self.kv.pop(arg, None)
            return
        granted, refused = [], []
        for item in arg.items:
            if self.held.get(item.rid, 0) != item.prefix_len:  # a lookahead whose base was refused
                assert item.is_lookahead
                refused.append(item.rid)
                continue
            others = any(r != item.rid for r in self.held)
            used = sum(self.held.values()) + len(item.token_ids)
            if used > self.capacity or (others and self.rng.random() < self.refuse_p):
                refused.append(item.rid)
            else:
                self.held[item.rid] = item.seq_len
                granted.append(item)
        self.executing[arg.step] = {item.rid for item in granted}
        if refused:
            self.sched_inbox.append(("refused", arg.step, refused))
        self.exec_inbox.append((arg.step, granted))

    def executor(self) -> None:
        step, items = self.exec_inbox.popleft()
        outputs, failed = [], []
        for item in items:
            kv = self.kv.setdefault(item.rid, [])
            if self.rng.random() < self.fail_p or len(kv) != item.prefix_len:  # (the base item failed)
                failed.append(item.rid)
                continue
            kv.extend([self.sampled[item.rid]] if item.is_lookahead else item.token_ids)
            if item.sample:
                self.sampled[item.rid] = next_token(kv)
                outputs.append(SampledToken(rid=item.rid, token_id=self.sampled[item.rid]))
        self.sched_inbox.append(("done", step, outputs, failed))

    def scheduler(self) -> None:
        msg = self.sched_inbox.popleft()
        if msg[0] == "refused":
            out = self.core.on_refused(msg[1], msg[2])
            for rid in msg[2]:  # a refused item's lookahead, planned on it, is dropped too
                if self.inflight[msg[1]].pop(rid, None) is None:
                    continue  # itself a dropped lookahead, refused by the allocator ('base')
                for step, items in self.inflight.items():
                    if step > msg[1] and items.get(rid):
                        del items[rid]
            for rid in out.preempted:
                self.alloc_inbox.append(("free", rid))
            for tok in out.tokens:
                self.streamed.setdefault(tok.rid, []).append(tok.token_id)
            finished = out.finished
        else:
            res = self.core.on_step_done(msg[1], msg[2], msg[3])
            self.inflight.pop(msg[1])
            self.executing.pop(msg[1])
            for tok in res.tokens:
                self.streamed.setdefault(tok.rid, []).append(tok.token_id)
            finished = res.finished
        for f in finished:
            self.end(f)
        self.pump()

    def busy(self) -> list:
        return [q for q in (self.alloc_inbox, self.exec_inbox, self.sched_inbox) if q]

    def drain(self, max_events: int = 5_000) -> None:
        """No more refusals, failures or cancels: everything must finish (no starvation), also when
        the executor is the slowest actor (no spinning on refusals while it works)."""
        self.refuse_p = self.fail_p = 0.0
        actors = [(self.alloc_inbox, self.allocator), (self.exec_inbox, self.executor)]
        actors.insert(self.rng.randrange(3), (self.sched_inbox, self.scheduler))
        for _ in range(max_events):
            ready = [handle for inbox, handle in actors if inbox]
            if not ready:
                break
            ready[0]()
        assert not self.busy() and not self.core.has_work(), "starved or stuck"
        assert not self.held and not self.executing, "memory leaked"


arrivals_st = st.lists(
    st.tuples(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=14),
        st.integers(1, 12),
        st.sampled_from([(), (7,), (3, 11)]),
    ),
    min_size=1,
    max_size=7,
).map(lambda xs: [Arrival(f"r{i}", p, m, s) for i, (p, m, s) in enumerate(xs)])

limits_st = st.fixed_dictionaries(
    {
        "max_num_seqs": st.integers(1, 4),
        "max_num_batched_tokens": st.integers(1, 12),
        "max_model_len": st.integers(14, 24),
        "max_inflight_steps": st.integers(1, 3),
    }
)


def run_sim(
    limits: dict,
    arrivals: list[Arrival],
    rng: random.Random,
    capacity: int,
    chaos: bool,
    lookahead: bool = False,
) -> Sim:
    scheduler = SchedulerCore(**limits, eos_token_ids=(EOS,), lookahead=lookahead)
    sim = Sim(scheduler, capacity, rng, 0.3 * chaos, 0.02 * chaos)
    pending = deque(arrivals)
    for _ in range(rng.randint(0, 300)):
        choice = rng.randrange(6)
        if choice == 0 and pending:
            sim.add(pending.popleft())
        elif choice == 1 and sim.alloc_inbox:
            sim.allocator()
        elif choice == 2 and sim.exec_inbox:
            sim.executor()
        elif choice == 3 and sim.sched_inbox:
            sim.scheduler()
        elif choice == 4 and chaos and rng.random() < 0.1:
            sim.end_early(rng.choice([*sorted(sim.added), "nope"]), stop=rng.random() < 0.5)
    while pending:
        sim.add(pending.popleft())
    sim.drain()
    return sim


@settings(deadline=None, max_examples=150)
@given(limits=limits_st, arrivals=arrivals_st, rng=st.randoms(use_true_random=False), lookahead=st.booleans())
def test_simulation_invariants_and_preemption_is_invisible(
    limits: dict, arrivals: list[Arrival], rng: random.Random, lookahead: bool
) -> None:
    capacity = limits["max_model_len"] + rng.randint(0, 20)  # any request fits alone
    seed = rng.getrandbits(32)
    calm = run_sim(limits, arrivals, random.Random(seed), 10**9, chaos=False, lookahead=lookahead)
    busy = run_sim(limits, arrivals, random.Random(seed), capacity, chaos=True, lookahead=lookahead)
    for a in arrivals:
        reason, want = reference(a.prompt, a.max_tokens, {EOS, *a.stop}, limits["max_model_len"])
        f, g = calm.finished[a.rid], busy.finished[a.rid]
        assert (f.finish_reason, list(f.output_token_ids), f.num_preemptions) == (reason, want, 0)
        assert g.message == ""  # nothing was declared unservable: every request fits alone
        if g.finish_reason in ("cancelled", "error") or (
            g.finish_reason == "stop" and g.stop_token_id is None
        ):
            assert list(g.output_token_ids) == want[: len(g.output_token_ids)]
        else:
            assert (g.finish_reason, list(g.output_token_ids)) == (reason, want)
    assert calm.finished.keys() == busy.finished.keys() == {a.rid for a in arrivals}


@settings(deadline=None, max_examples=40)
@given(limits=limits_st, arrivals=arrivals_st, rng=st.randoms(use_true_random=False), lookahead=st.booleans())
def test_simulation_with_too_little_memory_fails_only_the_requests_that_cannot_fit(
    limits: dict, arrivals: list[Arrival], rng: random.Random, lookahead: bool
) -> None:
    capacity = rng.randint(4, limits["max_model_len"])
    sim = run_sim(limits, arrivals, random.Random(rng.getrandbits(32)), capacity, False, lookahead)
    assert sim.finished.keys() == {a.rid for a in arrivals}
    for a in arrivals:
        f = sim.finished[a.rid]
        need = min(len(a.prompt) + a.max_tokens - 1, limits["max_model_len"])
        if f.finish_reason == "error":
            assert f.message and need > capacity
        else:
            _, want = reference(a.prompt, a.max_tokens, {EOS, *a.stop}, limits["max_model_len"])
            assert list(f.output_token_ids) == want
