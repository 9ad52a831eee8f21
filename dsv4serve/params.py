"""The embedded API's values, `SamplingParams` and `Completion`: their validation, and their mapping
to and from protocol messages.

Plain Python (no torch, no trio): `api` re-exports these names, and the command line uses them freely.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeGuard

from dsv4serve import protocol
from dsv4serve.protocol import FinishReason, RequestError

Prompt: TypeAlias = str | Sequence[int]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request; bad values raise ValueError naming the field.

    temperature 0 = greedy; top_k 0 = off; seed None = derived from the engine seed and the request id.
    `stop` strings end the request and are cut from the text (a single string is one stop string).
    `top_logprobs` n > 0 (with `logprobs`) also reports each position's n most likely tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        n, t, p, k = self.max_tokens, self.temperature, self.top_p, self.top_k
        _check("max_tokens", _is_int(n) and n >= 1, "an int >= 1", n)
        _check("temperature", _is_number(t) and t >= 0, "a number >= 0", t)
        _check("top_p", _is_number(p) and 0 < p <= 1, "a number in (0, 1]", p)
        _check("top_k", _is_int(k) and k >= 0, "an int >= 0 (0 = off)", k)
        _check("seed", self.seed is None or _is_int(self.seed), "an int or None", self.seed)
        _check("logprobs", isinstance(self.logprobs, bool), "a bool", self.logprobs)
        top, most = self.top_logprobs, protocol.MAX_TOP_LOGPROBS
        _check("top_logprobs", _is_int(top) and 0 <= top <= most, f"an int in [0, {most}]", top)
        if top and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=True (0 without it)")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        ok = _is_list(stop) and all(
            isinstance(s, str) and 0 < len(s) <= protocol.MAX_STOP_CHARS for s in stop
        )
        ok = ok and len(stop) <= protocol.MAX_STOP_STRINGS
        stops = f"at most {protocol.MAX_STOP_STRINGS} non-empty strings of <= {protocol.MAX_STOP_CHARS} chars"
        _check("stop", ok, stops, self.stop)
        ids = self.stop_token_ids
        ok = _is_token_ids(ids, empty_ok=True) and len(ids) <= protocol.MAX_STOP_TOKEN_IDS
        _check("stop_token_ids", ok, f"at most {protocol.MAX_STOP_TOKEN_IDS} token ids (ints >= 0)", ids)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))


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


def _check(name: str, ok: bool, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {_short(value)}")


def _short(value: object, limit: int = 60) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_list(value: object) -> TypeGuard[Sequence[object]]:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _is_token_ids(value: object, empty_ok: bool) -> TypeGuard[Sequence[int]]:
    return _is_list(value) and (empty_ok or len(value) > 0) and all(_is_int(t) and t >= 0 for t in value)


def prompt_list(prompts: Prompts) -> list[Prompt]:
    """A list of prompts (a bare string is one prompt); each a string or a non-empty list of ids."""
    items = [prompts] if isinstance(prompts, str) else prompts
    _check("prompts", _is_list(items) and len(items) > 0, "a non-empty list of prompts", prompts)
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
        _check(f"params[{i}]", isinstance(p, SamplingParams), "a SamplingParams", p)
    return list(params)


def to_submit(rid: str, prompt: Prompt, params: SamplingParams, stream: bool) -> protocol.Submit:
    """The Submit of one API request; its DoneEvent will carry the prompt's token ids."""
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, tuple(prompt))
    spec = protocol.SamplingSpec(
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=params.top_k,
        seed=params.seed,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
    )
    return protocol.Submit(
        rid=rid,
        prompt=text,
        prompt_token_ids=ids,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        stream=stream,
        sampling=spec,
        echo_prompt=True,
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
