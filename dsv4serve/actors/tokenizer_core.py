"""Sync building blocks of the tokenizer actor: load, encode, detokenize incrementally, match stops.

Nothing here awaits or touches trio; the actor calls these functions and owns one
`IncrementalDetokenizer` and one `StopMatcher` per request. Chat prompts are the model family's
(`ModelSpec.chat_template`), rendered by the front door before they get here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeGuard

if TYPE_CHECKING:  # transformers loads in `load_tokenizer`: the command line's error paths stay light
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

from dsv4serve.protocol import check_text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_REPLACEMENT = "\ufffd"
_NUM_CONTEXT_TOKENS = 4  # prompt tail decoded as context before the first output token
_MAX_HELD_TOKENS = 8  # held (undecodable) tokens before looking for an inner boundary
_MAX_BOUNDARY_TRIES = 4


class TokenizerError(ValueError):
    """Tokenizer files are missing/unreadable, or a request's prompt or messages are invalid."""


class SupportsDecode(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


# ---------------------------------------------------------------- loading / raw prompts


def load_tokenizer(model_dir: Path, require_bos: bool = True) -> PreTrainedTokenizerFast:
    """Load the fast tokenizer from `tokenizer.json` + `tokenizer_config.json` in `model_dir`.

    `require_bos`: the model's raw prompts start with BOS (DeepSeek-V4; GLM's have none)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    missing = [name for name in TOKENIZER_FILES if not (Path(model_dir) / name).is_file()]
    if missing:
        raise TokenizerError(f"tokenizer files missing in {model_dir}: {', '.join(missing)}")
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types; report them as one
        raise TokenizerError(f"cannot load tokenizer from {model_dir}: {exc}") from exc
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise TokenizerError(f"{model_dir}: expected a fast tokenizer, got {type(tok).__name__}")
    if require_bos and tok.bos_token_id is None:
        raise TokenizerError(f"{model_dir}: tokenizer config defines no bos_token")
    return tok


def max_token_chars(tok: PreTrainedTokenizerFast) -> int:
    """The most characters one token's text holds: a prompt longer than this times the context has
    too many tokens for it, which the engine says before encoding it (encoding 1M tokens takes ~0.6 GB)."""
    return max(len(tok.convert_tokens_to_string([t])) for t in tok.get_vocab())


def encode_prompt(tok: PreTrainedTokenizerFast, text: str, prepend_bos: bool = True) -> list[int]:
    """Ids of a raw completion prompt: BOS + text (just the text's ids when not `prepend_bos`).

    The config says `add_bos_token: false`, but DeepSeek prompts always start with BOS, so it is
    prepended here, unless `text` already starts with the BOS string (then it is not doubled).
    Special-token strings inside `text` become their tokens: a raw prompt is trusted as written.
    """
    if not isinstance(text, str):
        raise TokenizerError(f"prompt: must be a string, got {type(text).__name__}")
    try:
        check_text("prompt", text)
    except ValueError as exc:
        raise TokenizerError(str(exc)) from None
    if not prepend_bos:
        return list(tok.encode(text, add_special_tokens=False))
    bos_id, bos_text = tok.bos_token_id, tok.bos_token
    if bos_id is None or not isinstance(bos_text, str):
        raise TokenizerError("tokenizer has no bos_token")
    ids = list(tok.encode(text, add_special_tokens=False))
    return ids if text.startswith(bos_text) else [bos_id, *ids]


# ---------------------------------------------------------------- incremental detokenization


def _plain_backend(tok: object) -> TypeGuard[TokenizersBackend]:
    """A transformers tokenizer whose decode is exactly its tokenizers backend's decode."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return (
        isinstance(tok, TokenizersBackend)
        and type(tok).decode is TokenizersBackend.decode
        and type(tok)._decode is TokenizersBackend._decode
        and tok.clean_up_tokenization_spaces is False
    )


class IncrementalDetokenizer:
    """Turns streamed output ids into text deltas that never end inside a UTF-8 character.

    Contract (byte-level tokenizers such as DeepSeek-V4's): the concatenation of every `push`
    result and the final `flush` equals `tok.decode(all_output_ids, skip_special_tokens=...)`.
    A trailing U+FFFD (an incomplete character a later token may complete) is held back.

    State: only a window of recent ids is kept and decoded, so each push costs O(new tokens)
    amortised. `_window[:_read]` is fully emitted and ends on a character boundary
    (`_read_text` is its decoded text); `_pending` counts characters after it already emitted.
    """

    def __init__(
        self, tok: SupportsDecode, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tok
        self._skip = skip_special_tokens
        # transformers' decode is the backend's plus Python overhead (~28 vs ~13 us for 40 ids) and an
        # optional clean-up: without the clean-up, and where no subclass overrides decode (codegen,
        # whisper, ... do), the backend's own decode gives the same text
        self._backend_decode = tok.backend_tokenizer.decode if _plain_backend(tok) else None
        context = list(prompt_ids)[-_NUM_CONTEXT_TOKENS:]
        text = self._decode(context)
        if text.endswith(_REPLACEMENT):  # the prompt ends inside a character: start clean
            context, text = [], ""
        self._window, self._read, self._read_text, self._pending = context, len(context), text, 0

    def push(self, new_ids: Sequence[int]) -> str:
        """Add output ids; return the newly decodable text (possibly empty)."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        new_text = self._decode(self._window)[len(self._read_text) :]
        complete = not new_text.endswith(_REPLACEMENT)
        stable = len(new_text) if complete else len(new_text) - 1
        delta = new_text[self._pending : stable]
        self._pending = max(self._pending, stable)
        if complete:
            self._advance(len(self._window), 0)
        elif len(self._window) - self._read > _MAX_HELD_TOKENS:
            self._advance_held()
        return delta

    def flush(self) -> str:
        """Return whatever is still held (a final U+FFFD included) and reset to an empty window."""
        text = self._decode(self._window)[len(self._read_text) + self._pending :]
        self._window, self._read, self._read_text, self._pending = [], 0, "", 0
        return text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip)
        text = self._tok.decode(ids, skip_special_tokens=self._skip)
        assert isinstance(text, str), "decode of one id list returns one string"
        return text

    def _advance(self, boundary: int, pending: int) -> None:
        """Make the old read offset the window start and `boundary` the new read offset."""
        self._window = self._window[self._read :]
        self._read = boundary - self._read
        self._read_text = self._decode(self._window[: self._read])
        self._pending = pending

    def _advance_held(self) -> None:
        # A long run of held ids (e.g. invalid bytes): find a recent id boundary that splits the text
        # exactly, with a non-empty right side (so later ids cannot merge across it).
        full = self._decode(self._window)
        emitted = len(self._read_text) + self._pending
        for cut in range(len(self._window) - 1, len(self._window) - 1 - _MAX_BOUNDARY_TRIES, -1):
            if cut <= self._read:
                return
            left, right = self._decode(self._window[:cut]), self._decode(self._window[cut:])
            if right and left + right == full:
                assert len(left) <= emitted, "all but the held last character is already emitted"
                self._advance(cut, emitted - len(left))
                return


# ---------------------------------------------------------------- stop strings


class StopMatcher:
    """Finds stop strings in a stream of text deltas, including stops split across deltas.

    `push` holds back the longest tail that could still start a stop string. On a hit it returns
    the text before the stop and `True`; later pushes return `("", True)`. When several stops
    match, the one ending first wins (ties: the longest), so the result does not depend on how
    the text was chunked. `matched` names the stop string that hit.

    Cost: one Knuth-Morris-Pratt automaton per stop string (its failure table, and how much of the
    stop the text's tail matches), so memory is linear in the stops' length and each pushed
    character costs amortised O(number of stops), whatever their length.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TokenizerError("stop: must be a list of strings, not a string")
        if any(not isinstance(s, str) or not s for s in stops):
            raise TokenizerError("stop: stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stops))
        self._fail = tuple(_failure_table(s) for s in self._stops)
        self._state = [0] * len(self._stops)  # chars of each stop the text's tail matches
        self._held = ""
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        """Feed one text delta; return (text safe to emit, whether a stop string was hit)."""
        if self.matched is not None:
            return "", True
        text = self._held + delta
        for end, char in enumerate(delta, start=len(self._held) + 1):  # text[:end] ends on char
            hit = self._advance(char)
            if hit is not None:
                self.matched, self._held = hit, ""
                return text[: end - len(hit)], True
        keep = max(self._state, default=0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a hit: return the held tail."""
        held, self._held = self._held, ""
        self._state = [0] * len(self._stops)
        return held

    def _advance(self, char: str) -> str | None:
        """Feed one character to every automaton; the longest stop that completes on it, if any."""
        hit: str | None = None
        for n, (stop, fail) in enumerate(zip(self._stops, self._fail, strict=True)):
            q = self._state[n]
            while q and stop[q] != char:
                q = fail[q - 1]
            q += stop[q] == char
            if q == len(stop):
                hit = stop if hit is None or len(stop) > len(hit) else hit
                q = fail[q - 1]
            self._state[n] = q
        return hit


def _failure_table(s: str) -> list[int]:
    """KMP: fail[i] = the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = fail[q - 1]
        q += s[i] == s[q]
        fail[i] = q
    return fail
