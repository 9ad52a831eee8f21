"""Structured output (issue 29): `response_format` (`json_object`, `json_schema`) and strict tool calls
through the `openai` client on tiny DeepSeek-V4 and GLM checkpoints, whose random weights would emit
anything: every answer that finishes with `stop` must parse and follow its schema, so a grammar that is
not applied fails these tests. Below them, the engine core's matchers: masks against a fresh matcher's
after a history that is not a continuation, EOS only after a refused token, the bitmask unpacking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from dsv4serve import Engine, SamplingParams
from dsv4serve.chat.grammar import json_output
from dsv4serve.config import EngineConfig
from dsv4serve.executor.grammar import Grammars, unpack
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm
from dsv4serve.protocol import StepItem
from tests.http_harness import ServedModel

ENGINE = EngineConfig(max_total_tokens=8192, max_num_seqs=8, max_num_batched_tokens=512)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["ok", "color", "n", "tags"],
    "additionalProperties": False,
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # random weights never end a thought
CITY: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def follows(value: Any) -> bool:
    """Whether `value` matches SCHEMA (written out: no validator library is a dependency)."""
    if not isinstance(value, dict) or set(value) != {"ok", "color", "n", "tags"}:
        return False
    tags = value["tags"]
    return (
        isinstance(value["ok"], bool)
        and value["color"] in ("red", "green", "blue")
        and isinstance(value["n"], int)
        and not isinstance(value["n"], bool)
        and isinstance(tags, list)
        and len(tags) <= 2
        and all(isinstance(t, str) and len(t) <= 4 for t in tags)
    )


def city_args(arguments: str) -> bool:
    value = json.loads(arguments)
    return (
        set(value) == {"city", "days"} and value["city"] in ("Paris", "Oslo") and type(value["days"]) is int
    )


@pytest.fixture(scope="module")
def dsv4(tiny_model_dir: Path) -> Iterator[ServedModel]:
    model = ServedModel(tiny_model_dir, ENGINE)
    yield model
    model.close()


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    model = ServedModel(make_tiny_glm(tmp_path_factory.mktemp("glm-so"), seed=3, num_hidden_layers=2), ENGINE)
    yield model
    model.close()


def _client(server: ServedModel) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat(server: ServedModel, **kw: Any) -> Any:
    messages = [{"role": "user", "content": "Describe the sky."}]
    return _client(server).chat.completions.create(model="tiny", messages=messages, **kw)


def test_json_schema_answers_parse_and_follow_the_schema(dsv4: ServedModel) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True}}
    stopped = 0
    for seed in range(4):
        got = _chat(dsv4, max_tokens=400, temperature=1.0, seed=seed, response_format=fmt)
        if got.choices[0].finish_reason == "stop":
            stopped += 1
            assert follows(json.loads(got.choices[0].message.content)), got.choices[0].message.content
    assert stopped >= 3  # the grammar bounds every part of the answer: it ends


def test_json_object_completion_parses(dsv4: ServedModel) -> None:
    client = _client(dsv4)
    body = {"response_format": {"type": "json_object"}}
    for seed in range(3):
        got = client.completions.create(
            model="tiny", prompt="Hello", max_tokens=64, temperature=1.0, seed=seed, extra_body=body
        )
        text = got.choices[0].text
        assert text.lstrip().startswith("{")
        if got.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_streamed_structured_answer_equals_the_whole_one(dsv4: ServedModel) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA}}
    whole = _chat(dsv4, max_tokens=400, temperature=0, response_format=fmt)
    chunks = _chat(dsv4, max_tokens=400, temperature=0, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.parametrize("family", ["dsv4", "glm"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_strict_tool_calls_follow_their_schema(
    family: str, choice: str, request: pytest.FixtureRequest
) -> None:
    """One call (parallel_tool_calls false): the grammar ends after it, so the answer ends there."""
    server: ServedModel = request.getfixturevalue(family)
    tool_choice: Any = "required"
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        got = _chat(server, max_tokens=300, temperature=1.0, seed=seed, tools=[CITY], tool_choice=tool_choice,
                    parallel_tool_calls=False, extra_body=NO_THINKING)  # fmt: skip
        assert got.choices[0].finish_reason == "tool_calls"
        calls = got.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        assert city_args(calls[0].function.arguments), calls[0].function.arguments


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
            "response_format",
        ),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "xml"}, "type"),
    ],
)
def test_bad_formats_are_refused_naming_the_field(dsv4: ServedModel, fmt: Any, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(dsv4, max_tokens=8, response_format=fmt)
    assert field in str(err.value)
    assert _chat(dsv4, max_tokens=2).choices[0].finish_reason == "length"  # still serving


def test_structured_rows_are_batch_invariant(tiny_model_dir: Path) -> None:
    """A structured request's greedy tokens alone and beside plain ones (no lookahead for it)."""
    structured = SamplingParams(max_tokens=48, temperature=0, structured=json_output(SCHEMA, False))
    plain = SamplingParams(max_tokens=48, temperature=0)
    with Engine(tiny_model_dir, max_total_tokens=4096, max_num_seqs=8) as engine:
        alone = engine.generate(["Sky"], structured)[0]
        mixed = engine.generate(["Sea", "Sky", "Sun"], [plain, structured, plain])
    assert mixed[1].token_ids == alone.token_ids
    assert alone.text.lstrip().startswith("{")


# ---------------------------------------------------------------- the engine core's matchers


def _item(rid: str, history: list[int], prompt_len: int, spec: SamplingParams) -> StepItem:
    return StepItem(
        rid=rid, prefix_len=len(history) - 1, token_ids=(history[-1],), sample=True, sampling=spec, row=3,
        history=tuple(history), prompt_len=prompt_len,
    )  # fmt: skip


def test_matchers_follow_histories_and_restart_on_a_new_one(tiny_model_dir: Path) -> None:
    from dsv4serve.models.registry import config_from_dir

    cfg = config_from_dir(tiny_model_dir)
    grammars = Grammars(tiny_model_dir, cfg.vocab_size, cfg.eos_token_ids)
    spec = SamplingParams(max_tokens=64, structured=json_output(SCHEMA, False))
    tok_ids = grammars.info.decoded_vocab
    brace = next(i for i, t in enumerate(tok_ids) if t == b"{")
    prompt = [5, 6, 7]
    fresh = grammars.fill([_item("a", prompt, 3, spec)])
    after_brace = grammars.fill([_item("a", [*prompt, brace], 3, spec)])
    assert unpack(fresh, cfg.vocab_size)[0, brace]
    assert not torch.equal(fresh, after_brace)
    # the same row, a history that does not continue the one seen (a recompute): as a fresh matcher
    assert torch.equal(grammars.fill([_item("a", prompt, 3, spec)]), fresh)
    # a refused token (a letter before any `{`): EOS only from then on
    letter = next(i for i, t in enumerate(tok_ids) if t == b"x")
    broken = unpack(grammars.fill([_item("a", [*prompt, letter], 3, spec)]), cfg.vocab_size)[0]
    assert broken.nonzero().flatten().tolist() == sorted(set(cfg.eos_token_ids))
    assert torch.equal(grammars.fill([_item("a", [*prompt, brace], 3, spec)]), after_brace)
    # another request on the row: its own matcher
    assert torch.equal(grammars.fill([_item("b", prompt, 3, spec)]), fresh)


def test_unpack_reads_bit_t_of_word_t_over_32() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 75
    words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int64)
    mask = words.to(torch.int32)
    want = torch.tensor(
        [[(int(mask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)], dtype=torch.bool
    )
    assert torch.equal(unpack(mask, vocab), want)


def test_min_tokens_is_refused_beside_a_grammar(dsv4: ServedModel) -> None:
    """An ended grammar allows EOS only, which min_tokens would forbid: every logit -inf."""
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=json_output(SCHEMA, False))
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        _chat(dsv4, max_tokens=8, response_format={"type": "json_object"}, extra_body={"min_tokens": 2})
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):  # a completion's bad schema
        _client(dsv4).completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body={"response_format": bad}
        )
