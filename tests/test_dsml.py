"""The DeepSeek-V4 chat template and the incremental DSML parser: random tool calls rendered the way
the template renders assistant turns, split at random, parse back to themselves; no markup in content."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve.chat.messages import (
    ChatMessage,
    ChatPrompt,
    FunctionCall,
    FunctionSpec,
    NamedFunction,
    NamedToolChoice,
    ToolCallSpec,
    ToolSpec,
)
from dsv4serve.models.deepseek_v4.chat import ChatError, render, render_tool_calls
from dsv4serve.models.deepseek_v4.dsml import MARKERS, Content, DSMLParser, Reasoning, collect, parse_output
from tests.dsv4_chat_oracle import render_chat

HYPOTHESIS = settings(deadline=None, max_examples=150)
# text with the characters that matter: tag starts, quotes, escapes, newlines, wide characters
TEXT = st.lists(st.sampled_from([*'ab <>/"\\\n｜你好{}[]:,', "</", "<｜", "DSML"]), max_size=24).map("".join)
PLAIN = st.text(st.sampled_from(list("ab <>/\"'\\\n你好{}")), max_size=20)
NAME = st.text(st.sampled_from(list("abcxyz_019")), min_size=1, max_size=10)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | PLAIN,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAME, inner, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(NAME, JSON_VALUE | TEXT, max_size=4)


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def no_markup(text: str) -> bool:
    return not any(marker in text for marker in MARKERS) and "<｜" not in text and "</｜" not in text


@st.composite
def outputs(draw: st.DrawFn) -> tuple[str, str, str, list[tuple[str, dict[str, object]]], bool]:
    thinking = draw(st.booleans())
    reasoning = draw(PLAIN) if thinking else ""
    content = draw(PLAIN)
    calls = draw(st.lists(st.tuples(NAME, ARGS), max_size=3))
    specs = [ToolCallSpec(function=FunctionCall(name=n, arguments=json.dumps(a))) for n, a in calls]
    text = (
        (reasoning + "</think>" if thinking else "") + content + (render_tool_calls(specs) if specs else "")
    )
    return text, reasoning, content, calls, thinking


@HYPOTHESIS
@given(outputs(), st.lists(st.integers(0, 400), max_size=30))
def test_random_splits_parse_to_the_rendered_calls(
    case: tuple[str, str, str, list[tuple[str, dict[str, object]]], bool], cuts: list[int]
) -> None:
    text, reasoning, content, calls, thinking = case
    parser = DSMLParser(thinking)
    deltas = [d for piece in split(text, cuts) for d in parser.feed(piece)] + parser.finish()
    streamed, whole = collect(deltas), parse_output(text, thinking)
    assert streamed == whole
    assert whole.reasoning == reasoning and whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert all(no_markup(d.text) for d in deltas if isinstance(d, Content | Reasoning))


@HYPOTHESIS
@given(
    st.lists(
        st.sampled_from(["<", "/", "｜DSML｜", "tool_calls", "invoke", ">", "\n", "a", "</think>", '"']),
        max_size=40,
    ).map("".join),
    st.lists(st.integers(0, 80), max_size=10),
    st.booleans(),
)
def test_any_text_in_any_split_keeps_markup_out_of_content(
    text: str, cuts: list[int], thinking: bool
) -> None:
    parser = DSMLParser(thinking)
    deltas = [d for piece in split(text, cuts) for d in parser.feed(piece)] + parser.finish()
    assert collect(deltas) == parse_output(text, thinking)
    assert all(no_markup(d.text) for d in deltas if isinstance(d, Content | Reasoning))


def test_arguments_stream_as_they_are_generated() -> None:
    call = ToolCallSpec(function=FunctionCall(name="f", arguments=json.dumps({"city": "Paris", "n": 3})))
    parser = DSMLParser()
    pieces = [p for ch in render_tool_calls([call]) for p in parser.feed(ch)] + parser.finish()
    args = [d.text for d in pieces if type(d).__name__ == "ToolArguments"]
    assert len(args) > 5 and "".join(args) == '{"city": "Paris", "n": 3}'


def msg(role: str, content: str | None = None, **kw: object) -> ChatMessage:
    return ChatMessage(role=role, content=content, **kw)  # type: ignore[arg-type]


def test_template_without_tools_matches_the_tokenizer_cores_chat() -> None:
    convo = [
        msg("system", "S"),
        msg("user", "a"),
        msg("assistant", "4", reasoning_content="r"),
        msg("user", "b"),
    ]
    plain = [{"role": m.role, "content": m.content} for m in convo]
    for thinking in (False, True):
        assert render(ChatPrompt(messages=tuple(convo), thinking=thinking)).text == render_chat(
            plain, thinking
        )


WEATHER = ToolSpec(type="function", function=FunctionSpec(name="get_weather", parameters={"type": "object"}))


def test_template_with_tools_history_and_forced_choice() -> None:
    call = ToolCallSpec(id="c1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    convo = (
        msg("user", "weather?"),
        msg("assistant", "", reasoning_content="look it up", tool_calls=[call]),
        msg("tool", "sunny", tool_call_id="c1"),
    )
    out = render(ChatPrompt(messages=convo, tools=(WEATHER,), thinking=True))
    schema = '{"name": "get_weather", "parameters": {"type": "object"}}'
    assert out.text.startswith("<｜begin▁of▁sentence｜>## Tools\n\n") and schema in out.text
    turn = "<｜User｜>weather?<｜Assistant｜><think>look it up</think>" + render_tool_calls([call])
    assert out.text.endswith(
        turn + "<｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>"
    )
    named = NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))
    forced = render(ChatPrompt(messages=convo[:1], tools=(WEATHER,), tool_choice=named))
    assert forced.text.endswith('</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n')
    none = render(ChatPrompt(messages=convo[:1], tools=(WEATHER,), tool_choice="none"))
    assert "## Tools" not in none.text


def test_template_errors_name_the_field() -> None:
    for prompt, field in [
        (ChatPrompt(messages=(msg("assistant", "x"),)), "messages"),
        (ChatPrompt(messages=(msg("user", "x"),), tool_choice="required"), "tool_choice"),
        (
            ChatPrompt(
                messages=(msg("user", "x"),),
                tools=(WEATHER,),
                tool_choice=NamedToolChoice(type="function", function=NamedFunction(name="nope")),
            ),
            "tool_choice",
        ),
    ]:
        try:
            render(prompt)
        except ChatError as err:
            assert str(err).startswith(field)
        else:
            raise AssertionError(f"{prompt} rendered")
