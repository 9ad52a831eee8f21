"""Grammar-constrained sampling in the engine core: xgrammar matchers, one per table row.

A request with `SamplingParams.structured` gets a matcher for its grammar (compiled once per spec,
cached by the compiler) on the first step that samples it. Its items are never lookahead decodes (the
scheduler plans none for it), so every sampling item carries the request's whole history: before each
step the matcher takes the output tokens it has not seen (a history that is not its continuation, as
after a preemption's recompute, resets it), then fills the row of the step's bitmask — the tokens the
grammar allows next, computed on the host while the previous step runs on the device. A terminated
grammar allows only the model's EOS ids; a matcher that refused a token (a request with `ignore_eos`
going past its grammar's end) allows EOS only from then on.

xgrammar is chosen over llguidance by `benchmarks/bench_grammar.py` (RESULTS.md): fewer host
microseconds per token and per batch, and the model tool-call formats of both families built in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from dsv4serve.chat.grammar import MAX_WHITESPACE
from dsv4serve.protocol import StepItem, StructuredOutput


class GrammarUnavailable(RuntimeError):
    """Structured output needs the checkpoint's tokenizer (a runner built from weights has none)."""


@dataclass
class _Row:
    rid: str
    matcher: Any  # xgrammar.GrammarMatcher
    seen: list[int] = field(default_factory=list)  # output tokens the matcher has taken
    broken: bool = False  # refused a token: EOS only from then on


class Grammars:
    def __init__(self, model_dir: Path | None, vocab: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir, self.vocab, self.eos = model_dir, vocab, tuple(eos_token_ids)
        self.rows: dict[int, _Row] = {}

    @cached_property
    def info(self) -> Any:
        """xgrammar's view of the checkpoint's tokenizer (xgrammar.TokenizerInfo)."""
        import xgrammar as xgr
        from transformers import AutoTokenizer

        if self.model_dir is None:
            raise GrammarUnavailable("structured output needs the checkpoint's tokenizer files")
        tok = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)  # the front's
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab, stop_token_ids=list(self.eos))

    @cached_property
    def compiler(self) -> Any:
        import xgrammar as xgr

        return xgr.GrammarCompiler(self.info)

    def compile(self, structured: StructuredOutput) -> Any:
        if structured.kind == "json_schema":
            return self.compiler.compile_json_schema(structured.spec, max_whitespace_cnt=MAX_WHITESPACE)
        return self.compiler.compile_structural_tag(structured.spec)

    def fill(self, items: Sequence[StepItem]) -> torch.Tensor:
        """(len(items), ceil(vocab / 32)) int32 bitmask of the tokens each item's grammar allows next."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(items), self.vocab)
        for k, item in enumerate(items):
            row = self._synced(item)
            if row.broken:
                mask[k] = 0
                for t in self.eos:
                    mask[k, t // 32] |= 1 << (t % 32)
            else:
                row.matcher.fill_next_token_bitmask(mask, k)
        return mask

    def _synced(self, item: StepItem) -> _Row:
        import xgrammar as xgr

        assert item.history is not None and item.sampling.structured is not None
        row = self.rows.get(item.row)
        if row is None or row.rid != item.rid:
            matcher = xgr.GrammarMatcher(self.compile(item.sampling.structured))
            row = self.rows[item.row] = _Row(item.rid, matcher)
        out = item.history[item.prompt_len :]
        if tuple(row.seen) != out[: len(row.seen)]:  # not its continuation: start over
            row.matcher.reset()
            row.seen, row.broken = [], False
        for t in out[len(row.seen) :]:
            row.broken = row.broken or not row.matcher.accept_token(t)
            row.seen.append(t)
        return row


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(P, ceil(V / 32)) int32 bitmask -> (P, V) bool: bit t % 32 of word t // 32 allows token t."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
