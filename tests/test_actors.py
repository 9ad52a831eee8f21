"""The actors with fake peers and a fake device (pytest-trio, autojump clock): credit rule, drain,
failure containment, cancel, stop strings, admission errors, preemption, log lines."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog
import trio
import trio.testing
from event_helpers import events_of

from dsv4serve import logs
from dsv4serve.actors.executor import at_once, run_executor
from dsv4serve.actors.scheduler import SchedulerGauges, run_scheduler
from dsv4serve.actors.system import EngineHandle, Parts, SystemOptions, run_actors
from dsv4serve.config import EngineConfig
from dsv4serve.memory import KVAllocator, Refusal
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.tiny import tiny_config
from dsv4serve.protocol import (
    Allocate,
    AllocatorMsg,
    CacheLocs,
    Detokenize,
    DoneEvent,
    Drain,
    ErrorEvent,
    Event,
    ExecutorMsg,
    Outputs,
    RequestError,
    SampledToken,
    SamplingParams,
    SchedulerMsg,
    StepDone,
    StepItem,
    StepPlan,
    Submit,
    TablesReady,
    TokenEvent,
    Tokenized,
    TokenizerMsg,
)
from dsv4serve.scheduler import SchedulerCore

MODEL = DeepseekV4Config.from_dict(tiny_config())
ENGINE = EngineConfig(
    page_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_total_tokens=1024, max_model_len=128
)
FIRST = 2  # fake vocabulary: ids 2..27 are the letters a..z (0 = BOS, 1 = EOS are never produced)


def next_token(item: StepItem) -> int:
    """The fake model: the letter after the item's last one (so outputs are predictable)."""
    return FIRST + (item.token_ids[-1] - FIRST + 1) % 26


def letters(text: str) -> list[int]:
    return [FIRST + ord(c) - ord("a") for c in text]


class FakeDecoder:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (t - FIRST) % 26) for t in token_ids if t >= FIRST)


@dataclass
class FakeDevice:
    step_s: float = 0.01
    fail_if: Callable[[StepPlan], bool] = lambda plan: False
    plans: list[StepPlan] = field(default_factory=list)
    failed: list[StepPlan] = field(default_factory=list)
    last: dict[str, int] = field(default_factory=dict)

    async def write_locs(self, locs: Sequence[CacheLocs]) -> None:
        assert all(loc.row >= 0 for loc in locs)

    async def execute(self, plan: StepPlan) -> list[SampledToken]:
        self.plans.append(plan)
        await trio.sleep(self.step_s)
        if self.fail_if(plan):
            self.failed.append(plan)
            raise RuntimeError("device on fire")
        assert all(item.row >= 0 for item in plan.items)
        out = []
        for i in plan.items:  # a lookahead decode's input: its request's last sampled token
            last = self.last.get(i.rid, FIRST) if i.is_lookahead else i.token_ids[-1]  # (base failed: any)
            if i.sample:
                self.last[i.rid] = FIRST + (last - FIRST + 1) % 26
                out.append(SampledToken(rid=i.rid, token_id=self.last[i.rid]))
        return out


class CountingAllocator(KVAllocator):
    """Fails loudly if the scheduler and the allocator spin on refusals (under the autojump clock a
    spin never lets time pass, so the test would hang instead of failing)."""

    max_refusals = 200

    def allocate(self, rid: str, prefix_len: int, seq_len: int, step: int) -> CacheLocs | Refusal:
        got = super().allocate(rid, prefix_len, seq_len, step)
        if isinstance(got, Refusal):
            self.max_refusals -= 1
            assert self.max_refusals > 0, "the scheduler keeps re-planning refused requests"
        return got


def make_parts(device: FakeDevice, engine: EngineConfig = ENGINE) -> Parts:
    alloc = CountingAllocator(MODEL, engine)
    return Parts(MODEL, alloc, letters, FakeDecoder(), device.write_locs, at_once(device.execute))


@asynccontextmanager
async def running(
    device: FakeDevice, engine: EngineConfig = ENGINE, parts: Parts | None = None, **options: int
) -> AsyncIterator[EngineHandle]:
    """A system on the fake device; drained (every request finished) when the block ends."""
    async with trio.open_nursery() as nursery:
        opts = SystemOptions(Path("unused"), engine, **options)
        parts = parts or make_parts(device, engine)
        handle: EngineHandle = await nursery.start(run_actors, parts, opts)
        yield handle
        with trio.fail_after(60):
            await handle.drain()


def submit(
    handle: EngineHandle, rid: str, prompt: str | None = "abc", max_tokens: int = 4, **kw: object
) -> trio.MemoryReceiveChannel[Event]:
    """Prompts go in as token ids: a text prompt would be encoded in a worker thread, and under the
    autojump clock virtual time runs on while that thread works, so the fake device could race ahead."""
    send, recv = trio.open_memory_channel[Event](1000)
    if prompt is not None and "prompt_token_ids" not in kw:
        prompt, kw["prompt_token_ids"] = None, tuple(letters(prompt))
    kw.setdefault("prompt_token_ids", None)
    params = params_with(kw.pop("sampling", SamplingParams()), max_tokens=max_tokens, **pop_params(kw))
    req = Submit(rid=rid, prompt=prompt, params=params, **kw)  # type: ignore[arg-type]
    handle.submit(req, send)
    return recv


def params_with(params: SamplingParams, **changes: object) -> SamplingParams:
    """`params` with some fields changed (checked again)."""
    return SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__}, **changes})  # type: ignore[arg-type]


def pop_params(kw: dict[str, object]) -> dict[str, object]:
    """The sampling fields among a test's keyword arguments (taken out of them)."""
    return {name: kw.pop(name) for name in SamplingParams.__struct_fields__ if name in kw}


def assert_free(handle: EngineHandle) -> None:
    assert all(used == 0 for used, _ in handle.pool_usage().values()), handle.pool_usage()


# ---------------------------------------------------------------- scheduler actor with fake peers


@pytest.mark.parametrize("k", [1, 2, 3])
async def test_credit_rule_never_more_than_k_steps_in_flight(k: int, autojump_clock: object) -> None:
    core = SchedulerCore(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=256, max_inflight_steps=k)
    to_sched, sched_inbox = trio.open_memory_channel[SchedulerMsg](1000)
    to_alloc, alloc_inbox = trio.open_memory_channel[AllocatorMsg](1000)
    to_tok, tok_inbox = trio.open_memory_channel[TokenizerMsg](1000)
    to_device, device_inbox = trio.open_memory_channel[StepPlan](1000)
    inflight, peak, finished = [0], [0], {}

    async def fake_allocator() -> None:  # grants everything, forwards to the fake device in order
        async with to_device:
            async for msg in alloc_inbox:
                if isinstance(msg, Allocate):
                    inflight[0] += 1
                    peak[0] = max(peak[0], inflight[0])
                    await to_device.send(msg.plan)
                elif isinstance(msg, Drain):
                    return

    async def fake_device(results: trio.MemorySendChannel[SchedulerMsg]) -> None:
        async with results:
            async for plan in device_inbox:
                await trio.sleep(0.01 * (1 + plan.step % 3))
                outputs = tuple(SampledToken(rid=i.rid, token_id=7) for i in plan.items if i.sample)
                inflight[0] -= 1
                await results.send(StepDone(step=plan.step, outputs=outputs, ran=()))

    async def fake_tokenizer() -> None:
        async for msg in tok_inbox:
            for item in msg.items if isinstance(msg, Outputs) else ():
                if isinstance(item, Detokenize) and item.finish_reason is not None:
                    finished[item.rid] = item.finish_reason
            if isinstance(msg, Drain):
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_scheduler, sched_inbox, to_alloc, to_tok, core, SchedulerGauges())
        nursery.start_soon(fake_allocator)
        nursery.start_soon(fake_device, to_sched.clone())
        nursery.start_soon(fake_tokenizer)
        async with to_sched:
            for i in range(6):
                prompt = tuple(range(3, 13))
                await to_sched.send(
                    Tokenized(rid=f"r{i}", prompt_token_ids=prompt, params=SamplingParams(max_tokens=5))
                )
                await trio.sleep(0.005)
            await to_sched.send(Drain())
    assert finished == {f"r{i}": "length" for i in range(6)}
    assert peak[0] == k  # reached, never exceeded


async def test_executor_turns_a_raising_step_into_failed_items(autojump_clock: object) -> None:
    to_exec, exec_inbox = trio.open_memory_channel[ExecutorMsg](4)
    to_sched, sched_inbox = trio.open_memory_channel[SchedulerMsg](4)
    device = FakeDevice(fail_if=lambda plan: plan.step == 1)
    items = tuple(
        StepItem(rid=r, prefix_len=0, token_ids=(3, 4), sample=True, sampling=SamplingParams(), row=n)
        for n, r in enumerate("ab")
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_executor, exec_inbox, to_sched, at_once(device.execute))
        for step in range(3):
            await to_exec.send(TablesReady(step=step, plan=StepPlan(step=step, items=items)))
        await to_exec.send(Drain())
        done = [await sched_inbox.receive() for _ in range(3)]
    assert all(isinstance(d, StepDone) for d in done)
    _, bad, ok2 = done
    assert isinstance(bad, StepDone) and bad.outputs == () and [f.rid for f in bad.failed] == ["a", "b"]
    assert "device on fire" in bad.failed[0].message
    assert isinstance(ok2, StepDone) and [o.token_id for o in ok2.outputs] == [5, 5] and not ok2.failed


# ---------------------------------------------------------------- whole actor system on a fake device


async def test_requests_stream_and_end_once(autojump_clock: object) -> None:
    async with running(FakeDevice()) as handle:
        chans = {
            f"r{i}": submit(handle, f"r{i}", "abc", max_tokens=3 + i, stream=i % 2 == 0) for i in range(5)
        }
        results = {rid: await events_of(recv) for rid, recv in chans.items()}
    for i, events in enumerate(results.values()):
        done = events[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "length"
        assert done.text == "defghijk"[: 3 + i] and done.token_ids == tuple(letters(done.text))
        assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 3 + i
        assert done.timing.total_ms >= done.timing.ttft_ms > 0
        streamed = [e for e in events if isinstance(e, TokenEvent)]
        assert (len(streamed) > 0) == (i % 2 == 0) and len(events) == len(streamed) + 1
        if streamed:
            assert "".join(e.text for e in streamed) == done.text
            assert sum((e.token_ids for e in streamed), ()) == done.token_ids
    assert handle.stopped.is_set()
    assert_free(handle)
    for recv in chans.values():  # exactly one terminal event: nothing after it
        with pytest.raises(trio.WouldBlock):
            recv.receive_nowait()


async def test_shutdown_ends_live_requests_with_internal_errors(autojump_clock: object) -> None:
    async with trio.open_nursery() as nursery:
        opts = SystemOptions(Path("unused"), ENGINE)
        handle: EngineHandle = await nursery.start(run_actors, make_parts(FakeDevice()), opts)
        chans = [submit(handle, f"r{i}", max_tokens=50, stream=True) for i in range(6)]
        await chans[0].receive()
        handle.shutdown()
    ends = [(await events_of(recv))[-1] for recv in chans]
    assert all(isinstance(e, ErrorEvent) and e.code == "internal" for e in ends), ends
    assert handle.stopped.is_set()
    with pytest.raises(RequestError) as err:
        submit(handle, "after")
    assert err.value.code == "internal"


async def test_drain_finishes_accepted_requests_then_refuses_new_ones(autojump_clock: object) -> None:
    device = FakeDevice(step_s=0.05)
    async with trio.open_nursery() as nursery:
        opts = SystemOptions(Path("unused"), ENGINE)
        handle: EngineHandle = await nursery.start(run_actors, make_parts(device), opts)
        chans = [submit(handle, f"r{i}", max_tokens=20) for i in range(6)]
        await trio.sleep(0.1)
        async with trio.open_nursery() as drainer:
            drainer.start_soon(handle.drain)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(RequestError) as err:
                submit(handle, "late")
            assert err.value.code == "internal"
    # run_actors returned: the outer nursery is done
    for recv in chans:
        done = (await events_of(recv))[-1]
        assert isinstance(done, DoneEvent) and done.usage.completion_tokens == 20
    assert handle.stopped.is_set() and not handle.cancel("r0")
    assert_free(handle)


async def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(autojump_clock: object) -> None:
    device = FakeDevice()
    device.fail_if = lambda plan: not device.failed and any(i.rid == "bad" for i in plan.items)  # once
    async with running(device) as handle:
        chans = {rid: submit(handle, rid, max_tokens=4) for rid in ("a", "bad", "b")}
        ends = {rid: (await events_of(recv))[-1] for rid, recv in chans.items()}
        later = (await events_of(submit(handle, "later", max_tokens=4)))[-1]
    failed_rids = {i.rid for plan in device.failed for i in plan.items}
    assert len(device.failed) == 1 and "bad" in failed_rids
    for rid, end in ends.items():
        if rid in failed_rids:
            assert isinstance(end, ErrorEvent) and end.code == "internal" and "device on fire" in end.message
        else:
            assert isinstance(end, DoneEvent) and end.text == "defg"
    assert isinstance(later, DoneEvent) and later.text == "defg"
    assert_free(handle)


async def test_cancel_mid_stream_ends_cancelled_and_frees(autojump_clock: object) -> None:
    async with running(FakeDevice()) as handle:
        recv = submit(handle, "long", max_tokens=100, stream=True)
        other = submit(handle, "other", max_tokens=5)
        seen = [await recv.receive() for _ in range(3)]
        assert all(isinstance(e, TokenEvent) for e in seen)
        assert handle.cancel("long") and handle.cancel("long")  # a second cancel is harmless
        rest = await events_of(recv)
        done = rest[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
        assert 3 <= done.usage.completion_tokens < 100
        assert not handle.cancel("long") and not handle.cancel("nobody")
        other_done = (await events_of(other))[-1]
        assert isinstance(other_done, DoneEvent) and other_done.finish_reason == "length"
        await trio.testing.wait_all_tasks_blocked()
        assert_free(handle)
        assert handle.stats().running == 0


async def test_cancel_before_the_request_reaches_the_scheduler(autojump_clock: object) -> None:
    async with running(FakeDevice()) as handle:
        recv = submit(handle, "x", max_tokens=50)
        assert handle.cancel("x")  # still in the tokenizer's inbox
        done = (await events_of(recv))[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"


async def test_client_gone_cancels_its_request(autojump_clock: object) -> None:
    async with running(FakeDevice()) as handle:
        recv = submit(handle, "gone", max_tokens=100, stream=True)
        await recv.receive()
        await recv.aclose()
        with trio.fail_after(10):
            while handle.stats().running or handle.stats().waiting:
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()
        assert_free(handle)


async def test_stop_strings_and_stop_tokens(autojump_clock: object) -> None:
    async with running(FakeDevice()) as handle:
        by_string = submit(handle, "s", "a", max_tokens=20, stop=("de",), stream=True)
        by_token = submit(handle, "t", "a", max_tokens=20, stop_token_ids=(letters("d")[0],))
        events = await events_of(by_string)
        token_done = (await events_of(by_token))[-1]
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop" and done.text == "bc"
    assert done.token_ids == tuple(letters("bcde"))  # up to the token that completed the stop string
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "bc"
    assert isinstance(token_done, DoneEvent) and token_done.finish_reason == "stop"
    assert token_done.text == "bc" and token_done.token_ids == tuple(letters("bcd"))


async def test_admission_errors(autojump_clock: object) -> None:
    async with running(FakeDevice(), max_waiting=2) as handle:  # at most 2 + 4 live requests
        first = submit(handle, "a", max_tokens=10)
        with pytest.raises(RequestError) as err:
            submit(handle, "a")
        assert err.value.code == "duplicate_id" and err.value.id == "a"
        send, _ = trio.open_memory_channel[Event](10)
        bad_ids = Submit(rid="v", prompt=None, prompt_token_ids=(3, MODEL.vocab_size))
        with pytest.raises(RequestError) as err:
            handle.submit(bad_ids, send)
        assert err.value.code == "invalid_request" and "prompt_token_ids[1]" in err.value.message
        too_long = submit(handle, "long", "a" * 120, max_tokens=9)
        with pytest.raises(ValueError, match=r"stop\[0\]"):  # refused before it reaches the engine
            submit(handle, "bad-stop", stop=("",))
        more = [submit(handle, f"m{i}", max_tokens=3) for i in range(4)]
        with pytest.raises(RequestError) as err:
            submit(handle, "one-too-many")
        assert err.value.code == "overloaded"
        done = (await events_of(first))[-1]
        assert isinstance(done, DoneEvent) and done.usage.completion_tokens == 10  # the original went on
        error = (await events_of(too_long))[-1]
        assert isinstance(error, ErrorEvent) and error.code == "context_too_long" and error.id == "long"
        for recv in more:
            assert isinstance((await events_of(recv))[-1], DoneEvent)


async def test_preemption_under_memory_pressure(autojump_clock: object) -> None:
    tight = ENGINE.with_(max_total_tokens=128, max_num_batched_tokens=16)  # 8 pages of 16 tokens
    device = FakeDevice()
    async with running(device, tight) as handle:
        ids = tuple(letters("abcdefghijklmnopqrst"))  # token ids, so no tokenizer thread races the clock
        chans = [submit(handle, f"r{i}", None, max_tokens=30, prompt_token_ids=ids) for i in range(4)]
        ends = [(await events_of(recv))[-1] for recv in chans]
        stats = handle.stats()
    expected = "".join(chr(ord("a") + (20 + i) % 26) for i in range(30))
    for end in ends:
        assert isinstance(end, DoneEvent) and end.text == expected
    assert stats.num_finished == 4 and stats.pools["full"].capacity == 128
    starts = [i.rid for plan in device.plans for i in plan.items if i.prefix_len == 0]
    assert len(starts) > len(set(starts)) == 4  # some request was preempted and recomputed
    assert_free(handle)


async def test_canonical_log_lines(autojump_clock: object) -> None:
    out = io.StringIO()
    logs.configure("info", stream=out)
    try:
        async with running(FakeDevice()) as handle:
            await events_of(submit(handle, "r", max_tokens=3))
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    steps = [line for line in lines if line["event"] == "step"]
    assert steps and {
        "step",
        "num_reqs",
        "num_prefill_tokens",
        "num_decode",
        "duration_ms",
        "pool_used",
    } <= set(steps[0])
    assert steps[0]["actor"] == "executor" and steps[0]["num_prefill_tokens"] == 3
    (req,) = [line for line in lines if line["event"] == "request"]
    assert req["rid"] == "r" and req["completion_tokens"] == 3 and req["finish_reason"] == "length"
    assert {"ttft_ms", "prompt_tokens", "preemptions"} <= set(req)


# ---------------------------------------------------------------- faults contained per request (issue 9)


async def test_a_kv_write_fault_fails_only_its_steps_requests(autojump_clock: object) -> None:
    device, failed_rids = FakeDevice(), set[str]()

    async def write_locs(locs: Sequence[CacheLocs]) -> None:
        if not failed_rids and any(loc.rid == "bad" for loc in locs):  # once
            failed_rids.update(loc.rid for loc in locs)
            raise RuntimeError("table store failed")

    parts = dataclasses.replace(make_parts(device), write_locs=write_locs)
    async with running(device, parts=parts) as handle:
        chans = {rid: submit(handle, rid, max_tokens=4) for rid in ("a", "bad", "b")}
        ends = {rid: (await events_of(recv))[-1] for rid, recv in chans.items()}
        later = (await events_of(submit(handle, "later", max_tokens=4)))[-1]
        await trio.testing.wait_all_tasks_blocked()
        assert_free(handle)
    assert "bad" in failed_rids
    for rid, end in ends.items():
        if rid in failed_rids:
            assert (
                isinstance(end, ErrorEvent) and end.code == "internal" and "table store failed" in end.message
            )
        else:
            assert isinstance(end, DoneEvent) and end.text == "defg"
    assert isinstance(later, DoneEvent) and later.text == "defg"


async def test_an_encode_fault_fails_only_its_request(autojump_clock: object) -> None:
    def encode(text: str) -> list[int]:
        if text == "boom":
            raise RuntimeError("tokenizer panicked")
        return letters(text)

    device = FakeDevice()
    parts = dataclasses.replace(make_parts(device), encode=encode)
    async with running(device, parts=parts) as handle:
        bad = submit(handle, "bad", "boom", max_tokens=4, prompt_token_ids=None)  # a text prompt
        error = (await events_of(bad))[-1]
        ok = (await events_of(submit(handle, "ok", max_tokens=4)))[-1]
        again = (await events_of(submit(handle, "bad", max_tokens=4)))[-1]  # the id is free again
    assert (
        isinstance(error, ErrorEvent) and error.code == "internal" and "tokenizer panicked" in error.message
    )
    assert isinstance(ok, DoneEvent) and ok.text == "defg"
    assert isinstance(again, DoneEvent) and again.text == "defg"


async def test_a_grammar_engine_fault_fails_only_its_request(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xgrammar failing (here its import, as in an install without it) on a structured request: that
    request ends with an internal error naming the fault; the engine serves the next one."""
    from dsv4serve.chat.grammar import json_output

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    device = FakeDevice()
    async with running(device) as handle:
        bad = submit(handle, "bad", max_tokens=4, structured=json_output(None, False))
        error = (await events_of(bad))[-1]
        ok = (await events_of(submit(handle, "ok", max_tokens=4)))[-1]
    assert isinstance(error, ErrorEvent) and error.code == "internal", error
    assert "grammar failed: ModuleNotFoundError" in error.message and "xgrammar" in error.message
    assert isinstance(ok, DoneEvent) and ok.text == "defg"


class FaultyDecoder(FakeDecoder):
    """Raises on the letter z: a request whose output reaches it hits a detokenizer fault."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if letters("z")[0] in token_ids:
            raise RuntimeError("decoder fault")
        return super().decode(token_ids, skip_special_tokens)


async def test_a_detokenizer_fault_fails_only_its_request(autojump_clock: object) -> None:
    device = FakeDevice()
    parts = dataclasses.replace(make_parts(device), decoder=FaultyDecoder())
    async with running(device, parts=parts) as handle:
        bad = submit(handle, "bad", "vwx", max_tokens=20, stream=True)  # y, then z: the fault
        ok = submit(handle, "ok", "abc", max_tokens=6, stream=True)
        bad_events, ok_events = await events_of(bad), await events_of(ok)
        with trio.fail_after(10):  # the scheduler cancels the failed request and frees its memory
            while handle.stats().running or handle.stats().waiting:
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()
        assert_free(handle)
        again = (await events_of(submit(handle, "bad", "abc", max_tokens=2)))[-1]
    error = bad_events[-1]
    assert isinstance(error, ErrorEvent) and error.code == "internal" and "decoder fault" in error.message
    assert [e.text for e in bad_events if isinstance(e, TokenEvent)] == ["y"]
    assert isinstance(ok_events[-1], DoneEvent) and ok_events[-1].text == "defghi"
    assert isinstance(again, DoneEvent) and again.text == "de"


async def test_a_prompt_too_long_to_fit_is_refused_before_encoding(autojump_clock: object) -> None:
    """Encoding a huge text prompt costs ~160 bytes per character; one that cannot fit in the context
    (more characters than the longest token's times max_model_len) is refused without encoding."""
    encoded: list[str] = []

    def encode(text: str) -> list[int]:
        encoded.append(text)
        return letters(text)

    device = FakeDevice()
    parts = dataclasses.replace(make_parts(device), encode=encode, max_token_chars=2)  # 2 * 128 chars
    async with running(device, parts=parts) as handle:
        long = submit(handle, "long", "a" * 257, max_tokens=1, prompt_token_ids=None)
        error = (await events_of(long))[-1]
        fits = (await events_of(submit(handle, "fits", "abc", max_tokens=2, prompt_token_ids=None)))[-1]
    assert (
        isinstance(error, ErrorEvent)
        and error.code == "context_too_long"
        and "257 characters" in error.message
    )
    assert isinstance(fits, DoneEvent) and fits.text == "de" and encoded == ["abc"]
