"""`serve --http` on a tiny GLM-4.7-Flash checkpoint, driven by the official `openai` client: chat
prompts are rendered by the checkpoint's own template, and GLM's tool calls are parsed out of the
model's output (its logits forced to a script, `http_harness.ForcedRunner`, as in test_http.py).

The tiny checkpoint carries DeepSeek's tokenizer, so GLM's tags are plain text split over several
tokens: the parser meets them cut at token boundaries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from dsv4serve.chat.messages import ChatMessage, ChatPrompt, ToolSpec
from dsv4serve.config import EngineConfig
from dsv4serve.models.glm4_moe_lite.parser import MARKERS
from dsv4serve.models.glm4_moe_lite.tiny import make_tiny_glm
from dsv4serve.models.registry import spec_for
from tests.http_harness import ServedModel, collect_stream

ENGINE = EngineConfig(max_total_tokens=4096, max_num_seqs=8, max_num_batched_tokens=512)
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
CALL = (
    '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris <"x"></arg_value>'
    '<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>units</arg_key><arg_value>["c"]</arg_value>'
    "</tool_call>"
)
ARGS = {"city": 'Paris <"x">', "days": 3, "units": ["c"]}


def tiny_glm(path: Path, template: bool = True) -> Path:
    model_dir = make_tiny_glm(path, seed=3, num_hidden_layers=2)
    if not template:
        (model_dir / "chat_template.jinja").unlink()
    return model_dir


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_glm(tmp_path_factory.mktemp("glm"))


@pytest.fixture(scope="module")
def served(glm_dir: Path) -> Iterator[ServedModel]:
    model = ServedModel(glm_dir, ENGINE)
    yield model
    model.close()


@pytest.fixture
def client(served: ServedModel) -> Iterator[openai.OpenAI]:
    served.forced.script = None
    with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c
    served.forced.script = None


def test_prompt_is_the_checkpoints_template(
    glm_dir: Path, served: ServedModel, client: openai.OpenAI
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    served.forced.script = served.encode("It is sunny.")
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],
        max_tokens=20,
    )
    template = spec_for("glm4_moe_lite").chat_template(glm_dir)
    prompt = ChatPrompt(
        messages=tuple(msgspec.convert(m, ChatMessage) for m in messages),
        tools=(msgspec.convert(WEATHER, ToolSpec),),
    )
    text = template.render(prompt).text
    assert text.endswith("<|observation|><tool_response>sunny</tool_response><|assistant|></think>")
    assert reply.usage is not None and reply.usage.prompt_tokens == len(served.encode(text))
    assert reply.choices[0].message.content == "It is sunny." and reply.choices[0].finish_reason == "stop"


def test_chat_template_kwargs_reach_the_template(served: ServedModel, client: openai.OpenAI) -> None:
    """`clear_thinking: false` keeps an earlier turn's reasoning in the prompt the model reads."""
    served.forced.script = served.encode("Fine.")
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "easy"},
        {"role": "user", "content": "and 2+2?"},
    ]
    kwargs = {"enable_thinking": False, "clear_thinking": False}
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, extra_body={"chat_template_kwargs": kwargs}
    )  # type: ignore[arg-type]
    text = "[gMASK]<sop><|user|>1+1?<|assistant|><think>easy</think>2<|user|>and 2+2?<|assistant|></think>"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(served.encode(text))
    assert reply.choices[0].message.content == "Fine."


def test_streamed_tool_call_with_reasoning_equals_whole(served: ServedModel, client: openai.OpenAI) -> None:
    served.forced.script = served.encode("I should look it up.</think>Checking.\n" + CALL)
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "max_tokens": 200,
        "extra_body": {"thinking": True},
    }
    got = collect_stream(client.chat.completions.create(stream=True, **request))  # type: ignore[call-overload]
    assert "".join(got.reasoning) == "I should look it up." and "".join(got.content) == "Checking."
    assert got.names == ["get_weather"] and json.loads("".join(got.pieces)) == ARGS
    assert got.reasons[-1] == "tool_calls"
    assert not any(m in "".join(got.content + got.reasoning) for m in MARKERS)

    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    message = whole.choices[0].message
    assert (
        message.content == "Checking."
        and getattr(message, "reasoning_content", None) == "I should look it up."
    )
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == ARGS
    assert whole.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_and_an_unclosed_call(served: ServedModel, client: openai.OpenAI) -> None:
    served.forced.script = served.encode("<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>")
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    assert not reply.choices[0].message.content

    served.forced.script = served.encode(
        "Let me check. <tool_call>get_weather<arg_key>city</arg_key><arg_value>Os"
    )
    cut = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[WEATHER],
        max_tokens=100,
    )  # the output ends inside the call: it keeps what it has
    assert cut.choices[0].message.content == "Let me check."
    calls = cut.choices[0].message.tool_calls
    assert calls and json.loads(calls[0].function.arguments) == {"city": "Os"}  # type: ignore[union-attr]
    assert cut.choices[0].finish_reason == "tool_calls"

    served.forced.script = served.encode("Let me check. <tool_call>get_wea")
    named = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[WEATHER],
        max_tokens=100,
    )  # still naming itself at the end: text
    assert named.choices[0].message.content == "Let me check. <tool_call>get_wea"
    assert not named.choices[0].message.tool_calls and named.choices[0].finish_reason == "stop"


def test_checkpoint_without_a_template_refuses_chat_serves_completions(tmp_path: Path) -> None:
    model = ServedModel(tiny_glm(tmp_path / "bare", template=False), ENGINE)
    try:
        with openai.OpenAI(base_url=model.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            with pytest.raises(openai.BadRequestError, match="no chat template") as err:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            assert err.value.status_code == 400 and err.value.code == "invalid_request"
            text = client.completions.create(model="tiny", prompt="hi", max_tokens=4)
            assert text.choices[0].finish_reason in ("stop", "length")
    finally:
        model.close()
