"""The embedded API's values: prompts and `Completion`, their checks, and their mapping to and from
protocol messages (`SamplingParams` is protocol.py's: the one declaration every front door shares).

Plain Python (no torch, no trio): `api` re-exports these names, and the command line uses them freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeGuard

from dsv4serve import protocol
from dsv4serve.protocol import FinishReason, RequestError, SamplingParams, check_value, is_int

Prompt: TypeAlias = str | Sequence[int]


Prompts: TypeAlias = Prompt | Sequence[Prompt]  # a bare string is one prompt
Params: TypeAlias = SamplingParams | Sequence[SamplingParams] | None  # one for all, or one per prompt


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished request. `prompt_token_ids` are the ids the model saw (BOS included)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    prompt_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None  # one per token id, when asked
    top_logprobs: tuple[protocol.TopLogprobs, ...] | None = None  # one per token id, when asked


def _is_list(value: object) -> TypeGuard[Sequence[object]]:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _is_token_ids(value: object, empty_ok: bool) -> TypeGuard[Sequence[int]]:
    return _is_list(value) and (empty_ok or len(value) > 0) and all(is_int(t) and t >= 0 for t in value)


def prompt_list(prompts: Prompts) -> list[Prompt]:
    """A list of prompts (a bare string is one prompt); each a string or a non-empty list of ids."""
    items = [prompts] if isinstance(prompts, str) else prompts
    check_value("prompts", _is_list(items) and len(items) > 0, "a non-empty list of prompts", prompts)
    return [one_prompt(f"prompts[{i}]", prompt) for i, prompt in enumerate(items)]


def one_prompt(name: str, prompt: object) -> Prompt:
    """`prompt` checked: a string, or a non-empty list of token ids (copied)."""
    if isinstance(prompt, str):
        return prompt
    if _is_token_ids(prompt, empty_ok=False):
        return list(prompt)
    raise ValueError(f"{name}: expected a string or a non-empty list of token ids, got {prompt!r}")


def params_list(params: Params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: `params` repeated (None: the defaults), or checked per prompt."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"params: expected one SamplingParams per prompt ({n}), got {len(params)}")
    for i, p in enumerate(params):
        check_value(f"params[{i}]", isinstance(p, SamplingParams), "a SamplingParams", p)
    return list(params)


def to_submit(rid: str, prompt: Prompt, params: SamplingParams, stream: bool) -> protocol.Submit:
    """The Submit of one API request; its DoneEvent will carry the prompt's token ids."""
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
    return protocol.Submit(
        rid=rid, prompt=text, prompt_token_ids=ids, params=params, stream=stream, echo_prompt=True
    )


def to_completion(event: protocol.Event) -> Completion:
    """The Completion a request's last event (`done` or `error`) stands for; `error` raises RequestError."""
    match event:
        case protocol.DoneEvent():
            assert event.prompt_token_ids is not None, "every Submit asks for them"
            return Completion(
                token_ids=event.token_ids,
                text=event.text,
                finish_reason=event.finish_reason,
                prompt_token_ids=event.prompt_token_ids,
                logprobs=event.logprobs,
                top_logprobs=event.top_logprobs,
            )
        case protocol.ErrorEvent():
            raise RequestError(event.code, event.message, event.id)
        case _:
            raise AssertionError(f"unexpected event {event!r}")
