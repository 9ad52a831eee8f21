"""Messages: round trips through JSON and msgpack, and the stdio boundary's error messages."""

from __future__ import annotations

from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4serve import protocol as p

SAMPLING = p.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=123, logprobs=True, top_logprobs=2)
TOP = (p.TopLogprob(5, -0.25), p.TopLogprob(9, -1.5))
PLAN = p.StepPlan(
    step=7,
    items=(
        p.StepItem(rid="a", prefix_len=0, token_ids=(5, 6, 7, 8), sample=True, sampling=SAMPLING, row=0),
        p.StepItem(rid="b", prefix_len=1023, token_ids=(9,), sample=True, sampling=p.SamplingParams(), row=3),
        p.StepItem(rid="c", prefix_len=0, token_ids=(1, 2), sample=False, sampling=SAMPLING),
    ),
)


def make_locs(rid: str = "a", prefix_len: int = 0, seq_len: int = 9, row: int = 0) -> p.CacheLocs:
    page = 128 * 3  # a request living on page 3 of every pool
    return p.CacheLocs(
        step=7,
        rid=rid,
        row=row,
        prefix_len=prefix_len,
        seq_len=seq_len,
        pools=("full", "swa", "c4", "c128", "c4_state", "c128_state"),
        packed=(
            p.pack_slots(range(page + prefix_len, page + seq_len)),
            p.pack_slots(array("i", range(page + prefix_len, page + seq_len))),
            p.pack_slots(range(page + prefix_len // 4, page + seq_len // 4)),
            b"",
            p.pack_slots([page + 4, page + 5, page + 6, page + 7, page + 8]),
            p.pack_slots(range(page, page + seq_len)),
        ),
    )


USAGE = p.Usage(prompt_tokens=4, completion_tokens=2)
TIMING = p.Timing(ttft_ms=12.5, total_ms=40.0)

PUBLIC: list[tuple[Any, Any]] = [
    (p.Generate(id="r1", prompt="héllo\n", stop=["\n\n"], seed=3, stream=True, logprobs=True), p.Request),
    (p.Generate(id="r2", prompt_token_ids=[1, 2, 3], max_tokens=1, temperature=0.0, top_k=1), p.Request),
    (p.Cancel(id="r1"), p.Request),
    (p.Stats(), p.Request),
    (p.Shutdown(), p.Request),
    (p.TokenEvent(id="r1", token_ids=(5, 6), text="lo"), p.Event),
    (
        p.DoneEvent(id="r1", finish_reason="length", token_ids=(5,), text="x", usage=USAGE, timing=TIMING),
        p.Event,
    ),
    (
        p.DoneEvent(
            id="r2",
            finish_reason="cancelled",
            token_ids=(),
            text="",
            usage=USAGE,
            timing=TIMING,
            logprobs=(-0.5, -1.25),
            top_logprobs=(TOP, TOP[::-1]),
        ),
        p.Event,
    ),
    (p.ErrorEvent(id=None, code="invalid_request", message="id: required"), p.Event),
    (p.ErrorEvent(id="r3", code="overloaded", message="queue is full"), p.Event),
    (
        p.StatsEvent(
            running=2,
            waiting=1,
            pools={"full": p.PoolStat(used=10, capacity=64), "c4": p.PoolStat(used=0, capacity=16)},
            tokens_per_s=123.5,
            num_steps=9,
        ),
        p.Event,
    ),
]

INTERNAL: list[tuple[Any, Any]] = [
    (
        p.Submit(
            rid="r1", prompt="hi", prompt_token_ids=None, params=p.SamplingParams(max_tokens=4, stop=("x",))
        ),
        p.TokenizerMsg,
    ),
    (
        p.Submit(
            rid="r2",
            prompt=None,
            prompt_token_ids=(1, 2),
            params=p.SamplingParams(max_tokens=1, stop_token_ids=(2,)),
        ),
        p.TokenizerMsg,
    ),
    (p.Detokenize(rid="r1", token_ids=(5, 6)), p.TokenizerMsg),
    (
        p.Detokenize(rid="r1", token_ids=(7,), finish_reason="stop", logprobs=(-0.1,), top_logprobs=(TOP,)),
        p.TokenizerMsg,
    ),
    (p.FailRequest(rid="r9", code="unknown_id", message="id: no request 'r9'"), p.TokenizerMsg),
    (p.Drain(), p.TokenizerMsg),
    (
        p.Tokenized(rid="r1", prompt_token_ids=(1, 2), params=SAMPLING),
        p.SchedulerMsg,
    ),
    (p.CancelRequest(rid="r1"), p.SchedulerMsg),
    (
        p.StepDone(
            step=7,
            outputs=(
                p.SampledToken(rid="a", token_id=5, logprob=-0.25, top_logprobs=TOP),
                p.SampledToken(rid="b", token_id=0),
            ),
            ran=("a", "b", "c"),
            failed=(p.RequestFailure(rid="d", message="NaN logits"),),
        ),
        p.SchedulerMsg,
    ),
    (
        p.AllocRefused(step=7, refusals=(p.RefusedItem(rid="a", pool="c4", reason="pool full"),)),
        p.SchedulerMsg,
    ),
    (p.StopHit(rid="r1"), p.SchedulerMsg),
    (p.Drain(), p.SchedulerMsg),
    (p.Allocate(step=7, plan=PLAN), p.AllocatorMsg),
    (p.Free(rid="a", reason="preempted"), p.AllocatorMsg),
    (p.Drain(), p.AllocatorMsg),
    (p.WriteLocs(step=7, plan=PLAN, locs=(make_locs(), make_locs("b", 1023, 1024, 3))), p.KVWriterMsg),
    (p.Drain(), p.KVWriterMsg),
    (p.TablesReady(step=7, plan=PLAN), p.ExecutorMsg),
    (p.Drain(), p.ExecutorMsg),
    (make_locs(), p.CacheLocs),
    (
        p.Outputs(
            items=(
                p.Detokenize(rid="a", token_ids=(5,), logprobs=(-0.5,)),
                p.FailRequest(rid="b", code="internal", message="step failed"),
                p.Detokenize(rid="c", token_ids=(), finish_reason="cancelled"),
            )
        ),
        p.CoreToFront,
    ),
    (p.Tokenized(rid="r1", prompt_token_ids=(1, 2), params=SAMPLING), p.FrontToCore),
    (p.CoreReady(weight_bytes={"b": 10}, pid=7, max_model_len=64, max_total_tokens=128), p.CoreToFront),
    (p.RankWriteLocs(locs=(make_locs(),)), p.RankMsg),
    (p.RankLaunch(plan=p.StepPlan(step=3, items=()), all_logits=True), p.RankMsg),
    (p.RankStop(), p.RankMsg),
    (
        p.CoreStatus(
            running=1,
            waiting=2,
            num_steps=3,
            num_preemptions=0,
            num_generated=9,
            pools={"full": (128, 4096)},
        ),
        p.CoreToFront,
    ),
]

CASES = PUBLIC + INTERNAL


@pytest.mark.parametrize("codec", [msgspec.json, msgspec.msgpack], ids=["json", "msgpack"])
@pytest.mark.parametrize(
    ("msg", "union"), CASES, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(CASES)]
)
def test_round_trip(msg: Any, union: Any, codec: Any) -> None:
    back = codec.Decoder(union).decode(codec.Encoder().encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_every_tagged_message_is_round_tripped() -> None:
    tagged = {
        obj
        for name, obj in vars(p).items()
        if not name.startswith("_")
        and isinstance(obj, type)
        and issubclass(obj, msgspec.Struct)
        and obj.__struct_config__.tag is not None
    }
    assert tagged == {type(m) for m, _ in CASES}


def test_cache_locs_slots_survive_the_wire() -> None:
    locs = make_locs(prefix_len=1, seq_len=9)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(locs), type=p.CacheLocs)
    assert back.slots("full").tolist() == list(range(385, 393))
    assert back.slots("c4").tolist() == [384, 385]
    assert back.count("c4_state") == 5
    assert back.count("c128") == 0
    assert back.slots("c128").tolist() == []


@settings(deadline=None, max_examples=50)
@given(st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=300))
def test_pack_unpack_slots(slots: list[int]) -> None:
    packed = p.pack_slots(slots)
    assert len(packed) == 4 * len(slots)
    assert p.unpack_slots(packed).tolist() == slots
    assert p.pack_slots(array("i", slots)) == packed


def test_plan_helpers() -> None:
    assert [item.seq_len for item in PLAN.items] == [4, 1024, 2]
    assert PLAN.num_tokens == 7


def test_submit_of_generate() -> None:
    req = p.Generate(
        id="r", prompt_token_ids=[3, 4], max_tokens=5, top_p=0.5, seed=1, stop=["a"], stream=True
    )
    sub = p.submit_of(req)
    params = p.SamplingParams(max_tokens=5, top_p=0.5, seed=1, stop=("a",))
    assert sub == p.Submit(rid="r", prompt=None, prompt_token_ids=(3, 4), params=params, stream=True)
    assert type(sub.params) is p.SamplingParams  # the sampling fields alone, not the request


# ---------------------------------------------------------------- the stdio boundary


def test_decode_request_defaults() -> None:
    req = p.decode_request(b'{"type": "generate", "id": "r1", "prompt": "hi"}\n')
    assert req == p.Generate(id="r1", prompt="hi")
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (16, 1.0, 1.0, 0, None)
    assert (req.stop, req.stop_token_ids, req.stream, req.logprobs) == ((), (), False, False)
    assert p.decode_request('{"type":"cancel","id":"r1"}') == p.Cancel(id="r1")
    assert p.decode_request(b'{"type":"shutdown"}') == p.Shutdown()


GEN = '{"type":"generate","id":"r1","prompt":"hi",'
BAD: list[tuple[bytes | str, str, str | None]] = [
    (b"{not json", "invalid JSON: ", None),
    (b"", "invalid JSON: ", None),
    (b"[1, 2]", "request must be a JSON object", None),
    (b'"generate"', "request must be a JSON object", None),
    (b'{"type":"foo","id":"r1"}', "type: unknown request type 'foo'", "r1"),
    (b'{"id":"r1","prompt":"hi"}', "type: required", "r1"),
    (b'{"type":"generate","prompt":"hi"}', "id: required", None),
    (b'{"type":"generate","id":"","prompt":"hi"}', 'id: Expected `str` of length >= 1, got ""', None),
    (b'{"type":"generate","id":5,"prompt":"hi"}', "id: Expected `str`, got `int`", None),
    (GEN + '"max_tokens":-3}', "max_tokens: expected an int in [1, 2**63), got -3", "r1"),
    (GEN + '"max_tokens":"8"}', "max_tokens: Expected `int`, got `str`", "r1"),
    (GEN + '"max_tokens":2.5}', "max_tokens: Expected `int`, got `float`", "r1"),
    (GEN + '"temperature":-1}', "temperature: expected a number >= 0, got -1.0", "r1"),
    (GEN + '"top_p":0}', "top_p: expected a number in (0, 1], got 0.0", "r1"),
    (GEN + '"top_p":1.5}', "top_p: expected a number in (0, 1], got 1.5", "r1"),
    (GEN + '"top_k":-1}', "top_k: expected an int in [0, 2**63) (0 = off), got -1", "r1"),
    (GEN + '"stream":"yes"}', "stream: Expected `bool`, got `str`", "r1"),
    (GEN + '"stop":["ok",3]}', "stop[1]: Expected `str`, got `int`", "r1"),
    (
        GEN + '"prompt_token_ids":[1]}',
        "prompt: give exactly one of prompt / prompt_token_ids (got both)",
        "r1",
    ),
    (
        b'{"type":"generate","id":"r1"}',
        "prompt: give exactly one of prompt / prompt_token_ids (got neither)",
        "r1",
    ),
    (
        b'{"type":"generate","id":"r1","prompt_token_ids":[1,-2]}',
        "prompt_token_ids[1]: Expected `int` >= 0, got -2",
        "r1",
    ),
    (GEN + '"temprature":0.5}', "temprature: unknown field of a 'generate' request", "r1"),
    (b'{"type":"stats","id":"s1"}', "id: unknown field of a 'stats' request", "s1"),
    (b'{"type":"cancel"}', "id: required", None),
    (b'{"type":"generate","id":"r7","prompt":"\xff\xfe"}', "request is not valid UTF-8", "r7"),
    (b"\xff\xfe{}", "request is not valid UTF-8", None),
    ('{"type":"generate","id":"r8","prompt":"\ud800"}', "request is not valid UTF-8", "r8"),
]


@pytest.mark.parametrize(("line", "message", "rid"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_malformed_request(line: bytes | str, message: str, rid: str | None) -> None:
    with pytest.raises(p.RequestError) as info:
        p.decode_request(line)
    err = info.value
    assert err.code == "invalid_request"
    assert err.message.startswith(message), err.message
    assert err.id == rid
    assert err.to_event() == p.ErrorEvent(id=rid, code="invalid_request", message=err.message)


def test_error_message_shows_long_values_truncated() -> None:
    with pytest.raises(p.RequestError) as info:
        p.decode_request(GEN + '"stop":["' + "x" * 500 + '", ""]}')
    assert info.value.message == "stop[1]: expected a non-empty text of at most 1024 characters, got ''"
    with pytest.raises(p.RequestError) as info:
        p.decode_request(b'{"type":"generate","id":"' + b"i" * 200 + b'"}')
    assert info.value.id == "i" * 200


def test_python_construction_validates_prompt_choice() -> None:
    with pytest.raises(ValueError, match="got both"):
        p.Generate(id="r", prompt="a", prompt_token_ids=[1])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FIELDS = st.sampled_from(["type", "id", "prompt", "prompt_token_ids", "max_tokens", "top_p", "stop", "x"])


@settings(deadline=None, max_examples=150)
@given(
    st.one_of(st.binary(max_size=40), st.dictionaries(FIELDS, JSON_VALUES | st.sampled_from(p.REQUEST_TYPES)))
)
def test_decode_request_only_raises_request_error(raw: bytes | dict[str, Any]) -> None:
    line = raw if isinstance(raw, bytes) else msgspec.json.encode(raw)
    try:
        req = p.decode_request(line)
    except p.RequestError as err:
        assert err.message
        assert err.code == "invalid_request"
    else:
        assert isinstance(req, p.Generate | p.Cancel | p.Stats | p.Shutdown)


def test_encode_event_is_one_line() -> None:
    event = p.DoneEvent(
        id="r1", finish_reason="stop", token_ids=(1,), text="a\nb\r\n", usage=USAGE, timing=TIMING
    )
    line = p.encode_event(event)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert line.startswith(b'{"type":"done","id":"r1"')
    assert p.decode_event(line) == event
    assert (
        msgspec.json.decode(p.encode_event(p.ErrorEvent(id=None, code="internal", message="m")))["id"] is None
    )


# ---------------------------------------------------------------- hostile lines (issue 9)

DEEP = "[" * 5000 + "]" * 5000
HOSTILE: list[tuple[bytes, str, str | None]] = [  # (line, the message's start, the id it echoes)
    (
        ('{"type":"generate","id":"r1","prompt":' + DEEP + "}").encode(),
        "request: JSON nested too deeply",
        None,
    ),
    (('{"id":"r1","x":' + DEEP + ',"type":"generate"}').encode(), "request: JSON nested too deeply", None),
    (DEEP.encode(), "request", None),
    (
        ('{"type":"generate","id":"r1","prompt":"x","stop":' + DEEP + "}").encode(),
        "request: JSON nested",
        None,
    ),
    ((GEN + '"temperature":1e400}').encode(), "temperature: Number out of range, got 1e400", "r1"),
    ((GEN + '"temperature":NaN}').encode(), "temperature: expected a finite number, got nan", "r1"),
    ((GEN + '"top_p":-Infinity}').encode(), "top_p: expected a finite number, got -inf", "r1"),
    ((GEN + '"top_k":' + "9" * 5000 + "}").encode(), "top_k: Integer value out of range", "r1"),
    ((GEN + f'"top_k":{2**63}}}').encode(), "top_k: expected an int in [0, 2**63) (0 = off), got 9223", "r1"),
    (
        (GEN + f'"seed":{-(2**64)}}}').encode(),
        "seed: expected an int in [-2**63, 2**63) or null, got -1844",
        "r1",
    ),
    ((GEN + '"prompt_token_ids":null,"max_tokens":1e999}').encode(), "max_tokens: Number out of range", "r1"),
    (b'{"type":"generate","id":"r1","prompt":"\\ud800"}', "prompt: not valid Unicode text", "r1"),
    (b'{"type":"generate","id":"r1","prompt":"a","stop":["\\udfff"]}', "stop: not valid Unicode", "r1"),
    (
        (GEN + '"stop":[' + ",".join(['"s"'] * 17) + "]}").encode(),
        "stop: expected at most 16 items, got 17",
        "r1",
    ),
    (
        (GEN + '"stop":["' + "s" * 1025 + '"]}').encode(),
        "stop[0]: expected a non-empty text of at most 1024",
        "r1",
    ),
    (
        (GEN + '"stop_token_ids":[' + ",".join(["1"] * 1025) + "]}").encode(),
        "stop_token_ids: expected at most 1024",
        "r1",
    ),
    (
        ('{"type":"generate","prompt":"x","id":"' + "i" * 257 + '"}').encode(),
        "id: Expected `str` of length <= 256",
        None,
    ),
    (('{"type":"cancel","id":"' + "i" * 10**6 + '"}').encode(), "id: Expected `str` of length <= 256", None),
]


@pytest.mark.parametrize(("line", "message", "rid"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_line_gets_a_field_naming_error(line: bytes, message: str, rid: str | None) -> None:
    with pytest.raises(p.RequestError) as info:
        p.decode_request(line)
    assert (info.value.code, info.value.id) == ("invalid_request", rid), info.value.message
    assert info.value.message.startswith(message), info.value.message
    assert len(info.value.message) < 200  # never echoes a huge value


def test_large_numbers_in_range_mean_what_they_say() -> None:
    req = p.decode_request(GEN + f'"top_k":{2**32 + 5},"seed":{2**63 - 1},"temperature":1e300}}')
    assert isinstance(req, p.Generate) and req.top_k == 2**32 + 5 and req.seed == 2**63 - 1


def test_decode_is_safe_deep_in_the_stack() -> None:
    """msgspec counts nesting against Python's recursion limit, so the same line fails sooner when the
    caller is deep in its own stack (a trio task): still a RequestError."""

    def nested(depth: int) -> p.RequestError:
        if depth:
            return nested(depth - 1)
        with pytest.raises(p.RequestError) as info:
            p.decode_request(
                '{"type":"generate","id":"r1","prompt":"x","stop":' + "[" * 600 + "]" * 600 + "}"
            )
        return info.value

    assert nested(500).id in ("r1", None)
