"""GLM-4.7's chat format: the tiny checkpoint's Jinja template rendered through transformers (system,
tools, tool calls and results, thinking on and off, forced tool choice, errors), and the incremental
output parser (reasoning, content, typed tool arguments, random splits, malformed output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve.chat.deltas import (
    Content,
    Delta,
    ParsedOutput,
    Reasoning,
    ToolArguments,
    ToolCall,
    ToolCallStart,
    collect,
)
from dsv4serve.chat.messages import (
    ChatError,
    ChatMessage,
    ChatPrompt,
    FunctionCall,
    FunctionSpec,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    ToolCallSpec,
    ToolSpec,
    prompt_of,
)
from dsv4serve.models.glm4_moe_lite.chat import GlmTemplate, read_chat_template
from dsv4serve.models.glm4_moe_lite.parser import MARKERS, GlmParser
from dsv4serve.models.glm4_moe_lite.tiny import CHAT_TEMPLATE
from dsv4serve.models.registry import spec_for

HYPOTHESIS = settings(deadline=None, max_examples=150)
TEMPLATE = GlmTemplate(CHAT_TEMPLATE, Path("tiny-glm"))
WEATHER = ToolSpec(
    type="function",
    function=FunctionSpec(
        name="get_weather",
        description="Weather by city",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    ),
)
WEATHER_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather by city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, '
    '"days": {"type": "integer"}}}}}'
)
TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\nYou can call functions to help with the request. Their signatures, one JSON "
    f"object a line:\n<tools>\n{WEATHER_JSON}\n</tools>\n\nCall a function by writing its name and its "
    "arguments as key / value pairs:\n<tool_call>{function-name}<arg_key>{key-1}</arg_key><arg_value>"
    "{value-1}</arg_value><arg_key>{key-2}</arg_key><arg_value>{value-2}</arg_value>...</tool_call>"
)
STRINGS = {"get_weather": frozenset({"city"})}


def msg(role: str, content: str | None = None, **kw: object) -> ChatMessage:
    return ChatMessage(role=role, content=content, **kw)  # type: ignore[arg-type]


def call(name: str, args: dict[str, object], id: str = "") -> ToolCallSpec:
    return ToolCallSpec(id=id, function=FunctionCall(name=name, arguments=json.dumps(args)))


def render(*messages: ChatMessage, **kw: object) -> str:
    return TEMPLATE.render(ChatPrompt(messages=messages, **kw)).text  # type: ignore[arg-type]


# ---------------------------------------------------------------- the template


def test_tiny_checkpoint_ships_the_template(tmp_path: Path) -> None:
    from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm

    model_dir = make_tiny_glm(tmp_path / "glm", num_hidden_layers=2, vocab_size=256)
    assert read_chat_template(model_dir) == CHAT_TEMPLATE
    template = spec_for("glm4_moe_lite").chat_template(model_dir)
    assert template.render(ChatPrompt(messages=(msg("user", "hi"),))).text == (
        "[gMASK]<sop><|user|>hi<|assistant|></think>"
    )


def test_system_and_thinking_on_and_off() -> None:
    convo = (msg("system", "Be brief."), msg("user", "Hi"))
    assert render(*convo) == "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|></think>"
    assert render(*convo, thinking=True) == "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|><think>"
    developer = render(msg("developer", "D"), msg("user", [TextPart("a")]))  # type: ignore[arg-type]
    assert developer == "[gMASK]<sop><|system|>D<|user|>a<|assistant|></think>"


def test_reasoning_kept_only_after_the_last_user_message() -> None:
    convo = (
        msg("user", "1+1?"),
        msg("assistant", "2", reasoning_content="easy"),
        msg("user", "and 2+2?"),
    )
    assert render(*convo, thinking=True) == (
        "[gMASK]<sop><|user|>1+1?<|assistant|></think>2<|user|>and 2+2?<|assistant|><think>"
    )


def test_chat_template_kwargs_set_thinking_and_template_variables() -> None:
    """vLLM's `chat_template_kwargs`: `enable_thinking` / `thinking` set the mode, other keys are the
    template's variables (`clear_thinking: false`: every earlier turn keeps its reasoning)."""
    convo = (
        msg("user", "1+1?"),
        msg("assistant", "2", reasoning_content="easy"),
        msg("user", "and 2+2?"),
    )

    def rendered(thinking: bool, kwargs: dict[str, object]) -> str:
        return TEMPLATE.render(prompt_of(convo, (), "none", thinking, None, kwargs)).text

    assert rendered(False, {"enable_thinking": True, "clear_thinking": False}) == (
        "[gMASK]<sop><|user|>1+1?<|assistant|><think>easy</think>2<|user|>and 2+2?<|assistant|><think>"
    )
    assert rendered(True, {"thinking": False}) == (
        "[gMASK]<sop><|user|>1+1?<|assistant|></think>2<|user|>and 2+2?<|assistant|></think>"
    )
    with pytest.raises(ChatError, match=r"chat_template_kwargs\.enable_thinking: expected true or false"):
        rendered(False, {"enable_thinking": "yes"})
    with pytest.raises(ChatError, match=r"chat_template_kwargs\.messages: set by the request itself"):
        rendered(False, {"messages": []})


def test_tools_tool_calls_and_results() -> None:
    convo = (
        msg("system", "S"),
        msg("user", "Paris and Oslo?"),
        msg(
            "assistant",
            "Checking.",
            reasoning_content="\nlook both up\n",
            tool_calls=[
                call("get_weather", {"city": "Paris", "days": 3}, "c1"),
                call("get_weather", {"city": "Oslo 你好", "opts": {"u": ["c"]}}, "c2"),
            ],
        ),
        msg("tool", "sunny", tool_call_id="c1"),
        msg("tool", "snow", tool_call_id="c2"),
    )
    turn = (
        "<|assistant|><think>look both up</think>Checking."
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo 你好</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"u": ["c"]}</arg_value></tool_call>'
        "<|observation|><tool_response>sunny</tool_response><tool_response>snow</tool_response>"
    )
    head = "[gMASK]<sop>" + TOOLS_BLOCK + "<|system|>S<|user|>Paris and Oslo?"
    for thinking, gen in ((True, "<think>"), (False, "</think>")):
        out = TEMPLATE.render(ChatPrompt(messages=convo, tools=(WEATHER,), thinking=thinking))
        assert out.text == head + turn + "<|assistant|>" + gen
        assert out.thinking is thinking and out.prefill == "" and out.tools == (WEATHER,)
    none = render(*convo[:2], tools=(WEATHER,), tool_choice="none")
    assert none == "[gMASK]<sop><|system|>S<|user|>Paris and Oslo?<|assistant|></think>"


def test_forced_tool_choice_ends_the_prompt_inside_a_call() -> None:
    named = NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))
    user = (msg("user", "Oslo?"),)
    off = TEMPLATE.render(ChatPrompt(messages=user, tools=(WEATHER,), tool_choice=named))
    assert off.text.endswith("<|assistant|></think><tool_call>get_weather")
    assert off.prefill == "<tool_call>get_weather"
    on = TEMPLATE.render(ChatPrompt(messages=user, tools=(WEATHER,), tool_choice="required", thinking=True))
    assert on.text.endswith("<|assistant|><think></think><tool_call>") and on.thinking
    parser, prefilled = TEMPLATE.parser(off)
    rest = "<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    parsed = collect([*prefilled, *parser.feed(rest), *parser.finish()])
    assert parsed == ParsedOutput("", "", (ToolCall("get_weather", '{"city": "Oslo"}'),))


def test_errors_are_chat_errors_naming_the_cause(tmp_path: Path) -> None:
    user = (msg("user", "x"),)
    cases: list[tuple[GlmTemplate, ChatPrompt, str]] = [
        (TEMPLATE, ChatPrompt(messages=()), "messages"),
        (TEMPLATE, ChatPrompt(messages=user, tool_choice="required"), "tool_choice"),
        (
            TEMPLATE,
            ChatPrompt(
                messages=(
                    msg("user", "x"),
                    msg(
                        "assistant",
                        tool_calls=[ToolCallSpec(function=FunctionCall(name="f", arguments="[1]"))],
                    ),
                    msg("user", "y"),
                ),
            ),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            GlmTemplate(None, tmp_path / "ckpt"),
            ChatPrompt(messages=user),
            "the checkpoint 'ckpt' has no chat template",
        ),
        (
            GlmTemplate("{{ raise_exception('only users here') }}", tmp_path),
            ChatPrompt(messages=user),
            "the chat",
        ),
        (GlmTemplate("{% if %}", tmp_path), ChatPrompt(messages=user), "the chat template"),
    ]
    for template, prompt, start in cases:
        with pytest.raises(ChatError) as err:
            template.render(prompt)
        assert str(err.value).startswith(start), err.value


def test_template_found_in_the_tokenizer_config(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "A{{ messages[0].content }}"}))
    assert read_chat_template(tmp_path) == "A{{ messages[0].content }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert read_chat_template(tmp_path) == "D"
    config.write_text(json.dumps({"bos_token": "x"}))
    assert read_chat_template(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"


# ---------------------------------------------------------------- the parser


def parse(text: str, thinking: bool = False, pieces: list[str] | None = None) -> ParsedOutput:
    parser = GlmParser(thinking, STRINGS)
    deltas = [d for piece in (pieces or [text]) for d in parser.feed(piece)] + parser.finish()
    return collect(deltas)


def test_reasoning_content_and_calls_with_typed_arguments() -> None:
    text = (
        "I should look it up.</think>Checking.\n"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>\n"
        '<tool_call>other\n<arg_key>a</arg_key>\n<arg_value>[1, "x"]</arg_value>\n'
        "<arg_key> b </arg_key><arg_value>not json</arg_value><arg_key>c</arg_key><arg_value>NaN</arg_value>"
        "<arg_key>d</arg_key><arg_value>null</arg_value></tool_call>"
    )
    out = parse(text, thinking=True)
    assert out.reasoning == "I should look it up." and out.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "42", "days": 3}),  # `city` is a string in the schema; `days` is not
        ("other", {"a": [1, "x"], "b": "not json", "c": "NaN", "d": None}),
    ]
    assert parse("Hello <b>world</b>  ") == ParsedOutput("", "Hello <b>world</b>  ", ())
    assert parse("<tool_call>f</tool_call> ok") == ParsedOutput("", "ok", (ToolCall("f", "{}"),))


def test_malformed_output() -> None:
    """A call whose name never completes, is empty or holds markup is content, verbatim; a started
    call keeps what it has when cut short (by the end or another call), leaves out a key without a
    value and drops text between its pairs; stray tags in text are dropped."""
    assert parse("Let me see.\n<tool_call>get_wea") == ParsedOutput("", "Let me see.\n<tool_call>get_wea", ())
    unclosed = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"
    assert parse("Let me see.\n" + unclosed) == ParsedOutput(
        "", "Let me see.", (ToolCall("get_weather", '{"city": "Par"}'),)
    )
    assert parse("thinking <tool_call>f", thinking=True) == ParsedOutput("thinking ", "<tool_call>f", ())
    stray = "<tool_call>f<arg_key>k</arg_key>stray<arg_key>n</arg_key><arg_value>1</arg_value>x</tool_call>"
    assert parse("a " + stray + " b") == ParsedOutput("", "ab", (ToolCall("f", '{"n": 1}'),))
    assert parse("<tool_call></tool_call>x") == ParsedOutput("", "<tool_call></tool_call>x", ())
    assert parse("<tool_call>f</arg_value>g</tool_call>") == ParsedOutput("", "<tool_call>f</arg_value>g", ())
    cut = parse("<tool_call>f<arg_key>k <tool_call>g<arg_key>v</arg_key><arg_value>[1</tool_call>")
    assert cut == ParsedOutput("", "", (ToolCall("f", "{}"), ToolCall("g", '{"v": "[1"}')))
    assert parse("a</think>b<think>c</tool_call>d") == ParsedOutput("", "abcd", ())
    assert parse("r<think>s</think>t", thinking=True) == ParsedOutput("rs", "t", ())
    deep = "[" * 100_000
    assert parse(
        f"<tool_call>f<arg_key>k</arg_key><arg_value>{deep}</arg_value></tool_call>"
    ) == ParsedOutput("", "", (ToolCall("f", json.dumps({"k": deep})),))


def test_arguments_stream_as_they_are_generated() -> None:
    """A call starts once its name is complete; a string value streams piece by piece (escaped), any
    other value comes out at its `</arg_value>`; the call's `}` at its end."""
    parser = GlmParser(False, STRINGS)
    fed = [
        parser.feed(piece)
        for piece in ["<tool_call>get_wea", "ther<arg_key>ci", 'ty</arg_key><arg_value>Pa"', "ris",
                      "</arg_value><arg_key>days</arg_key><arg_value>1", "4</arg_value>", "</tool_call>"]
    ]  # fmt: skip
    assert fed[0] == []
    assert fed[1] == [ToolCallStart(0, "get_weather"), ToolArguments(0, "{")]
    assert fed[2] == [ToolArguments(0, '"city": "'), ToolArguments(0, 'Pa\\"')]
    assert fed[3] == [ToolArguments(0, "ris")]
    assert fed[4] == [ToolArguments(0, '"'), ToolArguments(0, ', "days": ')]  # the int waits for its end
    assert fed[5] == [ToolArguments(0, "14")]
    assert fed[6] == [ToolArguments(0, "}")]
    assert json.loads("".join(d.text for f in fed for d in f if isinstance(d, ToolArguments))) == {
        "city": 'Pa"ris',
        "days": 14,
    }


# outputs the model would write: the tiny template's assistant turn, after the generation prompt
FRAGMENT = st.sampled_from(
    ["a", "b", " ", "\n", "<", "</", "<t", "<too", "<thi", "<arg_", ">", '"', "{", "1", "你"]
)
TEXT = st.lists(FRAGMENT, max_size=16).map("".join)
KEY = st.text(st.sampled_from(list("abcxyz_09")), min_size=1, max_size=6)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000),
    lambda inner: st.lists(inner | TEXT, max_size=3) | st.dictionaries(KEY, inner | TEXT, max_size=3),
    max_leaves=6,
)
CALLS = st.lists(
    st.tuples(
        st.sampled_from(["get_weather", "f", "g_2"]), st.dictionaries(KEY, JSON_VALUE, max_size=3), TEXT
    ),
    max_size=3,
)


def call_text(name: str, args: dict[str, object], city: str) -> str:
    pairs = {**args, "city": city} if name == "get_weather" else args
    values = {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in pairs.items()}
    return (
        f"<tool_call>{name}"
        + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in values.items())
        + "</tool_call>"
    )


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def texts(deltas: list[Delta]) -> list[str]:
    return [d.text for d in deltas if isinstance(d, Content | Reasoning)]


@HYPOTHESIS
@given(st.booleans(), TEXT, TEXT, CALLS, st.lists(st.integers(0, 300), max_size=30))
def test_random_splits_parse_to_the_written_calls(
    thinking: bool,
    reasoning: str,
    content: str,
    calls: list[tuple[str, dict[str, object], str]],
    cuts: list[int],
) -> None:
    text = (reasoning + "</think>" if thinking else "") + content + "\n".join(call_text(*c) for c in calls)
    parser = GlmParser(thinking, STRINGS)
    deltas = [d for piece in split(text, cuts) for d in parser.feed(piece)] + parser.finish()
    out = collect(deltas)
    assert out == parse(text, thinking)
    assert out.reasoning == (reasoning if thinking else "")
    assert out.content == (content.rstrip() if calls else content)
    expected = [(n, {**a, "city": c.strip()} if n == "get_weather" else a) for n, a, c in calls]
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == expected
    assert not any(m in t for t in texts(deltas) for m in MARKERS)


@HYPOTHESIS
@given(st.booleans(), TEXT, CALLS, st.integers(0, 300), st.lists(st.integers(0, 300), max_size=20))
def test_any_prefix_in_any_split_parses_alike_and_never_raises(
    thinking: bool, content: str, calls: list[tuple[str, dict[str, object], str]], end: int, cuts: list[int]
) -> None:
    text = ("r</think>" if thinking else "") + content + "".join(call_text(*c) for c in calls)
    text = text[:end]
    assert parse(text, thinking, split(text, cuts)) == parse(text, thinking)
