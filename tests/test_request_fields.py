"""The request fields real clients send. Logit processing (logit_bias, repetition / frequency / presence
penalties, min_tokens): the device state against a per-token loop on fresh random logits, and the
engine's choices against the logprobs it reports; `echo`; every field through the `openai` client, bad
values refused with 400 naming the field."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from http_harness import ServedModel

from dsv4serve import Engine, SamplingParams
from dsv4serve.config import EngineConfig
from dsv4serve.executor.grammar import Grammars
from dsv4serve.executor.processing import LogitProcessing
from dsv4serve.protocol import LOOKAHEAD, StepItem

V = 50


def _loop_reference(logits: list[float], prompt: list[int], output: list[int], spec: SamplingParams,
                    eos: tuple[int, ...]) -> list[float]:  # fmt: skip
    """vLLM's order, one token at a time: bias, repetition, frequency / presence, min_tokens."""
    out = []
    for t, x in enumerate(logits):
        x += (spec.logit_bias or {}).get(t, 0.0)
        count = output.count(t)
        if count or t in prompt:
            x = x / spec.repetition_penalty if x > 0 else x * spec.repetition_penalty
        x -= spec.frequency_penalty * count + spec.presence_penalty * (count > 0)
        if len(output) < spec.min_tokens and (t in eos or t in spec.stop_token_ids):
            x = -math.inf
        out.append(x)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_processing_matches_a_per_token_loop_across_steps(seed: int) -> None:
    rng = random.Random(seed)
    eos = (1,)
    proc = LogitProcessing(
        num_rows=6, eos_token_ids=eos, device=torch.device("cpu"), grammars=Grammars(None, V, eos)
    )
    specs = [
        SamplingParams(
            max_tokens=20,
            min_tokens=rng.choice([0, 2, 5]),
            repetition_penalty=rng.choice([1.0, 0.5, 1.7]),
            frequency_penalty=rng.uniform(-2, 2),
            presence_penalty=rng.uniform(-2, 2),
            logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(4))} or None,
            stop_token_ids=(rng.randrange(V),),
        )
        for _ in range(3)
    ] + [SamplingParams(max_tokens=20)]  # one row that does not process: left as it is
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 8))] for _ in specs]
    outputs: list[list[int]] = [[] for _ in specs]
    rows = [4, 0, 2, 5]
    for step in range(6):
        items = []
        for r, spec, prompt, output in zip(rows, specs, prompts, outputs, strict=True):
            history = prompt + output
            lookahead = step % 2 == 1  # every other step the host does not know the last token
            items.append(
                StepItem(
                    rid=f"r{r}", prefix_len=len(history) - 1,
                    token_ids=(LOOKAHEAD,) if lookahead else (history[-1],), sample=True, sampling=spec,
                    row=r, history=None if lookahead or not spec.processes_logits else tuple(history),
                    prompt_len=len(prompt),
                )
            )  # fmt: skip
        logits = torch.randn(len(items), V) * 3
        prep = proc.prepare(items, V)
        assert prep is not None
        got = proc.apply(logits, prep)
        for j, (spec, prompt, output) in enumerate(zip(specs, prompts, outputs, strict=True)):
            want = _loop_reference(logits[j].tolist(), prompt, output, spec, eos)
            if not spec.processes_logits:
                want = logits[j].tolist()
            assert got[j].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5), (step, j)
        tokens = torch.tensor([rng.randrange(V) for _ in items])
        proc.record(prep, tokens)
        for output, token in zip(outputs, tokens.tolist(), strict=True):
            output.append(token)


def test_engine_draws_the_argmax_of_the_processed_logits(tiny_model_dir: Path) -> None:
    """Greedy with penalties and bias: each chosen token beats every reported top token once the
    adjustments are applied to the model's own logprobs (logit - log Z, one Z per position)."""
    probe = SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=20)
    with Engine(tiny_model_dir, max_total_tokens=4096) as engine:
        [plain] = engine.generate(["Tell me a story"], probe)
        assert plain.top_logprobs is not None
        first, runner_up = plain.top_logprobs[0][0], plain.top_logprobs[0][5]
        # the sixth most likely token, lifted to win by 15: it keeps winning until its penalties
        # (1.5 an occurrence + 0.7) eat the lift, so the counts are exercised
        bias = {runner_up.token_id: first.logprob - runner_up.logprob + 15.0, 17: -50.0}
        spec = SamplingParams(temperature=0, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.7,
                              logit_bias=bias, logprobs=True, top_logprobs=20)  # fmt: skip
        [got] = engine.generate(["Tell me a story"], spec)
    assert got.logprobs is not None and got.top_logprobs is not None
    assert 2 <= got.token_ids.count(runner_up.token_id) < 24, got.token_ids
    for n, (token, lp, top) in enumerate(zip(got.token_ids, got.logprobs, got.top_logprobs, strict=True)):
        before = got.token_ids[:n]

        def adjusted(t: int, value: float, before: tuple[int, ...] = before) -> float:
            c = before.count(t)
            return value + bias.get(t, 0.0) - 1.5 * c - 0.7 * (c > 0)

        for alt in top:
            assert adjusted(token, lp) >= adjusted(alt.token_id, alt.logprob) - 1e-4, (n, token, alt)


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_model_dir: Path) -> None:
    forced = SamplingParams(temperature=0, max_tokens=8, logit_bias={77: 100.0}, stop_token_ids=(77,))
    with Engine(tiny_model_dir, max_total_tokens=4096) as engine:
        [now] = engine.generate(["Hi"], forced)
        [later] = engine.generate(["Hi"], SamplingParams(**{**_fields(forced), "min_tokens": 3}))
    assert now.token_ids == (77,) and now.finish_reason == "stop"
    assert len(later.token_ids) == 4 and later.token_ids[3] == 77 and 77 not in later.token_ids[:3]
    assert later.finish_reason == "stop"


def test_min_tokens_holds_back_stop_strings(tiny_model_dir: Path) -> None:
    """As vLLM: no stop string is looked for in the text of the first min_tokens tokens."""
    with Engine(tiny_model_dir, max_total_tokens=4096) as engine:
        forced = SamplingParams(temperature=0, max_tokens=8, logit_bias={77: 100.0})
        [probe] = engine.generate(["Hi"], forced)
        stop = probe.text[: len(probe.text) // 8]  # one token's text
        [now] = engine.generate(["Hi"], SamplingParams(**{**_fields(forced), "stop": (stop,)}))
        held = SamplingParams(**{**_fields(forced), "stop": (stop,), "min_tokens": 3})
        [later] = engine.generate(["Hi"], held)
    assert stop and now.finish_reason == "stop" and len(now.token_ids) == 1 and now.text == ""
    assert later.finish_reason == "stop" and len(later.token_ids) == 4 and later.text == stop * 3


def _fields(spec: SamplingParams) -> dict[str, object]:
    return {name: getattr(spec, name) for name in SamplingParams.__struct_fields__}


def test_processing_rows_are_batch_invariant(tiny_model_dir: Path) -> None:
    """A processing request's greedy tokens alone and among others (some processing, some not)."""
    spec = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8, frequency_penalty=0.5)
    others = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12,
              presence_penalty=1.0, logit_bias={9: 3.0})]  # fmt: skip
    with Engine(tiny_model_dir, max_total_tokens=4096) as engine:
        [alone] = engine.generate(["one two three"], spec)
        mixed = engine.generate(["x", "one two three", "y z"], [others[0], spec, others[1]])
    assert mixed[1].token_ids == alone.token_ids


# ---------------------------------------------------------------- through the openai client


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServedModel]:
    srv = ServedModel(tiny_model_dir, EngineConfig(max_total_tokens=4096, max_num_seqs=8))
    try:
        yield srv
    finally:
        srv.close()


def _client(server: ServedModel) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_fields_through_the_openai_client(server: ServedModel) -> None:
    client = _client(server)
    token = 77
    text = server.tok.decode([token])
    biased = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == text * 3
    held = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, logit_bias={str(token): 100},
        extra_body={"min_tokens": 2, "stop_token_ids": [token]},
    )  # fmt: skip
    assert held.usage is not None and held.usage.completion_tokens == 3
    assert held.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        frequency_penalty=1.0, presence_penalty=0.5, extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens (4)
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
    ],
)
def test_bad_values_are_refused_naming_the_field(server: ServedModel, extra: dict[str, object],
                                                 field: str) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).completions.create(
            model="tiny", prompt="Hello", max_tokens=4, temperature=0, extra_body=extra
        )
    assert field in str(err.value)


def test_echo_through_the_openai_client(server: ServedModel) -> None:
    client = _client(server)
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    echoed = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    ids = server.encode("Token ids")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(server.tok.decode(ids))
    streamed = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True, logprobs=1)
