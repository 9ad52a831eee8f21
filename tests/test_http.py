"""`serve --http` against the official `openai` client on loopback, on the tiny checkpoint.

Tool calls come from the real model with its logits forced to a script (`http_harness.ForcedRunner`):
every step runs the model; only the sampled rows are biased toward the script's next id.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from dsv4serve.chat.messages import FunctionCall, ToolCallSpec
from dsv4serve.config import EngineConfig
from dsv4serve.models.deepseek_v4.chat import render_tool_calls
from dsv4serve.models.deepseek_v4.dsml import MARKERS
from dsv4serve.protocol import SamplingParams
from tests.http_harness import ServedModel, collect_stream, free

ENGINE = EngineConfig(max_total_tokens=8192, max_num_seqs=32, max_num_batched_tokens=512)
MAX_BODY = 1 << 20
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ARGS = {"city": 'Paris <"x">', "days": 3, "units": ["c", "f"]}


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[ServedModel]:
    model = ServedModel(tiny_model_dir, ENGINE, max_body_bytes=MAX_BODY)
    yield model
    model.close()


@pytest.fixture
def client(served: ServedModel) -> Iterator[openai.OpenAI]:
    served.forced.script = None
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c
    served.forced.script = None


def wait_free(served: ServedModel, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not free(served.pool_usage()):
        assert time.monotonic() < deadline, served.pool_usage()
        time.sleep(0.05)


def tool_call_text(reasoning: str, content: str) -> str:
    call = ToolCallSpec(function=FunctionCall(name="get_weather", arguments=json.dumps(ARGS)))
    return reasoning + "</think>" + content + render_tool_calls([call])


# ---------------------------------------------------------------- completions and chat


def test_completions_text_ids_stream_n_and_logprobs(served: ServedModel, client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    ids = [0, *served.encode("The capital of France is")]  # BOS + the text: the same prompt
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=0)
    streamed = client.completions.create(
        model="tiny",
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert whole.choices[0].text and whole.choices[0].text == by_ids.choices[0].text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert (
        whole.usage is not None
        and whole.usage.prompt_tokens == len(ids)
        and whole.choices[0].finish_reason == "length"
    )
    lp = by_ids.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and "".join(lp.tokens or []) == whole.choices[0].text
    multi = client.completions.create(
        model="tiny", prompt=["a", "b"], n=2, max_tokens=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]
    again = client.completions.create(
        model="tiny", prompt=["a", "b"], n=2, max_tokens=3, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in multi.choices]  # seeded: reproducible
    wait_free(served)


def test_chat_plain_stream_equals_whole(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True, logprobs=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == (whole.choices[0].message.content or "")
    last = chunks[-1].choices[0]
    assert (
        last.finish_reason == "length" and last.logprobs is not None and len(last.logprobs.content or []) == 8
    )


def test_top_logprobs_chat_and_completions_whole_and_streamed(
    served: ServedModel, client: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "Hello"}]
    chat: Any = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0}
    whole = client.chat.completions.create(**chat, logprobs=True, top_logprobs=3)
    streamed = list(client.chat.completions.create(**chat, logprobs=True, top_logprobs=3, stream=True))
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:  # greedy: the chosen token is the likeliest, with the same logprob
        top = entry.top_logprobs
        assert len(top) == 3 and (top[0].token, top[0].logprob) == (entry.token, entry.logprob)
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert all(t.bytes == list(t.token.encode()) and t.logprob <= 0 for t in top)
    last = streamed[-1].choices[0].logprobs
    assert last is not None and last.content == content  # streamed: all in the choice's last chunk
    plain = client.chat.completions.create(**chat, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content or [])  # type: ignore[union-attr]

    ids = [0, *served.encode("The capital of France is")]
    done = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=4)
    lp = done.choices[0].logprobs
    assert (
        lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and len(lp.top_logprobs) == 4
    )
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4 and next(iter(top.items())) == (token, chosen)  # ids alike share a text
    chunks = list(
        client.completions.create(
            model="tiny", prompt=ids, max_tokens=4, temperature=0, logprobs=4, stream=True
        )
    )
    assert chunks[-1].choices[0].logprobs == lp
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**chat, **bad)
        assert err.value.status_code == 400 and "top_logprobs" in str(err.value.body)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", logprobs=21)
    wait_free(served)


def test_ignore_eos_runs_to_max_tokens(served: ServedModel, client: openai.OpenAI) -> None:
    """vLLM's `ignore_eos` (load testers send it): the model's EOS no longer ends the request; a
    `stop_token_ids` entry still does. The script forces EOS as the third token."""
    script = served.encode(" a b")[:2]
    served.forced.script = [*script, served.forced.eos, *script]
    plain = client.completions.create(model="tiny", prompt="x", max_tokens=6, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage and plain.usage.completion_tokens == 3
    kept = client.completions.create(
        model="tiny", prompt="x", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert kept.choices[0].finish_reason == "length" and kept.usage and kept.usage.completion_tokens == 6
    stopped = client.completions.create(
        model="tiny", prompt="x", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [script[1]]},
    )  # fmt: skip
    assert (
        stopped.choices[0].finish_reason == "stop" and stopped.usage and stopped.usage.completion_tokens == 2
    )
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        client.completions.create(model="tiny", prompt="x", extra_body={"ignore_eos": "yes"})
    wait_free(served)


def test_continuous_usage_stats_in_every_chunk(served: ServedModel, client: openai.OpenAI) -> None:
    """vLLM's `stream_options.continuous_usage_stats` (guidellm sends it): every chunk carries the usage so
    far — the prompt's tokens and the tokens generated until then, rising to the final usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (
        client.completions.create(
            model="tiny", prompt="hello there", max_tokens=5, temperature=0, stream=True,
            stream_options=options,  # type: ignore[arg-type]
        ),
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
            stream=True, stream_options=options,  # type: ignore[arg-type]
        ),
    ):  # fmt: skip
        chunks = list(stream)
        final = chunks[-1].usage
        assert final is not None and not chunks[-1].choices and final.completion_tokens == 5
        running = [c.usage for c in chunks[:-1] if c.usage is not None]
        assert len(running) >= 5 and all(u.prompt_tokens == final.prompt_tokens > 0 for u in running)
        generated = [u.completion_tokens for u in running]
        assert generated == sorted(generated) and generated[-1] == 5 and generated[0] >= 1
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in running)
    wait_free(served)


def test_chat_stream_tool_call_with_reasoning(served: ServedModel, client: openai.OpenAI) -> None:
    served.forced.script = served.encode(tool_call_text("I should look it up.", "Checking."))
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
        stream=True,
        extra_body={"thinking": True},
    )
    got = collect_stream(stream)
    assert "".join(got.reasoning) == "I should look it up." and "".join(got.content) == "Checking."
    assert got.names == ["get_weather"] and len(got.pieces) > 3 and json.loads("".join(got.pieces)) == ARGS
    assert got.reasons[-1] == "tool_calls"
    assert not any(m in "".join(got.content + got.reasoning) for m in MARKERS)

    whole = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
        extra_body={"chat_template_kwargs": {"thinking": True}},  # vLLM's spelling of the same switch
    )
    message = whole.choices[0].message
    assert (
        message.content == "Checking."
        and getattr(message, "reasoning_content", None) == "I should look it up."
    )
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(message.tool_calls[0].function.arguments) == ARGS  # type: ignore[union-attr]
    assert whole.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_prefills_the_call(served: ServedModel, client: openai.OpenAI) -> None:
    full = render_tool_calls(
        [ToolCallSpec(function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'))]
    )
    served.forced.script = served.encode(
        full.split('name="get_weather">\n', 1)[1]
    )  # the model writes the rest
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
    )
    calls = reply.choices[0].message.tool_calls
    assert (
        calls
        and calls[0].function.name == "get_weather"
        and json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    )  # type: ignore[union-attr]
    assert not reply.choices[0].message.content


# ---------------------------------------------------------------- errors, disconnect, metrics


def test_errors_use_openai_error_objects(served: ServedModel, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value.body)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], extra_body={"bogus": 1}
        )
    with pytest.raises(openai.BadRequestError, match=r"chat_template_kwargs\.clear_thinking"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"chat_template_kwargs": {"clear_thinking": False}},  # a GLM variable
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with httpx.Client(base_url=served.url) as http:
        nope, wrong = http.get("/nope"), http.get("/v1/completions")
        assert (nope.status_code, nope.reason_phrase) == (404, "Not Found")  # status lines carry reasons
        assert (wrong.status_code, wrong.reason_phrase) == (405, "Method Not Allowed")
        assert http.get("/health").reason_phrase == "OK"
        big = http.post(
            "/v1/completions", content=b" " * (MAX_BODY + 1), headers={"content-type": "application/json"}
        )
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    wait_free(served)


def _ended(url: str) -> tuple[dict[str, float], float]:
    """/metrics: requests ended by reason, and the tokens the engine sampled."""
    with httpx.Client(base_url=url) as http:
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    samples = families["dsv4serve_requests_ended"].samples
    ended = {s.labels["reason"]: s.value for s in samples if s.name.endswith("_total")}
    return ended, families["dsv4serve_engine_generated_tokens"].samples[0].value


def test_disconnect_cancels_and_frees(served: ServedModel) -> None:
    """A client gone mid-stream: its request is cancelled, its memory freed, and the metrics count it
    (ended `cancelled`, its tokens among the engine's generated ones)."""
    before, tokens_before = _ended(served.url)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 2000, "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert r.status_code == 200 and next(lines).startswith("data: ")
        assert not free(served.pool_usage())
    wait_free(served)  # long before 2000 tokens could have been generated
    after, tokens_after = _ended(served.url)
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert tokens_after >= tokens_before + 1


def test_metrics_parse_as_prometheus_text(served: ServedModel, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="m", max_tokens=3)
    with httpx.Client(base_url=served.url) as http:
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "dsv4serve_requests_running",
        "dsv4serve_requests_waiting",
        "dsv4serve_pool_used_slots",
        "dsv4serve_tokens_per_second",
        "dsv4serve_time_to_first_token_seconds",
        "dsv4serve_time_per_output_token_seconds",
        "dsv4serve_preemptions",
    ):
        assert name in families, name
    weights = {s.labels["format"]: s.value for s in families["dsv4serve_weight_bytes"].samples}
    assert weights and all(v > 0 for v in weights.values()), weights
    pools = {s.labels["pool"] for s in families["dsv4serve_pool_capacity_slots"].samples}
    assert pools == set(served.pool_usage())
    ttft = [s for s in families["dsv4serve_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft[0].value >= 1


# ---------------------------------------------------------------- load


def concurrently(url: str, num: int, one: Any, ends: list[Any], seconds: float) -> list[Any]:
    """`one(http, i, ends)` for i < num at once, each on its own connection; returns `ends`."""

    async def main() -> None:
        limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            with trio.fail_after(seconds):
                async with trio.open_nursery() as nursery:
                    for i in range(num):
                        nursery.start_soon(one, http, i, ends)

    trio.run(main)
    return ends


def test_concurrent_streams_each_end_exactly_once(served: ServedModel) -> None:
    num = 200

    async def one(http: httpx.AsyncClient, i: int, ends: list[int]) -> None:
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 1 + i % 4, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ends[i] += sum(c["finish_reason"] is not None for c in json.loads(line[6:])["choices"])
                elif line == "data: [DONE]":
                    ends[i] += 100

    assert concurrently(served.url, num, one, [0] * num, 150) == [101] * num  # one finish_reason, one [DONE]
    wait_free(served)
    assert served.call(lambda: served.server.handle.stats().running) == 0


# ---------------------------------------------------------------- overload and drain


def test_overload_429_and_drain_503(tiny_model_dir: Path) -> None:
    model = ServedModel(tiny_model_dir, EngineConfig(max_total_tokens=4096, max_num_seqs=1), max_waiting=0)
    try:
        with httpx.Client(base_url=model.url, timeout=60) as http:
            body = {"model": "tiny", "prompt": "a", "max_tokens": 40, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as first:
                lines = first.iter_lines()
                assert next(lines).startswith("data: ")
                busy = http.post("/v1/completions", json={"model": "tiny", "prompt": "b"})
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "overloaded"
                model.begin_drain()
                late = http.post("/v1/completions", json={"model": "tiny", "prompt": "b"})
                assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
                assert http.get("/health").status_code == 503
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and any('"finish_reason":"length"' in x for x in rest)
    finally:
        model.close()  # returns once drained: the thread ends


def test_a_burst_of_1000_streams_is_answered_without_resets(tiny_model_dir: Path) -> None:
    """1,000 streaming requests opened at once from a separate client process: each is streamed to
    [DONE] or refused with 429 (the waiting queue is full), none reset. (With hypercorn's default listen
    backlog of 100 the kernel reset 175-334 of them here.)"""
    model = ServedModel(tiny_model_dir, EngineConfig(max_total_tokens=8192, max_num_seqs=64), max_waiting=256)
    try:
        client = [sys.executable, str(Path(__file__).parent / "burst_client.py"), model.url, "1000"]
        done = subprocess.run(client, capture_output=True, text=True, timeout=400, check=True)
        counts = json.loads(done.stdout)
        assert set(counts) <= {"done", "429"} and counts.get("done", 0) > 0, counts
        wait_free(model)
    finally:
        model.close()


async def test_a_stream_behind_the_engine_takes_every_arrived_event_at_once() -> None:
    """`Generation.batches`: what has arrived when the writer looks goes out together (one write),
    in order; then it waits for the next; it ends with the last choice's end."""
    from dsv4serve.http.generation import Generation
    from dsv4serve.protocol import DoneEvent, Submit, Timing, TokenEvent, Usage

    channels: dict[str, Any] = {}

    class Handle:
        def submit(self, submit: Submit, send: Any) -> None:
            channels[submit.rid] = send

        def cancel(self, rid: str) -> None:
            pass

    submits = [
        Submit(rid=r, prompt=None, prompt_token_ids=(1, 2), params=SamplingParams()) for r in ("a", "b")
    ]
    generation = Generation(Handle(), submits)  # type: ignore[arg-type]
    tokens = [TokenEvent(id=r, token_ids=(7,), text="x") for r in ("a", "b", "a")]
    for event in tokens:
        channels[event.id].send_nowait(event)
    done = [
        DoneEvent(
            id=r,
            finish_reason="length",
            token_ids=(7,),
            text="x",
            usage=Usage(prompt_tokens=2, completion_tokens=1),
            timing=Timing(ttft_ms=1, total_ms=1),
        )
        for r in ("a", "b")
    ]
    batches = generation.batches()
    assert await anext(batches) == [(0, tokens[0]), (1, tokens[1]), (0, tokens[2])]
    channels["a"].send_nowait(done[0])
    assert await anext(batches) == [(0, done[0])]
    channels["b"].send_nowait(done[1])
    assert await anext(batches) == [(1, done[1])]
    with pytest.raises(StopAsyncIteration):
        await anext(batches)


def test_a_choices_tokens_that_arrived_together_go_in_one_chunk() -> None:
    """`_merged`: consecutive token events of one choice join (ids and text in order, the first's
    prompt count); another choice's event or an end between them keeps them apart."""
    from dsv4serve.http.app import _merged
    from dsv4serve.protocol import TokenEvent

    a1 = TokenEvent(id="a", token_ids=(1,), text="x", prompt_tokens=5)
    a2, a3 = TokenEvent(id="a", token_ids=(2, 3), text="yz"), TokenEvent(id="a", token_ids=(4,), text="")
    b1 = TokenEvent(id="b", token_ids=(9,), text="q")
    joined = TokenEvent(id="a", token_ids=(1, 2, 3, 4), text="xyz", prompt_tokens=5)
    assert _merged([(0, a1), (0, a2), (0, a3)]) == [(0, joined)]
    assert _merged([(0, a1), (1, b1), (0, a2)]) == [(0, a1), (1, b1), (0, a2)]
    assert _merged([]) == []


def test_stream_interval_holds_a_choices_tokens_after_its_first() -> None:
    """`--stream-interval 3`: each choice's first token passes at once, later ones go three at a time
    as one event, and a choice's end releases what it holds, before the end."""
    from dsv4serve.http.app import _Held
    from dsv4serve.protocol import DoneEvent, Timing, TokenEvent, Usage

    def tok(rid: str, i: int) -> TokenEvent:
        return TokenEvent(id=rid, token_ids=(i,), text=str(i))

    held = _Held(3)
    assert held.release([(0, tok("a", 1)), (1, tok("b", 1))]) == [(0, tok("a", 1)), (1, tok("b", 1))]
    assert held.release([(0, tok("a", 2)), (0, tok("a", 3))]) == []
    three = TokenEvent(id="a", token_ids=(2, 3, 4), text="234")
    assert held.release([(0, tok("a", 4)), (1, tok("b", 2))]) == [(0, three)]
    usage, timing = Usage(prompt_tokens=1, completion_tokens=2), Timing(ttft_ms=1, total_ms=1)
    done = DoneEvent(id="b", finish_reason="length", token_ids=(1, 2), text="12", usage=usage, timing=timing)
    assert held.release([(1, done)]) == [(1, tok("b", 2)), (1, done)]
    assert _Held(1).release([(0, tok("a", 5))]) == [(0, tok("a", 5))]
