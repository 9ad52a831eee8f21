"""A step's inputs, packed on the host into one buffer of int64 words and moved to the device in one copy.

One packer serves every step. An eager step's layout is sized by its items exactly; a captured decode
graph's layout is fixed by its bucket (B requests of one token each, B sampled rows, B window entries
per ratio), and a step replaying it is packed as the eager step would be, then padded: padding items
sit on the tables' pad row (every slot they touch is a sentinel) with one token at position 0 that
closes no window, padding window entries have index -1, padding sampled rows are greedy.

Layout: the int fields of `INT_FIELDS` (then two per compression ratio, then the sampled rows' top_k,
seed and position) back to back, then the sampled rows' temperature and top_p as float32, two per
word. `StepLayout.views` turns a device copy of the words into the `ForwardBatch` and `SamplingBatch`
the forward and the sampler read: views, no further copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import numpy as np
import torch

from dsv4serve.attention.metadata import ForwardBatch, WindowMeta
from dsv4serve.executor.sampling import MASK32, TOP_K_OFF, SamplingBatch
from dsv4serve.protocol import StepItem

BATCH_FIELDS = ("input_ids", "positions", "token_req", "rows", "prefix_lens", "seq_lens", "cu_seqlens")
SAMPLE_FIELDS = ("sample_index", "top_k", "seed", "sample_pos")
# the fields a decode step writes per item, in `_pack_decodes`' order (each B words long in its layout)
DECODE_COLUMNS = ("input_ids", "positions", "rows", "prefix_lens", "seq_lens", "top_k", "seed", "sample_pos")


@dataclass(frozen=True, slots=True)
class StepShape:
    tokens: int  # T
    requests: int  # B
    samples: int  # S: rows that sample
    windows: tuple[int, ...]  # NW per compression ratio: closing windows (and padding entries)

    @classmethod
    def of(cls, items: Sequence[StepItem], ratios: Sequence[int]) -> StepShape:
        """The exact shape of an eager step."""
        closing = [sum(i.seq_len // r - i.prefix_len // r for i in items) for r in ratios]
        tokens = sum(len(i.token_ids) for i in items)
        return cls(tokens, len(items), sum(i.sample for i in items), tuple(closing))

    @classmethod
    def decode(cls, batch: int, num_ratios: int) -> StepShape:
        """A captured decode step's: `batch` one-token requests that sample, one window entry each."""
        return cls(batch, batch, batch, (batch,) * num_ratios)


class StepLayout:
    """Where each field of a step of `shape` lies in its word buffer."""

    def __init__(self, shape: StepShape, ratios: Sequence[int]) -> None:
        T, B, S = shape.tokens, shape.requests, shape.samples
        self.shape, self.ratios = shape, tuple(ratios)
        sizes = {"input_ids": T, "positions": T, "token_req": T, "rows": B, "prefix_lens": B}
        sizes |= {"seq_lens": B, "cu_seqlens": B + 1, "sample_index": S}
        for r, nw in zip(self.ratios, shape.windows, strict=True):
            sizes |= {f"win_req{r}": nw, f"win_index{r}": nw}
        sizes |= {"top_k": S, "seed": S, "sample_pos": S}
        self.slices: dict[str, slice] = {}
        offset = 0
        for name, size in sizes.items():
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.num_ints = offset
        self.num_words = offset + S  # + temperature and top_p: 2 * S float32
        self._template: tuple[int, np.ndarray, np.ndarray] | None = None
        self.is_decode = shape == StepShape.decode(B, len(self.ratios))  # a graph's: filled many times

    def put(self, out: np.ndarray, name: str, values: object) -> None:
        out[self.slices[name]] = values

    def decode_template(self, pad_row: int) -> tuple[np.ndarray, np.ndarray]:
        """The words of a step of padding only (`pack` of no items, the general path), which a decode
        step's items then overwrite, and the word index of each of their columns (`DECODE_COLUMNS`,
        one row each): both cached."""
        if self._template is None or self._template[0] != pad_row:
            words = np.empty(self.num_words, dtype=np.int64)
            pack((), (), self, words, pad_row)
            columns = np.array(
                [range(self.slices[name].start, self.slices[name].stop) for name in DECODE_COLUMNS]
            )
            self._template = (pad_row, words, columns)
        return self._template[1], self._template[2]

    def views(
        self,
        words: torch.Tensor,
        max_seq_len: int,
        flags: SamplingFlags,
        spans: tuple[tuple[int, int, int], ...] | None = None,
    ) -> tuple[ForwardBatch, SamplingBatch]:
        """The batch and sampling rows over a (device) word buffer of this layout; `spans`: an eager
        step's host-known spans of its requests (`spans`), None for a captured step."""
        S, ints = self.shape.samples, words[: self.num_ints]
        v: dict[str, Any] = {name: ints[s] for name, s in self.slices.items()}
        floats = words[self.num_ints :].view(torch.float32)  # (2S,)
        batch = ForwardBatch(
            **{name: v[name] for name in BATCH_FIELDS},
            sample_index=v["sample_index"],
            max_seq_len=max_seq_len,
            windows={r: WindowMeta(req=v[f"win_req{r}"], index=v[f"win_index{r}"]) for r in self.ratios},
            spans=spans,
        )
        params = SamplingBatch(
            floats[:S], floats[S:], v["top_k"], v["seed"], v["sample_pos"],
            flags.all_greedy, flags.needs_filter, flags.want_logprobs, flags.num_top,
        )  # fmt: skip
        return batch, params


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """What the host knows of a step's sampling work (fixes a graph's shape of it)."""

    all_greedy: bool
    needs_filter: bool  # some row uses top-k or top-p
    want_logprobs: bool
    num_top: int  # top logprobs per row to compute (0: no sort of the vocabulary)

    @classmethod
    def of(cls, items: Sequence[StepItem], num_top: int | None = None) -> SamplingFlags:
        specs = [i.sampling for i in items if i.sample]
        greedy = all(s.temperature == 0 for s in specs)
        filtered = not greedy and any(s.top_k > 0 or s.top_p < 1 for s in specs)
        top = max((s.top_logprobs for s in specs), default=0) if num_top is None else num_top
        return cls(greedy, filtered, any(s.logprobs for s in specs), top)


def pack(
    items: Sequence[StepItem], seeds: Sequence[int], layout: StepLayout, out: np.ndarray, pad_row: int
) -> None:
    """Write the step's words into `out` (int64, `layout.num_words`): the items' fields as the eager
    step has them, then padding up to the layout's sizes. `seeds`: one per item that samples.

    One-token requests that all sample, into a decode graph's layout (filled again every step), fill
    a cached template of its padding, then write their columns (numpy's per-call cost dominated at a
    few requests); any other step is built in numpy field by field (a prefill's thousands of tokens
    and windows)."""
    shape = layout.shape
    if items and layout.is_decode and all(len(i.token_ids) == 1 and i.sample for i in items):
        _pack_decodes(items, seeds, layout, out, pad_row)
        return
    n = len(items)
    pads = shape.requests - n
    prefix = [*(i.prefix_len for i in items), *[0] * pads]
    lengths = [*(len(i.token_ids) for i in items), *[1] * pads]
    seq = [p + length for p, length in zip(prefix, lengths, strict=True)]
    cu = [0, *accumulate(lengths)]
    sample = [*(i.sample for i in items), *[True] * pads]
    assert cu[-1] == shape.tokens and sum(sample) == shape.samples, (shape, n)
    ids = chain(chain.from_iterable(i.token_ids for i in items), [0] * pads)
    for name, values in _batch_fields(ids, prefix, lengths, seq, layout).items():
        layout.put(out, name, values)
    layout.put(out, "rows", [*(i.row for i in items), *[pad_row] * pads])
    layout.put(out, "prefix_lens", prefix)
    layout.put(out, "seq_lens", seq)
    layout.put(out, "cu_seqlens", cu)
    layout.put(out, "sample_index", [end - 1 for end, s in zip(cu[1:], sample, strict=True) if s])
    _pack_sampling(items, seeds, [q for q, s in zip(seq, sample, strict=True) if s], layout, out, pads)


def _pack_decodes(
    items: Sequence[StepItem], seeds: Sequence[int], layout: StepLayout, out: np.ndarray, pad_row: int
) -> None:
    """`pack` of one-token requests that all sample: the layout's padding template, then the items'
    columns in one indexed write, then their closing windows (first, as the eager step has them; the
    rest stay padding)."""
    template, columns = layout.decode_template(pad_row)
    np.copyto(out, template)
    n = len(items)
    assert n <= layout.shape.requests, (layout.shape, n)
    rows = []
    for i, seed in zip(items, seeds, strict=True):
        p = i.prefix_len
        rows.append(
            (i.token_ids[0], p, i.row, p, p + 1, min(i.sampling.top_k, TOP_K_OFF), seed & MASK32, p + 1)
        )
    out[columns[:, :n]] = np.array(rows, dtype=np.int64).T
    for r in layout.ratios:  # token q-1 closes window q//r-1
        closing = [
            (j, (i.prefix_len + 1) // r - 1) for j, i in enumerate(items) if (i.prefix_len + 1) % r == 0
        ]
        if closing:
            req, index, k = layout.slices[f"win_req{r}"], layout.slices[f"win_index{r}"], len(closing)
            out[req.start : req.stop] = [*(j for j, _ in closing), *range(req.stop - req.start - k)]
            out[index.start : index.start + k] = [w for _, w in closing]
    floats, S = out[layout.num_ints :].view(np.float32), layout.shape.samples
    floats[:n] = [i.sampling.temperature for i in items]
    floats[S : S + n] = [i.sampling.top_p for i in items]


Fields = dict[str, "Sequence[int] | np.ndarray"]


def _batch_fields(
    ids: Iterable[int], prefix: list[int], lengths: list[int], seq: list[int], layout: StepLayout
) -> Fields:
    """Per-token fields and closing windows of any step, in numpy."""
    counts, first = np.array(lengths, dtype=np.int64), np.array(prefix, dtype=np.int64)
    cu = np.cumsum(counts) - counts  # each request's first token
    req = np.arange(len(lengths), dtype=np.int64)
    tokens = int(counts.sum())
    out: Fields = {
        "input_ids": np.fromiter(ids, np.int64, tokens),
        "positions": np.arange(tokens, dtype=np.int64) - np.repeat(cu - first, counts),
        "token_req": np.repeat(req, counts),
    }
    for r, nw in zip(layout.ratios, layout.shape.windows, strict=True):  # windows [prefix // r, seq // r)
        start, closing = first // r, np.array(seq, dtype=np.int64) // r - first // r
        total = int(closing.sum())
        offset = np.cumsum(closing) - closing - start  # each window's entry - its index
        out[f"win_req{r}"] = np.concatenate([np.repeat(req, closing), np.arange(nw - total)])
        index = np.arange(total, dtype=np.int64) - np.repeat(offset, closing)
        out[f"win_index{r}"] = np.concatenate([index, np.full(nw - total, -1, np.int64)])
    return out


def _pack_sampling(
    items: Sequence[StepItem],
    seeds: Sequence[int],
    positions: Sequence[int],
    layout: StepLayout,
    out: np.ndarray,
    pads: int,
) -> None:
    """The sampled rows (items that sample, then padding: greedy, position 1); `positions`: each row's
    position, the sequence length after the step."""
    specs = [i.sampling for i in items if i.sample]
    layout.put(out, "top_k", [*(min(s.top_k, TOP_K_OFF) for s in specs), *[0] * pads])
    layout.put(out, "seed", [*(s & MASK32 for s in seeds), *[0] * pads])
    layout.put(out, "sample_pos", positions)
    floats = out[layout.num_ints :].view(np.float32)
    S = layout.shape.samples
    floats[:S] = [*(s.temperature for s in specs), *[0.0] * pads]
    floats[S:] = [*(s.top_p for s in specs), *[1.0] * pads]


def host_words(
    items: Sequence[StepItem], seeds: Sequence[int], ratios: Sequence[int]
) -> tuple[StepLayout, torch.Tensor]:
    """An eager step's layout and its words in a new host tensor."""
    layout = StepLayout(StepShape.of(items, ratios), ratios)
    words = torch.empty(layout.num_words, dtype=torch.int64)
    pack(items, seeds, layout, words.numpy(), pad_row=0)
    return layout, words


def spans(items: Sequence[StepItem]) -> tuple[tuple[int, int, int], ...]:
    """Each item's (first token, tokens, seq_len) in an eager step's flat batch."""
    lengths = [len(i.token_ids) for i in items]
    firsts = list(accumulate(lengths, initial=0))[:-1]
    return tuple(zip(firsts, lengths, (i.seq_len for i in items), strict=True))


def forward_batch(
    items: Sequence[StepItem], ratios: Sequence[int], device: torch.device | str
) -> ForwardBatch:
    """An eager step's batch on `device` (a plain copy; tests and benchmarks)."""
    layout, words = host_words(items, [0] * sum(i.sample for i in items), ratios)
    max_len = max((i.seq_len for i in items), default=0)
    return layout.views(words.to(device), max_len, SamplingFlags.of(items), spans(items))[0]
