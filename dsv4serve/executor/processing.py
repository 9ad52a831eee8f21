"""Logit processing before sampling: logit_bias, repetition / frequency / presence penalties, min_tokens.

Per table row the device keeps what a request's processing needs across steps: its output tokens'
counts (V int32), the tokens its prompt holds (V bool) and its bias (V fp32), allocated on the first
step that processes any request. A sampling item that is not a lookahead carries the request's whole
history (`StepItem.history`): the row is rebuilt from it (so a preempted, recomputed or new request
starts right); each step then adds the token it sampled, on the device, so lookahead decodes (whose
input the host does not know yet) see it too. min_tokens is host-known: outputs so far = the item's
sequence length - its prompt's length (kept per row). A structured output's grammar (`grammar.py`)
then leaves only the tokens it allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsv4serve.executor.grammar import Grammars, unpack
from dsv4serve.protocol import StepItem


@dataclass(frozen=True)
class Prepared:
    """One step's processing: `index` (P,) the sampled rows that process, `rows` (P,) their table rows,
    the per-row penalties (P,), (sampled row, token) pairs that min_tokens forbids, and the grammar
    rows: `grammar_index` (G,) positions among the P, `allowed` (G, ceil(V / 32)) their bitmasks."""

    index: torch.Tensor
    rows: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    forbid_rows: torch.Tensor
    forbid_tokens: torch.Tensor
    grammar_index: torch.Tensor
    allowed: torch.Tensor


class LogitProcessing:
    def __init__(
        self, num_rows: int, eos_token_ids: Sequence[int], device: torch.device, grammars: Grammars
    ) -> None:
        self.num_rows, self.device, self.grammars = num_rows, device, grammars
        self.eos = tuple(eos_token_ids)
        self.prompt_lens = np.zeros(num_rows, dtype=np.int64)
        self.counts: torch.Tensor | None = None  # (rows, V) int32, allocated on first use
        self.in_prompt: torch.Tensor | None = None  # (rows, V) bool
        self.bias: torch.Tensor | None = None  # (rows, V) fp32

    def prepare(self, sampled: Sequence[StepItem], vocab: int) -> Prepared | None:
        """The step's processing (None when no sampled item processes): rows rebuilt from histories."""
        chosen = [(j, i) for j, i in enumerate(sampled) if i.sampling.processes_logits]
        if not chosen:
            return None
        if self.counts is None or self.counts.shape[1] != vocab:
            shape = (self.num_rows, vocab)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.bias = torch.zeros(shape, dtype=torch.float32, device=self.device)
        for _, item in chosen:
            if item.history is not None:
                self._rebuild(item)
        forbid: list[tuple[int, int]] = []
        for j, item in chosen:
            spec = item.sampling
            if item.seq_len - int(self.prompt_lens[item.row]) < spec.min_tokens:
                stops = set(spec.stop_token_ids) | set(self.eos)
                forbid += [(j, t) for t in sorted(stops) if t < vocab]

        def put(values: Sequence[float | int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        structured = [(k, i) for k, (_, i) in enumerate(chosen) if i.sampling.structured is not None]
        allowed = torch.zeros(0, 0, dtype=torch.int32)  # no grammar: no mask (and no xgrammar work)
        if structured:
            allowed = self.grammars.fill([i for _, i in structured])  # host work, the device busy meanwhile
        specs = [i.sampling for _, i in chosen]
        return Prepared(
            index=put([j for j, _ in chosen], torch.int64),
            rows=put([i.row for _, i in chosen], torch.int64),
            repetition=put([s.repetition_penalty for s in specs], torch.float32),
            frequency=put([s.frequency_penalty for s in specs], torch.float32),
            presence=put([s.presence_penalty for s in specs], torch.float32),
            forbid_rows=put([j for j, _ in forbid], torch.int64),
            forbid_tokens=put([t for _, t in forbid], torch.int64),
            grammar_index=put([k for k, _ in structured], torch.int64),
            allowed=allowed.to(self.device, non_blocking=True),
        )

    def _rebuild(self, item: StepItem) -> None:
        assert item.history is not None and self.counts is not None
        assert self.in_prompt is not None and self.bias is not None
        row, vocab = item.row, self.counts.shape[1]
        self.prompt_lens[row] = item.prompt_len
        prompt = torch.tensor(item.history[: item.prompt_len], dtype=torch.int64)
        output = torch.tensor(item.history[item.prompt_len :], dtype=torch.int64)
        self.counts[row] = torch.bincount(output, minlength=vocab)[:vocab].to(self.device, torch.int32)
        self.in_prompt[row] = (torch.bincount(prompt, minlength=vocab)[:vocab] > 0).to(self.device)
        bias = torch.zeros(vocab, dtype=torch.float32)
        for tid, value in (item.sampling.logit_bias or {}).items():
            if tid < vocab:
                bias[tid] = value
        self.bias[row] = bias.to(self.device)

    def apply(self, logits: torch.Tensor, prep: Prepared) -> torch.Tensor:
        """(S, V) model logits -> the logits sampling draws from (fp32, a new tensor)."""
        assert self.counts is not None and self.in_prompt is not None and self.bias is not None
        out = logits.float().clone()
        x = out[prep.index] + self.bias[prep.rows]  # (P, V)
        counts = self.counts[prep.rows]
        occurred = counts > 0
        seen = occurred | self.in_prompt[prep.rows]
        rep = prep.repetition[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - prep.frequency[:, None] * counts.float() - prep.presence[:, None] * occurred.float()
        if prep.grammar_index.numel():
            refused = ~unpack(prep.allowed, x.shape[1])
            x[prep.grammar_index] = x[prep.grammar_index].masked_fill(refused, float("-inf"))
        out[prep.index] = x
        out[prep.forbid_rows, prep.forbid_tokens] = float("-inf")
        return out

    def record(self, prep: Prepared, tokens: torch.Tensor) -> None:
        """Count each processing row's sampled token (tokens: (S,) of every sampled row)."""
        assert self.counts is not None
        one = torch.ones_like(prep.rows, dtype=torch.int32)
        self.counts.index_put_((prep.rows, tokens[prep.index]), one, accumulate=True)
