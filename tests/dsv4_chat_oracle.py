"""An independent reading of DeepSeek-V4's official chat encoder (`encoding/encoding_dsv4.py`,
`encode_messages` with `drop_thinking=True`, no tools, no tasks, no reasoning-effort preamble), the
oracle the package's chat template (models/deepseek_v4/chat.py) is checked against:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>        (thinking=True; `</think>` when thinking=False)

Earlier assistant turns render as `{content}<｜end▁of▁sentence｜>` (their reasoning is dropped), and
consecutive user messages merge into one turn joined by a blank line, as the official encoder does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dsv4serve.actors.tokenizer_core import TokenizerError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
CHAT_ROLES = ("system", "user", "assistant")


def encode_chat(tok: Any, messages: Sequence[Mapping[str, object]], thinking: bool = False) -> list[int]:
    """Ids of a DeepSeek-V4 chat prompt ending in `<｜Assistant｜><think>` or `<｜Assistant｜></think>`."""
    return list(tok.encode(render_chat(messages, thinking), add_special_tokens=False))


def render_chat(messages: Sequence[Mapping[str, object]], thinking: bool = False) -> str:
    """The prompt string for `messages` (roles system/user/assistant; the last one must be user).

    Special-token strings inside message contents are tokenized as tokens, as in the official encoder.
    """
    turns = _merge_user_turns([_validate_message(i, m) for i, m in enumerate(_as_list(messages))])
    if turns[-1][0] != "user":
        raise TokenizerError(f"the last message must have role 'user', got '{turns[-1][0]}'")
    parts = [BOS]
    for i, (role, content) in enumerate(turns):
        next_role = turns[i + 1][0] if i + 1 < len(turns) else None
        if role == "system":
            parts.append(content)
        elif role == "assistant":
            parts.append(content + EOS)  # earlier turns: reasoning dropped
        else:
            parts.append(USER + content)
            if next_role is None:
                parts.append(ASSISTANT + (THINK_START if thinking else THINK_END))
            elif next_role == "assistant":
                parts.append(ASSISTANT + THINK_END)
    return "".join(parts)


def _as_list(messages: object) -> list[object]:
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise TokenizerError("messages must be a non-empty list of message objects")
    return list(messages)


def _validate_message(index: int, message: object) -> tuple[str, str]:
    if not isinstance(message, Mapping):
        raise TokenizerError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise TokenizerError(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    for key in ("tools", "tool_calls"):
        if message.get(key):
            raise TokenizerError(f"messages[{index}].{key} is not supported")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise TokenizerError(f"messages[{index}].reasoning_content must be a string")
    content = message.get("content")
    if content is None and role == "assistant":
        return "assistant", ""
    return str(role), _content_text(index, content)


def _content_text(index: int, content: object) -> str:
    """A string, or a list of `{"type": "text", "text": str}` parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [_text_of_part(part) for part in content]
        strings = [text for text in texts if text is not None]
        if len(strings) == len(content):
            return "\n".join(strings)
    raise TokenizerError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _text_of_part(part: object) -> str | None:
    if isinstance(part, Mapping) and part.get("type") == "text":
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def _merge_user_turns(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    merged: list[tuple[str, str]] = []
    for role, content in messages:
        if role == "user" and merged and merged[-1][0] == "user":
            merged[-1] = ("user", merged[-1][1] + "\n\n" + content)
        else:
            merged.append((role, content))
    return merged
