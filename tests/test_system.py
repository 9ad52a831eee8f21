"""The real actor system on a tiny random DeepSeek-V4 checkpoint (CPU): requests end to end,
cancel, duplicate ids, context errors, pools free at the end, drain stops the system."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from event_helpers import events_of

from dsv4serve.actors.system import EngineHandle, SystemOptions, run_system
from dsv4serve.config import EngineConfig
from dsv4serve.models.deepseek_v4.tiny import make_tiny
from dsv4serve.protocol import DoneEvent, ErrorEvent, Event, RequestError, SamplingParams, Submit, TokenEvent

ENGINE = EngineConfig(
    device="cpu",
    page_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=48,
    max_total_tokens=1024,
    max_model_len=96,
)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return make_tiny(tmp_path_factory.mktemp("tiny_system"), seed=0)


@asynccontextmanager
async def system(model_dir: Path) -> AsyncIterator[EngineHandle]:
    async with trio.open_nursery() as nursery:
        handle: EngineHandle = await nursery.start(run_system, SystemOptions(model_dir, ENGINE))
        yield handle
        with trio.fail_after(60):
            await handle.drain()
    assert handle.stopped.is_set()


def submit(handle: EngineHandle, rid: str, **kw: object) -> trio.MemoryReceiveChannel[Event]:
    send, recv = trio.open_memory_channel[Event](1000)
    args: dict[str, object] = {"prompt": None, "prompt_token_ids": None, **kw}
    params = args.pop("sampling", GREEDY)
    changes = {name: args.pop(name) for name in SamplingParams.__struct_fields__ if name in args}
    fields = {f: getattr(params, f) for f in SamplingParams.__struct_fields__} | {"max_tokens": 6} | changes
    handle.submit(Submit(rid=rid, params=SamplingParams(**fields), **args), send)  # type: ignore[arg-type]
    return recv


def assert_all_free(handle: EngineHandle) -> None:
    usage = handle.pool_usage()
    assert usage and all(used == 0 for used, _ in usage.values()), usage


async def test_requests_end_to_end(tiny_dir: Path) -> None:
    ids = [0, *range(100, 140)]  # long enough for chunked prefill (budget 48) across c4 windows
    async with system(tiny_dir) as handle:
        assert handle.model.vocab_size == 129280
        chans = {
            "text": submit(handle, "text", prompt="Hello world, this is a test.", stream=True),
            "ids-a": submit(handle, "ids-a", prompt_token_ids=tuple(ids), stream=True),
            "ids-b": submit(handle, "ids-b", prompt_token_ids=tuple(ids)),
            "logprobs": submit(
                handle, "logprobs", prompt_token_ids=(0, 5, 6), sampling=SamplingParams(logprobs=True)
            ),
            "one": submit(handle, "one", prompt_token_ids=(0, 7), max_tokens=1),
        }
        results = {rid: await events_of(recv, timeout_s=60) for rid, recv in chans.items()}
        alone = (await events_of(submit(handle, "alone", prompt_token_ids=tuple(ids)), timeout_s=60))[-1]
        await trio.testing.wait_all_tasks_blocked()  # the last Free has reached the allocator
        assert_all_free(handle)
        stats = handle.stats()
    dones = {rid: events[-1] for rid, events in results.items()}
    assert all(isinstance(d, DoneEvent) for d in dones.values()), dones
    for rid, events in results.items():
        done = events[-1]
        assert isinstance(done, DoneEvent)
        assert done.usage.completion_tokens == len(done.token_ids) >= 1
        assert done.finish_reason == "stop" or len(done.token_ids) == (1 if rid == "one" else 6)
        streamed = [e for e in events if isinstance(e, TokenEvent)]
        if rid in ("text", "ids-a"):
            assert sum((e.token_ids for e in streamed), ()) == done.token_ids
            assert "".join(e.text for e in streamed) == done.text
        else:
            assert not streamed
    a, b = dones["ids-a"], dones["ids-b"]
    assert isinstance(a, DoneEvent) and isinstance(b, DoneEvent) and isinstance(alone, DoneEvent)
    assert a.token_ids == b.token_ids == alone.token_ids  # greedy: batching changes nothing
    lp = dones["logprobs"]
    assert isinstance(lp, DoneEvent) and lp.logprobs is not None and len(lp.logprobs) == len(lp.token_ids)
    assert all(x <= 0 for x in lp.logprobs)
    assert a.usage.prompt_tokens == len(ids) and dones["text"].usage.prompt_tokens > 1  # type: ignore[union-attr]
    assert stats.num_finished == 6 and stats.num_steps > 0 and stats.running == 0


async def test_cancel_duplicate_and_context_errors(tiny_dir: Path) -> None:
    async with system(tiny_dir) as handle:
        long = submit(handle, "long", prompt_token_ids=(0, 11, 12, 13), max_tokens=80, stream=True)
        other = submit(handle, "other", prompt_token_ids=(0, 21, 22), max_tokens=4)
        first = [await long.receive() for _ in range(2)]
        assert all(isinstance(e, TokenEvent) for e in first)
        with pytest.raises(RequestError) as err:
            submit(handle, "long", prompt_token_ids=(0, 1))
        assert err.value.code == "duplicate_id"
        assert handle.cancel("long")
        done = (await events_of(long, timeout_s=60))[-1]
        assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
        assert 2 <= done.usage.completion_tokens < 80
        too_long = submit(handle, "too-long", prompt_token_ids=tuple(range(1, 92)), max_tokens=6)
        error = (await events_of(too_long, timeout_s=60))[-1]
        assert isinstance(error, ErrorEvent) and error.code == "context_too_long" and error.id == "too-long"
        ok = (await events_of(other, timeout_s=60))[-1]
        assert isinstance(ok, DoneEvent) and ok.finish_reason in ("length", "stop")
        await trio.testing.wait_all_tasks_blocked()
        assert_all_free(handle)
        # the id is free again once its request ended
        again = (
            await events_of(submit(handle, "long", prompt_token_ids=(0, 11), max_tokens=2), timeout_s=60)
        )[-1]
        assert isinstance(again, DoneEvent)
        early = submit(handle, "early", prompt="cancelled before it is even tokenized", max_tokens=6)
        assert handle.cancel("early")
        assert (await events_of(early, timeout_s=60))[-1].finish_reason == "cancelled"  # type: ignore[union-attr]
        # every accepted request counted once by how it ended, the tokenizer's refusals included
        ended = handle.stats().finished_by_reason
        assert ended.get("cancelled") == 2 and ended.get("error") == 1, ended
        assert handle.stats().num_finished == 5
    assert_all_free(handle)


def test_decodes_launched_in_place_give_the_same_tokens(tiny_dir: Path) -> None:
    """On a GPU a captured decode graph is launched on the trio thread (no worker-thread hop) and a
    finished step is collected in place; here every decode takes that path (as if its graph were
    captured) and must give the tokens of the threaded path."""
    from dsv4serve import Engine, SamplingParams
    from dsv4serve.actors.tokenizer_core import load_tokenizer
    from dsv4serve.executor.graphs import is_decode
    from dsv4serve.executor.runner import ModelRunner

    prompts = [[0, *range(100, 100 + n)] for n in (3, 17, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    runner = ModelRunner(tiny_dir, ENGINE)
    inline: list[bool] = []

    def replays(plan: object) -> bool:
        inline.append(is_decode(plan.items))  # type: ignore[attr-defined]
        return inline[-1]

    got = []
    for in_place in (False, True):
        if in_place:
            runner.replays = replays  # type: ignore[method-assign]
        options = SystemOptions(tiny_dir, ENGINE, prebuilt=(runner, load_tokenizer(tiny_dir)))
        with Engine._of(options) as engine:
            got.append([c.token_ids for c in engine.generate(prompts, params)])
    assert any(inline) and not all(inline)  # decodes in place, prefills in worker threads
    assert got[0] == got[1] and all(len(ids) == 8 for ids in got[1])
