"""OpenAI's request and response bodies (the subset served), as msgspec Structs.

Requests are decoded strictly: unknown top-level fields and out-of-range values are refused with a
message naming the field. The sampling fields every door spells alike come from `SamplingFields`
(protocol.py: declared and checked once); those OpenAI spells its own way (`stop`, `max_tokens`,
`logprobs`) are mapped onto `SamplingParams` by the app. Responses encode with `omit_defaults`, so a
streamed delta carries only what changed.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from dsv4serve.chat.messages import ChatMessage, ToolChoice, ToolSpec
from dsv4serve.protocol import MAX_TOP_LOGPROBS, SamplingFields, TokenId

MAX_N = 16  # choices per request
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
StopText = Annotated[str, msgspec.Meta(min_length=1)]
Stop: TypeAlias = StopText | Annotated[list[StopText], msgspec.Meta(max_length=16)] | None
TokenPrompt = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
# a text, token ids, or a list of texts or of id lists (msgspec takes one array type: `prompts` checks)
Prompt: TypeAlias = str | Annotated[list[str | TokenId | TokenPrompt], msgspec.Meta(min_length=1)]
NumTop = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None  # None: any JSON object
    description: str | None = None
    strict: bool | None = None  # the output follows the schema either way


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # needed by (and only with) type json_schema

    def __post_init__(self) -> None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: needed with type json_schema, and only with it")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer follows (None: any JSON object); only for a JSON type."""
        return self.json_schema.schema if self.json_schema is not None else None


class _Sampling(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str
    n: N = 1
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    prompt: Prompt
    max_tokens: MaxTokens = 16
    logprobs: NumTop | None = None  # n: the chosen tokens' logprobs and the n most likely per position
    echo: bool = False  # each choice's text starts with its prompt's (not with logprobs: no prompt logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One prompt per item; raises BadBody for a list that mixes kinds."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [[p for p in prompt if isinstance(p, int)]]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            return [p for p in prompt if not isinstance(p, int)]
        raise BadBody("prompt: expected a text, token ids, or a list of texts or of token-id lists", "prompt")


class ChatRequest(_Sampling, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumTop | None = None  # needs logprobs: true
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    thinking: bool = False  # DeepSeek-V4's thinking mode (an extension: `extra_body={"thinking": True}`)
    reasoning_effort: Literal["high", "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's / SGLang's: thinking keys, template variables


# ---------------------------------------------------------------- responses


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None  # token text -> logprob, most likely first
    text_offset: list[int] = []


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str  # text_completion
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprobOut(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut] = []


class ChatLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    content: list[TokenLogprob]


class FunctionOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    index: int | None = None  # in stream deltas
    id: str | None = None
    type: str | None = None
    function: FunctionOut


class MessageOut(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    message: MessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatResponse(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str  # chat.completion
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    delta: MessageOut
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str  # chat.completion.chunk
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "dsv4serve"
    max_model_len: int = 0


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True):
    error: ErrorBody


# ---------------------------------------------------------------- decoding

_AT_PATH = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_CHECKED = re.compile(r"^(?P<name>[a-z_]+): ")
_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<name>[^`]*)`$")


class BadBody(ValueError):
    """A body that does not decode; `param` is the offending field's path when known."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatRequest)}


def decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return _DECODERS[kind].decode(body)
    except msgspec.ValidationError as err:
        raise _explain(str(err)) from err
    except msgspec.DecodeError as err:
        raise BadBody(f"invalid JSON: {err}", None) from err


def _explain(error: str) -> BadBody:
    """msgspec's "<reason> - at `$.path`" as "path: <reason>"."""
    found = _AT_PATH.match(error)
    reason, path = (found["msg"], found["path"].removeprefix(".")) if found else (error, "")
    if named := _FIELD.match(reason):
        what = "required" if "missing" in reason else "unknown field"
        param = f"{path}.{named['name']}" if path else named["name"]
        return BadBody(f"{param}: {what}", param)
    if not path and (checked := _CHECKED.match(reason)):  # a sampling field's own check names it
        return BadBody(reason, checked["name"])
    return BadBody(f"{path}: {reason}" if path else reason, path or None)
