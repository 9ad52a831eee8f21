"""Structured output requests as xgrammar grammars, built at the front door.

- `response_format` (`json_object`: any JSON object; `json_schema`: its schema) constrains the answer;
  when the prompt leaves the model thinking, the reasoning is free text up to `</think>` and the
  answer after it follows the schema.
- Strict tool calls (a tool whose `function.strict` is true): xgrammar's structural tag of the model's
  own tool-call format (`ChatTemplate.grammar_format`: DeepSeek-V4's DSML, GLM-4.7's XML) lets text and
  reasoning run free and makes every call's arguments follow its tool's schema (a tool that is not
  strict: any arguments). `required` or a named tool is then forced by the grammar, not by a
  prefilled prompt (`unforced`).

`check` parses a grammar without the tokenizer (the engine core compiles it against the vocabulary),
so a bad schema is refused before the request runs.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from dsv4serve.chat.messages import ChatError, ChatPrompt, NamedToolChoice, ToolChoice, ToolSpec
from dsv4serve.protocol import StructuredOutput

MAX_WHITESPACE = 20  # whitespace characters between a JSON document's tokens (no endless runs)
THINK_END = "</think>"
THINK_TAGS = ["<think>", THINK_END]


class GrammarCheck:
    """Compiles each structured output against the model's tokenizer, as the engine core will (the
    front has the tokenizer): a grammar that does not compile is refused before the request runs, so
    the core's own compile of it (cached by xgrammar there) does not fail a step."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None

    def __call__(self, structured: StructuredOutput) -> None:
        """ValueError (naming the field) unless the grammar compiles."""
        if self._compiler is None:
            import xgrammar as xgr

            try:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            except Exception as exc:
                raise ValueError(f"{structured.origin}: this model's tokenizer: {exc}") from None
            self._compiler = xgr.GrammarCompiler(info)
        check(structured, self._compiler)


def check(structured: StructuredOutput, compiler: Any = None) -> None:
    """ValueError (naming the field) unless the grammar compiles with `compiler` (an xgrammar
    GrammarCompiler), or, with none (no tokenizer at hand), unless xgrammar reads it."""
    import xgrammar as xgr

    schema = compiler.compile_json_schema if compiler is not None else xgr.Grammar.from_json_schema
    tag = compiler.compile_structural_tag if compiler is not None else xgr.Grammar.from_structural_tag
    try:
        if structured.kind == "json_schema":
            schema(structured.spec, max_whitespace_cnt=MAX_WHITESPACE)
        else:
            tag(structured.spec)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own types
        raise ValueError(f"{structured.origin}: {type(exc).__name__}: {str(exc).strip()}") from None


def json_output(schema: dict[str, Any] | None, thinking: bool) -> StructuredOutput:
    """A JSON answer (None: any JSON object), after free reasoning when `thinking`; ChatError naming
    `response_format` if the schema cannot make one."""
    schema = {"type": "object"} if schema is None else schema
    try:
        if not thinking:
            return StructuredOutput(kind="json_schema", spec=json.dumps(schema), origin="response_format")
        from xgrammar import structural_tag as st

        reasoning = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=THINK_TAGS), end=THINK_END)
        answer = st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE)
        tag = st.StructuralTag(format=st.SequenceFormat(elements=[reasoning, answer]))
        return StructuredOutput(kind="structural_tag", spec=tag.model_dump_json(), origin="response_format")
    except Exception as exc:  # pydantic's, msgspec's or our own ValueError; xgrammar's own types
        raise ChatError(f"response_format: {type(exc).__name__}: {str(exc).strip()}") from None


def strict_tools(prompt: ChatPrompt) -> bool:
    """Whether the prompt offers tools and any is strict (then the calls are grammar-constrained)."""
    return prompt.tool_choice != "none" and any(t.function.strict for t in prompt.tools)


def unforced(prompt: ChatPrompt) -> ChatPrompt:
    """The prompt a strict request renders: `required` / a named tool left to the grammar."""
    return msgspec.structs.replace(prompt, tool_choice="auto")


def tools_output(grammar_format: str, prompt: ChatPrompt, thinking: bool, parallel: bool) -> StructuredOutput:
    """The structural tag of the model's tool-call format for the prompt's tools and tool choice."""
    import xgrammar as xgr

    tools: list[Any] = [_tool(t) for t in prompt.tools]
    choice = _choice(prompt.tool_choice)
    try:
        tag = xgr.get_model_structural_tag(
            grammar_format,
            tools=tools,
            tool_choice=choice,
            reasoning="enabled" if thinking else "disabled",
            parallel_tool_calls=parallel,
            max_whitespace_cnt=MAX_WHITESPACE,
        )
        return StructuredOutput(kind="structural_tag", spec=tag.model_dump_json(), origin="tools")
    except Exception as exc:  # a tool's schema xgrammar cannot read (ValueError, pydantic's, its own)
        raise ChatError(f"tools: {type(exc).__name__}: {str(exc).strip()}") from None


def _tool(tool: ToolSpec) -> dict[str, Any]:
    f = tool.function
    function = {"name": f.name, "parameters": f.parameters, "strict": bool(f.strict)}
    return {"type": "function", "function": function}


def _choice(choice: ToolChoice) -> Any:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.function.name}}
    return choice
