"""The embedded API on the real actor system: Engine (sync facade), AsyncEngine (trio), SamplingParams."""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
import trio

from dsv4serve import AsyncEngine, Completion, Engine, RequestError, SamplingParams, TokenEvent
from dsv4serve.actors.tokenizer_core import TokenizerError, encode_prompt, load_tokenizer
from dsv4serve.config import ConfigError, EngineConfig
from tests.golden_harness import reference_traces

SMALL: dict[str, Any] = {"max_total_tokens": 512, "page_size": 16, "max_num_seqs": 8}


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with Engine(tiny_model_dir, **SMALL) as eng:
        yield eng


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def request_logs() -> Iterator[list[dict[str, Any]]]:
    """Every structlog event of the test (at any level), whatever the session configured before."""
    saved = structlog.get_config()
    capture = structlog.testing.LogCapture()
    structlog.configure(
        processors=[capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )
    yield capture.entries
    structlog.configure(**saved)


async def wait_until_free_async(eng: AsyncEngine) -> None:
    with trio.fail_after(30):
        while any(used for used, _ in eng.pool_usage().values()) or eng.stats().running:
            await trio.sleep(0.02)


def wait_until_free(eng: Engine) -> None:
    deadline = time.monotonic() + 30
    while any(used for used, _ in eng.pool_usage().values()) or eng.stats().running:
        assert time.monotonic() < deadline, eng.stats()
        time.sleep(0.02)


# ---------------------------------------------------------------- SamplingParams


def test_sampling_params_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert (p.stop, p.stop_token_ids, p.logprobs, p.ignore_eos) == ((), (), False, False)
    q = SamplingParams(stop="\n", stop_token_ids=[1, 2], temperature=0, top_p=1)
    assert (q.stop, q.stop_token_ids) == (("\n",), (1, 2))
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("seed", 1.5),
        ("seed", "7"),
        ("ignore_eos", 1),
        ("stop", [""]),
        ("stop", ""),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("stop_token_ids", 5),
        ("logprobs", 1),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("top_logprobs", True),
    ],
)
def test_sampling_params_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}(\[\d+\])?: expected "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("cls", [Engine, AsyncEngine])
def test_engine_keywords_are_engine_config_fields(cls: type, tiny_model_dir: Path) -> None:
    """Every EngineConfig field is a keyword (max_model_len too); anything else is refused."""
    knobs = {"max_model_len": 512, "max_num_seqs": 3, "state_mode": "ring", "graphs": False}
    engine = AsyncEngine(tiny_model_dir, **knobs) if cls is AsyncEngine else None  # Engine would start one
    if engine is not None:
        assert engine.options.engine == EngineConfig(**knobs)
    with pytest.raises(TypeError, match="bogus"):
        cls(tiny_model_dir, bogus=1)
    with pytest.raises(ConfigError, match="max_model_len"):
        cls(tiny_model_dir, max_model_len=0)


@pytest.mark.parametrize(
    ("device", "asked", "apart"),
    [("cpu", None, False), ("cuda", None, True), ("cuda:1", None, True), ("npu", None, True),
     ("cuda", False, False), ("cpu", True, True)],
)  # fmt: skip
def test_the_engine_core_runs_apart_on_an_accelerator_unless_asked(
    tiny_model_dir: Path, device: str, asked: bool | None, apart: bool
) -> None:
    """`core_process` left out: the core in a process of its own on a GPU or NPU (the caller's stream
    handling never delays a step's launch), in the caller's on the CPU; asked, as asked. (Built, not
    started: no device is touched.)"""
    engine = AsyncEngine(tiny_model_dir, device=device, core_process=asked)
    assert engine.options.core_process is apart


# ---------------------------------------------------------------- Engine (sync)


def test_generate_str_and_token_prompts_in_input_order(engine: Engine, tok: Any) -> None:
    fib_ids = encode_prompt(tok, "def fibonacci(n):")
    prompts: list[str | list[int]] = ["The capital of France is", fib_ids, "Hello", [0, 100, 200, 300]]
    prompts.append("def fibonacci(n):")
    params = [greedy(n) for n in (3, 4, 5, 6, 4)]
    out = engine.generate(prompts, params)
    assert [type(c) for c in out] == [Completion] * 5
    expected_ids = [encode_prompt(tok, p) if isinstance(p, str) else p for p in prompts]
    assert [list(c.prompt_token_ids) for c in out] == expected_ids
    assert [c.finish_reason for c in out] == ["length"] * 5
    assert [len(c.token_ids) for c in out] == [3, 4, 5, 6, 4]
    for c in out:
        assert c.text == tok.decode(list(c.token_ids), skip_special_tokens=True)
        assert c.logprobs is None
    assert out[4].token_ids == out[1].token_ids  # the string and its ids are the same prompt


def test_generate_one_string_and_logprobs(engine: Engine) -> None:
    [c] = engine.generate("Hello", greedy(4, logprobs=True))
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 4
    assert all(lp <= 0 for lp in c.logprobs)


def test_top_logprobs_need_logprobs() -> None:
    with pytest.raises(ValueError, match=r"^top_logprobs: needs logprobs true"):
        SamplingParams(top_logprobs=3)


def test_top_logprobs_match_transformers_log_softmax(tiny_model_dir: Path) -> None:
    """Greedy: every position's top n are torch.log_softmax(reference logits).topk(n) (ties to the
    lowest id), the chosen token is the first of them with the same logprob, bit for bit."""
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 129000) for _ in range(n)] for n in (3, 9, 20)]
    traces = reference_traces(tiny_model_dir, prompts, 4)
    sizes = (5, 1, 20)
    with Engine(tiny_model_dir, dtype="float32", **SMALL) as eng:
        params = [greedy(4, logprobs=True, top_logprobs=n) for n in sizes]
        out = eng.generate([*prompts, prompts[0]], [*params, greedy(4, logprobs=True)])
    for c, prompt, trace, n in zip(out, prompts, traces, sizes, strict=False):
        assert list(c.token_ids) == trace.tokens
        assert c.logprobs is not None and c.top_logprobs is not None and len(c.top_logprobs) == 4
        generated = trace.logits[len(prompt) - 1 :]  # the logits each generated token came from
        for logits, top, lp in zip(generated, c.top_logprobs, c.logprobs, strict=True):
            ref = torch.log_softmax(logits.double(), -1).topk(n + 1)
            want = sorted(
                zip(ref.values.tolist(), ref.indices.tolist(), strict=True), key=lambda x: (-x[0], x[1])
            )
            assert [t.token_id for t in top] == [i for _, i in want[:n]]
            assert [t.logprob for t in top] == pytest.approx([v for v, _ in want[:n]], abs=1e-4)
            assert top[0].logprob == lp
        assert [t[0].token_id for t in c.top_logprobs] == list(c.token_ids)
    assert out[3].token_ids == out[0].token_ids and out[3].logprobs == pytest.approx(
        out[0].logprobs, abs=1e-4
    )
    assert out[3].top_logprobs is None


def test_generate_rejects_bad_prompts(engine: Engine) -> None:
    for bad, field in [
        ([], "prompts"),
        ([[]], r"prompts\[0\]"),
        ([1, 2], r"prompts\[0\]"),
        (["a", [-1]], r"prompts\[1\]"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: expected"):
            engine.generate(bad, greedy(2))  # type: ignore[arg-type]


def test_failed_requests_raise_and_free_their_batch(engine: Engine) -> None:
    vocab = 129280
    with pytest.raises(RequestError) as err:
        engine.generate(["ok", [1, vocab]], greedy(2))
    assert err.value.code == "invalid_request" and "prompt_token_ids[1]" in err.value.message
    with pytest.raises(RequestError) as err:
        engine.generate(["a long one", "too long"], [greedy(300), greedy(600)])
    assert err.value.code == "context_too_long"
    wait_until_free(engine)  # the failed batch's other requests were cancelled
    assert engine.generate(["still", "serving"], greedy(2))[1].finish_reason == "length"


def test_generate_queues_a_batch_larger_than_the_admission_bound(tiny_model_dir: Path) -> None:
    """5,000 prompts, far above the 1,024 + 256 requests the engine admits at once: all complete, in
    input order (this used to raise `overloaded`)."""
    prompts: list[Any] = [[0, 5 + i % 97] if i % 50 else f"prompt {i}" for i in range(5000)]
    with Engine(tiny_model_dir, max_num_seqs=256, max_total_tokens=8192, page_size=16) as engine:
        completions = engine.generate(prompts, greedy(1))
        wait_until_free(engine)
    assert len(completions) == 5000
    assert all(len(c.token_ids) == 1 and c.finish_reason in ("length", "stop") for c in completions)
    for prompt, c in zip(prompts, completions, strict=True):
        if isinstance(prompt, list):
            assert list(c.prompt_token_ids) == prompt
    first = {tuple(c.prompt_token_ids): c.token_ids for c in completions}  # greedy: same prompt, same token
    assert all(first[tuple(c.prompt_token_ids)] == c.token_ids for c in completions)


def test_close_drains_in_flight_requests_then_refuses(tiny_model_dir: Path) -> None:
    eng = Engine(tiny_model_dir, **SMALL)
    results: list[list[Completion]] = []
    worker = threading.Thread(target=lambda: results.append(eng.generate(["drain me"], greedy(12))))
    worker.start()
    while eng.stats().running + eng.stats().waiting == 0 and worker.is_alive():
        time.sleep(0.01)
    eng.close()
    worker.join()
    assert [c.finish_reason for c in results[0]] == ["length"]
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(["late"], greedy(2))


def test_engine_rejects_a_missing_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Engine(tmp_path)


# ---------------------------------------------------------------- AsyncEngine


async def test_async_stream_then_cancel_by_cancelling_the_consumer(
    tiny_model_dir: Path, request_logs: list[dict[str, Any]]
) -> None:
    async with AsyncEngine(tiny_model_dir, **SMALL) as eng:
        events = [event async for event in eng.stream("Hello", greedy(6))]
        *deltas, done = events
        assert isinstance(done, Completion) and all(isinstance(d, TokenEvent) for d in deltas)
        assert "".join(d.text for d in deltas) == done.text  # type: ignore[union-attr]
        assert sum((d.token_ids for d in deltas), ()) == done.token_ids  # type: ignore[union-attr]
        assert (await eng.generate(["Hello"], greedy(6)))[0].token_ids == done.token_ids

        first_token = trio.Event()
        seen: list[object] = []

        async def consume() -> None:
            async for event in eng.stream("The capital of France is", greedy(400)):
                seen.append(event)
                first_token.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await first_token.wait()
            nursery.cancel_scope.cancel()  # cancel the consuming task
        assert seen and all(isinstance(e, TokenEvent) for e in seen)
        await wait_until_free_async(eng)
        assert (await eng.generate(["after"], greedy(2)))[0].finish_reason == "length"
    ends = [e for e in request_logs if e["event"] == "request"]
    cancelled = [e for e in ends if e["finish_reason"] == "cancelled"]
    assert len(cancelled) == 1 and cancelled[0]["completion_tokens"] < 400


async def test_async_generate_cancelled_by_its_caller_frees_memory(tiny_model_dir: Path) -> None:
    async with AsyncEngine(tiny_model_dir, **SMALL) as eng:
        with trio.move_on_after(0.5) as scope:
            await eng.generate(["one", "two", [0, 5, 6]], greedy(400))
        assert scope.cancelled_caught
        await wait_until_free_async(eng)
        with pytest.raises(ValueError, match=r"^prompt: expected"):
            async for _ in eng.stream([], greedy(2)):
                pass
    with pytest.raises(RuntimeError, match="not running"):
        await eng.generate(["x"], greedy(1))


def test_a_lone_surrogate_prompt_names_prompt(engine: Engine) -> None:
    with pytest.raises(RequestError) as err:
        engine.generate(["fine", "bad \ud800 text"], greedy(2))
    assert err.value.code == "invalid_request" and err.value.message.startswith("prompt: not valid Unicode")


def test_the_tokenizer_loads_first_and_fails_fast(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    (tmp_path / "tokenizer.json").write_text("{not json")  # and no weights at all
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        Engine(tmp_path)
