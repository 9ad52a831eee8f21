"""Every message of dsv4serve: public stdio requests/events and internal actor messages.

All messages are frozen, tagged `msgspec.Struct`s carrying plain data only (ints, strings, bytes,
tuples, nested Structs) so that each can be logged, encoded (JSON or msgpack) and sent across a
process boundary.
"""

from __future__ import annotations

import json
import math
import re
from array import array
from typing import Annotated, Literal, TypeAlias, TypeGuard, get_args

import msgspec

SLOT_DTYPE = "i"  # packed slot ids: native int32 (little-endian on every supported host)


def pack_slots(slots: object) -> bytes:
    """Pack an iterable of slot ids (ints, an `array('i')`, or a 1-D int32 tensor's list) into bytes."""
    if isinstance(slots, array) and slots.typecode == SLOT_DTYPE:
        return slots.tobytes()
    return array(SLOT_DTYPE, slots).tobytes()  # type: ignore[call-overload]


def unpack_slots(data: bytes) -> array:
    out = array(SLOT_DTYPE)
    out.frombytes(data)
    return out


# ---------------------------------------------------------------- internal: allocator -> kv_writer


class CacheLocs(msgspec.Struct, frozen=True, tag="cache_locs", kw_only=True):
    """The allocator's slots for one request in one step: one packed int32 field per pool.

    `pools` names every pool of the model's KV layout (`layout.py`), in layout order, and `packed`
    holds each one's slot ids (`pack_slots` / `unpack_slots`), empty when the step adds none there.
    The request goes from `prefix_len` to `seq_len` cached tokens in this step; a pool's slots are in
    index order, by the pool's kind:
      raw         one slot per raw position in [prefix_len, seq_len)
      compressed  one slot per compressed index in [prefix_len // r, seq_len // r), r = its ratio
      state       one slot per raw position in [seq_len - n, seq_len), n = the pool's count
    DeepSeek-V4's layout is full, swa (raw), c4, c128 (compressed), c4_state, c128_state (state).
    """

    step: int
    rid: str
    row: int  # the request's row in the per-request tables
    prefix_len: int
    seq_len: int
    pools: tuple[str, ...] = ()  # the allocator passes its layout's one tuple of names
    packed: tuple[bytes, ...] = ()  # packed[i]: the slots of pools[i] (same length: the writer checks)

    def packed_of(self, pool: str) -> bytes:
        """The packed slots of the pool named `pool` (KeyError if the message has no such pool)."""
        try:
            return self.packed[self.pools.index(pool)]
        except ValueError:
            raise KeyError(f"no pool {pool!r} in {self.pools}") from None

    def slots(self, pool: str) -> array:
        """The slot ids of one pool, by name."""
        return unpack_slots(self.packed_of(pool))

    def count(self, pool: str) -> int:
        return len(self.packed_of(pool)) // 4


# ---------------------------------------------------------------- public: stdio JSON-lines requests

ErrorCode: TypeAlias = Literal[
    "invalid_request", "duplicate_id", "context_too_long", "overloaded", "internal", "unknown_id"
]
FinishReason: TypeAlias = Literal["stop", "length", "cancelled"]
# Limits on one request (the stdio line itself is bounded in `stdio.MAX_LINE_BYTES`); every cost of a
# request is linear in its size, and these bound the parts that would otherwise cost per token.
MAX_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20  # most likely tokens reported per generated token
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_GRAMMAR_CHARS = 1 << 20  # a structured output's JSON schema or structural tag, as text
TOP_NEEDS_LOGPROBS = "top_logprobs: needs logprobs true (0 without it)"
MAX_INT = 2**63 - 1  # integer fields; a top_k at or above the vocabulary size means "off"
MIN_SEED, MAX_SEED = -(2**63), MAX_INT

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]


# ---------------------------------------------------------------- sampling: one declaration, one validation


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling fields every front door's wire format spells the same way (the embedded API, the
    stdio `generate` request, OpenAI's bodies: each inherits them). A bad value raises ValueError
    naming the field, on construction and on decoding (msgspec reports it as a validation error)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off; a top_k at or above the vocabulary size is off too
    seed: int | None = None  # None: derived from the engine seed and the request id
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # the model's EOS ids do not end the request (stop_token_ids still do)
    # logit processing, in this order (vLLM's meanings): logit_bias added; repetition_penalty on every
    # token of the prompt and output (a positive logit divided by it, a negative one multiplied);
    # frequency / presence penalties subtracted per output occurrence / once per token that occurred;
    # until min_tokens tokens are out, EOS and stop_token_ids cannot be sampled. Logprobs stay the
    # model's own.
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]

    @property
    def processes_logits(self) -> bool:
        """Whether sampling rewrites this request's logits first (any of the fields above is on)."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def __post_init__(self) -> None:
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        check_value("ignore_eos", isinstance(self.ignore_eos, bool), "a bool", self.ignore_eos)
        n = self.min_tokens
        check_value("min_tokens", is_int(n) and 0 <= n <= MAX_INT, "an int in [0, 2**63)", n)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check_value(name, is_number(v) and -2 <= v <= 2, "a number in [-2, 2]", v)
        r = self.repetition_penalty
        check_value("repetition_penalty", is_number(r) and 0 < r <= 10, "a number in (0, 10]", r)
        bias = self.logit_bias
        ok = bias is None or isinstance(bias, dict)
        check_value("logit_bias", ok, "an object of token id -> bias", bias)
        if bias is not None and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: expected at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for key, value in (bias or {}).items():
            check_value(f"logit_bias[{key!r}]", is_int(key) and 0 <= key <= MAX_INT, "a token id key", key)
            ok = is_number(value) and -100 <= value <= 100
            check_value(f"logit_bias[{key}]", ok, "a number in [-100, 100]", value)
        check_value("temperature", is_number(t) and t >= 0, "a number >= 0", t)
        check_value("top_p", is_number(p) and 0 < p <= 1, "a number in (0, 1]", p)
        check_value("top_k", is_int(k) and 0 <= k <= MAX_INT, "an int in [0, 2**63) (0 = off)", k)
        ok = seed is None or (is_int(seed) and MIN_SEED <= seed <= MAX_SEED)
        check_value("seed", ok, "an int in [-2**63, 2**63) or null", seed)
        ids = _as_tuple(self, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        for i, tid in enumerate(ids):
            check_value(
                f"stop_token_ids[{i}]", is_int(tid) and 0 <= tid <= MAX_INT, "an int in [0, 2**63)", tid
            )


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Output constrained to a grammar (xgrammar's, compiled in the engine core): `kind` "json_schema"
    (`spec`: a JSON schema, as JSON text) or "structural_tag" (`spec`: an xgrammar structural tag, as
    JSON text: reasoning, then text and tool calls whose arguments follow their schemas). Its syntax
    is checked before the request runs (`dsv4serve.chat.grammar.check`)."""

    kind: Literal["json_schema", "structural_tag"]
    spec: str
    origin: str = "structured"  # the request's field it came from, named in its errors

    def __post_init__(self) -> None:
        ok = self.kind in ("json_schema", "structural_tag")
        check_value("structured.kind", ok, '"json_schema" or "structural_tag"', self.kind)
        ok = isinstance(self.spec, str) and 0 < len(self.spec) <= MAX_GRAMMAR_CHARS
        check_value("structured.spec", ok, f"JSON text of at most {MAX_GRAMMAR_CHARS} characters", self.spec)
        try:
            value = json.loads(self.spec)
        except ValueError:
            value = None
        check_value("structured.spec", isinstance(value, dict), "the JSON text of an object", self.spec)
        ok = isinstance(self.origin, str) and 0 < len(self.origin) <= 64
        check_value("structured.origin", ok, "a field name of at most 64 characters", self.origin)


class SamplingParams(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request: the one declaration the engine reads (every message of a request
    carries it). `stop` strings end the request and are cut from the text (a single string is one stop
    string); `top_logprobs` n > 0 (with `logprobs`) also reports each position's n most likely tokens."""

    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    structured: StructuredOutput | None = None  # grammar-constrained output (no lookahead decodes)

    @property
    def processes_logits(self) -> bool:
        return super().processes_logits or self.structured is not None

    def __post_init__(self) -> None:
        super().__post_init__()
        ok = self.structured is None or isinstance(self.structured, StructuredOutput)
        check_value("structured", ok, "a StructuredOutput or null", self.structured)
        if self.structured is not None and self.min_tokens:  # an ended grammar allows EOS only
            why = "not with structured output (the grammar decides where it ends)"
            raise ValueError(f"min_tokens: {why}, got {self.min_tokens}")
        n, top, most = self.max_tokens, self.top_logprobs, MAX_TOP_LOGPROBS
        check_value("max_tokens", is_int(n) and 1 <= n <= MAX_INT, "an int in [1, 2**63)", n)
        check_value("logprobs", isinstance(self.logprobs, bool), "a bool", self.logprobs)
        check_value("top_logprobs", is_int(top) and 0 <= top <= most, f"an int in [0, {most}]", top)
        if top and not self.logprobs:
            raise ValueError(TOP_NEEDS_LOGPROBS)
        if self.min_tokens > n:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({n})")
        if isinstance(self.stop, str):  # one stop string
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        for i, text in enumerate(_as_tuple(self, "stop", MAX_STOP_STRINGS)):
            ok = isinstance(text, str) and 0 < len(text) <= MAX_STOP_CHARS and _is_text(text)
            check_value(f"stop[{i}]", ok, f"a non-empty text of at most {MAX_STOP_CHARS} characters", text)

    @classmethod
    def of(cls, holder: SamplingParams) -> SamplingParams:
        """The sampling fields of a struct that inherits them (a stdio `generate` request)."""
        return cls(**{name: getattr(holder, name) for name in cls.__struct_fields__})


def check_value(name: str, ok: bool, expected: str, value: object) -> None:
    """A ValueError naming the field unless `ok`: `name: expected <expected>, got <value>`."""
    if not ok:
        shown = repr(value)
        raise ValueError(
            f"{name}: expected {expected}, got {shown if len(shown) <= 60 else shown[:57] + '...'}"
        )


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _as_tuple(struct: msgspec.Struct, name: str, most: int) -> tuple[object, ...]:
    """A sequence field as a tuple of at most `most` items (the API may pass a list; a ValueError
    naming the field otherwise)."""
    value = getattr(struct, name)
    if isinstance(value, list):
        value = tuple(value)
        msgspec.structs.force_setattr(struct, name, value)
    check_value(name, isinstance(value, tuple), "a list", value)
    if len(value) > most:
        raise ValueError(f"{name}: expected at most {most} items, got {len(value)}")
    return value


# ---------------------------------------------------------------- public: stdio JSON-lines requests


class _Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    pass


class Generate(SamplingParams, frozen=True, tag="generate", tag_field="type"):
    """Generate a completion for `prompt` (text) or `prompt_token_ids` (exactly one of them), sampled as
    its `SamplingParams` fields say."""

    id: RequestId
    prompt: str | None = None
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)] | None = None
    stream: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            got = "neither" if self.prompt is None else "both"
            raise ValueError(f"prompt: give exactly one of prompt / prompt_token_ids (got {got})")
        super().__post_init__()


class Cancel(_Request, frozen=True, tag="cancel"):
    id: RequestId


class Stats(_Request, frozen=True, tag="stats"):
    pass


class Shutdown(_Request, frozen=True, tag="shutdown"):
    pass


Request: TypeAlias = Generate | Cancel | Stats | Shutdown
REQUEST_TYPES: tuple[str, ...] = tuple(str(t.__struct_config__.tag) for t in get_args(Request))


# ---------------------------------------------------------------- public: stdio JSON-lines events


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int


class Timing(msgspec.Struct, frozen=True, kw_only=True):
    ttft_ms: float  # arrival -> first generated token
    total_ms: float  # arrival -> done


class PoolStat(msgspec.Struct, frozen=True, kw_only=True):
    used: int  # slots
    capacity: int


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One of the most likely tokens at a position, encoded as `[token_id, logprob]`."""

    token_id: int
    logprob: float


TopLogprobs: TypeAlias = tuple[TopLogprob, ...]  # one position's, most likely first (ties: lowest id)


class TokenEvent(_Event, frozen=True, tag="token", omit_defaults=True):
    """A streamed delta: the new token ids and the text they completed (may be "")."""

    id: str
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int | None = None  # on a request's first token event: its prompt's length


class DoneEvent(_Event, frozen=True, tag="done", omit_defaults=True):
    """The end of an accepted request: all generated ids and text (stop strings cut off)."""

    id: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    text: str
    usage: Usage
    timing: Timing
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None  # one per token id, when top_logprobs > 0
    prompt_token_ids: tuple[int, ...] | None = None  # only when the Submit asked (echo_prompt)


class ErrorEvent(_Event, frozen=True, tag="error"):
    id: str | None  # None when the request's id could not be read
    code: ErrorCode
    message: str


class StatsEvent(_Event, frozen=True, tag="stats"):
    running: int
    waiting: int
    pools: dict[str, PoolStat]
    tokens_per_s: float
    num_steps: int = 0
    num_finished: int = 0
    num_preemptions: int = 0
    uptime_s: float = 0.0
    weight_bytes: dict[str, int] = msgspec.field(default_factory=dict)  # resident, by weight format
    finished_by_reason: dict[str, int] = msgspec.field(default_factory=dict)  # cancelled, error included
    num_generated: int = 0  # tokens sampled, whoever read them (cancelled requests' too)


Event: TypeAlias = TokenEvent | DoneEvent | ErrorEvent | StatsEvent


class RequestError(Exception):
    """A request that cannot be accepted; `message` names the field and the reason."""

    def __init__(self, code: ErrorCode, message: str, id: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.id = id

    def to_event(self) -> ErrorEvent:
        return ErrorEvent(id=self.id, code=self.code, message=self.message)


_REQUEST_DECODER = msgspec.json.Decoder(Request)
_EVENT_DECODER = msgspec.json.Decoder(Event)
_JSON_ENCODER = msgspec.json.Encoder()


def decode_request(line: bytes | str) -> Request:
    """Decode one stdio line; raises `RequestError("invalid_request", ...)` for anything malformed."""
    try:
        return _REQUEST_DECODER.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeEncodeError, RecursionError) as err:
        raise _diagnose(line, err) from None


def encode_event(event: Event) -> bytes:
    """One JSON line, newline-terminated (JSON escapes any newline inside strings)."""
    return _JSON_ENCODER.encode(event) + b"\n"


def decode_event(line: bytes | str) -> Event:
    return _EVENT_DECODER.decode(line)


def check_text(name: str, text: str) -> None:
    """Raise ValueError naming `name` if `text` is not valid Unicode (a lone surrogate)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        raise ValueError(
            f"{name}: not valid Unicode text (lone surrogate {char!r} at index {exc.start})"
        ) from None


def check_submit(req: Submit, vocab_size: int) -> None:
    """The checks every front door's requests pass before the engine accepts them (RequestError); its
    sampling parameters checked themselves when they were made."""

    def bad(message: str) -> RequestError:
        return RequestError("invalid_request", message, req.rid if _is_id(req.rid) else None)

    if not _is_id(req.rid):
        raise bad(f"id: must be a non-empty string of at most {MAX_ID_CHARS} characters")
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise bad("prompt: give exactly one of prompt / prompt_token_ids")
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        if not ids:
            raise bad("prompt_token_ids: must not be empty")
        if min(ids) < 0 or max(ids) >= vocab_size:  # C-speed scans; the index only on the slow path
            i, tid = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
            raise bad(f"prompt_token_ids[{i}]: {tid} is outside the vocabulary [0, {vocab_size})")
    outside = [t for t in req.params.logit_bias or () if t >= vocab_size]
    if outside:
        raise bad(f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")


def _is_id(rid: object) -> bool:
    return isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS


# ---------------------------------------------------------------- request diagnostics (slow path only)

_AT_PATH = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_ABSENT = object()
_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])  # each field's value left undecoded
TOO_DEEP = "request: JSON nested too deeply"


def _diagnose(line: bytes | str, err: Exception) -> RequestError:
    """Explain why `line` is not a request. Fields are decoded one at a time, so a value that cannot
    be decoded (a number out of range) still leaves the id readable."""
    data = line.encode("utf-8", errors="surrogatepass") if isinstance(line, str) else line
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        rid = _recover_id(data.decode("utf-8", errors="replace"))
        reason = f"request is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        return RequestError("invalid_request", reason, rid)
    try:
        fields = _TOP_LEVEL.decode(data)
    except RecursionError:
        return RequestError("invalid_request", TOO_DEEP)
    except msgspec.ValidationError:
        return RequestError("invalid_request", "request must be a JSON object")
    except msgspec.DecodeError as exc:
        return _nonstandard(data, exc)
    return RequestError("invalid_request", _explain(fields, err), _id_of(fields))


def _id_of(fields: dict[str, msgspec.Raw]) -> str | None:
    rid = _loads(fields["id"]) if "id" in fields else None
    return rid if isinstance(rid, str) and _is_id(rid) else None


def _loads(raw: msgspec.Raw) -> object:
    """One field's value, or _ABSENT when it cannot be decoded (a number out of range, deep nesting)."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _ABSENT


def _recover_id(text: str) -> str | None:
    try:
        fields = _TOP_LEVEL.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return _id_of(fields)


def _nonstandard(data: bytes, exc: msgspec.DecodeError) -> RequestError:
    """JSON that msgspec refuses but Python's json reads (NaN, Infinity, lone surrogate escapes): name
    the field that holds it, and keep the id."""
    try:
        obj = json.loads(data)
    except RecursionError:
        return RequestError("invalid_request", TOO_DEEP)
    except ValueError:
        return RequestError("invalid_request", f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return RequestError("invalid_request", "request must be a JSON object")
    rid = obj.get("id")
    rid = rid if isinstance(rid, str) and _is_id(rid) and _is_text(rid) else None
    for name, value in obj.items():
        if (why := _nonstandard_value(value)) is not None:
            return RequestError("invalid_request", f"{name}: {why}", rid)
    return RequestError("invalid_request", f"invalid JSON: {exc}", rid)


def _nonstandard_value(value: object, depth: int = 0) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"expected a finite number, got {value}"
    if isinstance(value, str) and not _is_text(value):
        return "not valid Unicode text (a lone surrogate)"
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    if depth > 64:
        return None
    return next((w for v in children if (w := _nonstandard_value(v, depth + 1)) is not None), None)


def _is_text(text: str) -> bool:
    try:
        check_text("text", text)
    except ValueError:
        return False
    return True


def _explain(fields: dict[str, msgspec.Raw], err: Exception) -> str:
    """Turn msgspec's "<reason> - at `$.path`" into "path: <reason>, got <value>"."""
    if isinstance(err, RecursionError):
        return TOO_DEEP
    if "type" not in fields:
        return "type: required"
    kind = _loads(fields["type"])
    if kind not in REQUEST_TYPES:
        return f"type: unknown request type {kind!r}" if kind is not _ABSENT else "type: unknown request type"
    found = _AT_PATH.match(str(err))
    reason, path = (found["msg"], found["path"]) if found else (str(err), "")
    if named := _MISSING_FIELD.match(reason) or _UNKNOWN_FIELD.match(reason):
        what = "required" if named.re is _MISSING_FIELD else f"unknown field of a {kind!r} request"
        return f"{_join(path, named['name'])}: {what}"
    if not path:
        return reason
    value = _value_at(fields, path)
    if value is not _ABSENT and "got" not in reason:
        reason = f"{reason}, got {_show(value)}"
    return f"{path.removeprefix('.')}: {reason}"


def _join(path: str, name: str) -> str:
    return f"{path.removeprefix('.')}.{name}" if path else name


def _value_at(fields: dict[str, msgspec.Raw], path: str) -> object:
    parts = _PATH_PART.findall(path)
    if not parts or not parts[0][0] or parts[0][0] not in fields:
        return _ABSENT
    raw = fields[parts[0][0]]
    obj = _loads(raw)
    if obj is _ABSENT:  # the value itself cannot be decoded: show its text
        return _Verbatim(bytes(raw).decode("utf-8", errors="replace")) if len(parts) == 1 else _ABSENT
    for key, index in parts[1:]:
        if key and isinstance(obj, dict) and key in obj:
            obj = obj[key]
        elif index and isinstance(obj, list) and int(index) < len(obj):
            obj = obj[int(index)]
        else:
            return _ABSENT
    return obj


class _Verbatim(str):
    """A value shown as its JSON text."""


def _show(value: object, limit: int = 40) -> str:
    shown = str(value) if isinstance(value, _Verbatim) else msgspec.json.encode(value).decode()
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


# ---------------------------------------------------------------- internal: shared data


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    pass


class Drain(_Msg, frozen=True, tag="drain"):
    """Graceful shutdown: finish what is in flight, then close the downstream channels."""


LOOKAHEAD = -1  # the input id of a lookahead decode: the token its request's previous step samples


class StepItem(msgspec.Struct, frozen=True, kw_only=True):
    """One request's part of a step: the input ids of positions [prefix_len, prefix_len + len).

    A lookahead decode (token_ids == (LOOKAHEAD,)) is planned while its request's previous step is
    still in flight: its input is the token that step samples, which the executor takes on the device.
    """

    rid: str
    prefix_len: int
    token_ids: tuple[int, ...]
    sample: bool  # False for a prefill chunk that does not reach the prompt's end
    sampling: SamplingParams
    row: int = -1  # the request's row in the per-request tables; -1 until the allocator assigns it
    # a sampling item of a request that processes its logits, not a lookahead: every token id so far
    # (prompt then output) and the prompt's length, from which the executor rebuilds the row's counts
    history: tuple[int, ...] | None = None
    prompt_len: int = 0

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.token_ids)

    @property
    def is_lookahead(self) -> bool:
        return self.token_ids == (LOOKAHEAD,)


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    items: tuple[StepItem, ...]
    # with the experts spread over the data-parallel cores: every core's tokens this round, in core
    # order (set by the cores' lockstep; the MoE layers' gathers and reduce-scatters are sized by it)
    cores_tokens: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.items)


# ---------------------------------------------------------------- internal: tokenizer inbox


class Submit(_Msg, frozen=True, tag="submit"):
    """An accepted request, handed to the tokenizer (exactly one of prompt / prompt_token_ids)."""

    rid: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    params: SamplingParams = SamplingParams()
    stream: bool = False
    echo_prompt: bool = False  # put the prompt's token ids in the DoneEvent (the embedded API wants them)


class Detokenize(_Msg, frozen=True, tag="detokenize"):
    """New ids of one request; a non-None `finish_reason` ends it (the tokenizer emits `done`)."""

    rid: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[float, ...] | None = None  # one per id when the request asked for them
    top_logprobs: tuple[TopLogprobs, ...] | None = None  # one per id when it asked for top_logprobs
    num_preemptions: int = 0  # with a finish_reason: how often the request was preempted (for its log line)


class FailRequest(_Msg, frozen=True, tag="fail_request"):
    """End a request (or answer an unknown id) with an `error` event instead of `done`."""

    rid: str
    code: ErrorCode
    message: str


class CancelRequest(_Msg, frozen=True, tag="cancel_request"):
    """Cancel `rid`: handle -> tokenizer (keeps it behind the request's Submit) -> scheduler."""

    rid: str


class Outputs(_Msg, frozen=True, tag="outputs"):
    """Everything one scheduler report has for the tokenizer (each request's new ids, ends and
    failures, in order): one message a step, so a process boundary carries one frame a step."""

    items: tuple[Detokenize | FailRequest, ...]


TokenizerMsg: TypeAlias = Submit | Outputs | Detokenize | FailRequest | CancelRequest | Drain


def submit_of(req: Generate) -> Submit:
    token_ids = None if req.prompt_token_ids is None else tuple(req.prompt_token_ids)
    params = SamplingParams.of(req)
    return Submit(rid=req.id, prompt=req.prompt, prompt_token_ids=token_ids, params=params, stream=req.stream)


# ---------------------------------------------------------------- internal: scheduler inbox


class Tokenized(_Msg, frozen=True, tag="tokenized"):
    rid: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


class SampledToken(msgspec.Struct, frozen=True, kw_only=True):
    rid: str
    token_id: int
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None  # the request's top_logprobs most likely, when > 0


class RequestFailure(msgspec.Struct, frozen=True, kw_only=True):
    rid: str
    message: str


class StepDone(_Msg, frozen=True, tag="step_done"):
    """The executor finished `step`: sampled ids of the items with `sample`, the rids that ran."""

    step: int
    outputs: tuple[SampledToken, ...]
    ran: tuple[str, ...]
    failed: tuple[RequestFailure, ...] = ()


class RefusedItem(msgspec.Struct, frozen=True, kw_only=True):
    rid: str
    pool: str  # a pool of the model's KV layout, 'rows', or 'base' (a lookahead whose previous step
    # was refused)
    reason: str


class AllocRefused(_Msg, frozen=True, tag="alloc_refused"):
    step: int
    refusals: tuple[RefusedItem, ...]


class StopHit(_Msg, frozen=True, tag="stop_hit"):
    """The tokenizer found a stop string in `rid`'s output; the request is done."""

    rid: str


SchedulerMsg: TypeAlias = Tokenized | CancelRequest | StepDone | AllocRefused | StopHit | Drain


# ---------------------------------------------------------------- internal: the engine-core process boundary


class CoreStatus(_Msg, frozen=True, tag="core_status"):
    """The engine core's gauges and pool usage, sent with every frame it writes to the front process
    (and on its own while idle) so that `stats` there reads them without a round trip."""

    running: int
    waiting: int
    num_steps: int
    num_preemptions: int
    num_generated: int
    pools: dict[str, tuple[int, int]]  # name -> (used, capacity) slots


class CoreReady(_Msg, frozen=True, tag="core_ready"):
    """The engine core loaded its model and runs its actors (the first frame it writes)."""

    weight_bytes: dict[str, int]
    pid: int
    max_model_len: int  # with the KV's capacity, sized as the core loaded
    max_total_tokens: int


FrontToCore: TypeAlias = Tokenized | CancelRequest | StopHit | Drain  # the tokenizer's sends
CoreToFront: TypeAlias = CoreReady | Outputs | Drain | CoreStatus  # the scheduler's, and the core's own


# ---------------------------------------------------------------- internal: allocator, kv_writer, executor

FreeReason: TypeAlias = Literal["finished", "aborted", "preempted"]


class Allocate(_Msg, frozen=True, tag="allocate"):
    step: int
    plan: StepPlan


class Free(_Msg, frozen=True, tag="free"):
    rid: str
    reason: FreeReason


AllocatorMsg: TypeAlias = Allocate | Free | Drain


class WriteLocs(_Msg, frozen=True, tag="write_locs"):
    """The allocator's answer for a whole step: `plan` with rows filled, one `CacheLocs` per item."""

    step: int
    plan: StepPlan
    locs: tuple[CacheLocs, ...]
    pool_used: dict[str, int] = {}  # slots in use per pool after this step's grants (for the step's log line)


KVWriterMsg: TypeAlias = WriteLocs | Drain


class TablesReady(_Msg, frozen=True, tag="tables_ready"):
    step: int
    plan: StepPlan
    pool_used: dict[str, int] = {}
    error: str | None = None  # the tables could not be written: the step fails instead of running


ExecutorMsg: TypeAlias = TablesReady | Drain


# ---------------------------------------------------------------- internal: rank 0 to the other ranks
# Tensor parallelism: rank 0's table writes and step launches, in the order it makes them, to every
# other rank (executor/ranks.py), which replays them on its own share of the model.


class RankWriteLocs(_Msg, frozen=True, tag="rank_write_locs"):
    locs: tuple[CacheLocs, ...]


class RankLaunch(_Msg, frozen=True, tag="rank_launch"):
    plan: StepPlan
    all_logits: bool = False


class RankStop(_Msg, frozen=True, tag="rank_stop"):
    pass


RankMsg: TypeAlias = RankWriteLocs | RankLaunch | RankStop
