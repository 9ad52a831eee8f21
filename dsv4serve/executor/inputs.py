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

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from dsv4serve.attention.metadata import ForwardBatch, WindowMeta
from dsv4serve.executor.sampling import MASK32, SamplingBatch, top_k_of
from dsv4serve.protocol import StepItem

BATCH_FIELDS = ("input_ids", "positions", "token_req", "rows", "prefix_lens", "seq_lens", "cu_seqlens")
SAMPLE_FIELDS = ("sample_index", "top_k", "seed", "sample_pos")


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

    def put(self, out: np.ndarray, name: str, values: object) -> None:
        out[self.slices[name]] = values

    def views(
        self, words: torch.Tensor, max_seq_len: int, flags: SamplingFlags
    ) -> tuple[ForwardBatch, SamplingBatch]:
        """The batch and sampling rows over a (device) word buffer of this layout."""
        S, ints = self.shape.samples, words[: self.num_ints]
        v = {name: ints[s] for name, s in self.slices.items()}
        floats = words[self.num_ints :].view(torch.float32)  # (2S,)
        batch = ForwardBatch(
            **{name: v[name] for name in BATCH_FIELDS},
            sample_index=v["sample_index"],
            max_seq_len=max_seq_len,
            windows={r: WindowMeta(req=v[f"win_req{r}"], index=v[f"win_index{r}"]) for r in self.ratios},
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
    step has them, then padding up to the layout's sizes. `seeds`: one per item that samples."""
    shape, n = layout.shape, len(items)
    pads = shape.requests - n
    lengths = np.fromiter(chain((len(i.token_ids) for i in items), [1] * pads), np.int64, n + pads)
    prefix = np.fromiter(chain((i.prefix_len for i in items), [0] * pads), np.int64, n + pads)
    sample = np.fromiter(chain((i.sample for i in items), [True] * pads), bool, n + pads)
    seq = prefix + lengths
    cu = np.zeros(n + pads + 1, np.int64)
    np.cumsum(lengths, out=cu[1:])
    req = np.arange(n + pads, dtype=np.int64)
    ids = chain(chain.from_iterable(i.token_ids for i in items), [0] * pads)
    assert int(cu[-1]) == shape.tokens and int(sample.sum()) == shape.samples, (shape, n)

    def put(name: str, values: object) -> None:
        layout.put(out, name, values)

    put("input_ids", np.fromiter(ids, np.int64, int(cu[-1])))
    put("positions", np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1] - prefix, lengths))
    put("token_req", np.repeat(req, lengths))
    put("rows", [*(i.row for i in items), *[pad_row] * pads])
    put("prefix_lens", prefix)
    put("seq_lens", seq)
    put("cu_seqlens", cu)
    put("sample_index", (cu[1:] - 1)[sample])
    for r, nw in zip(layout.ratios, shape.windows, strict=True):  # windows [prefix // r, seq // r) close
        first, closing = prefix // r, seq // r - prefix // r
        total = int(closing.sum())
        starts = np.cumsum(closing) - closing - first  # window index - its entry's position
        put(f"win_req{r}", np.concatenate([np.repeat(req, closing), np.arange(nw - total)]))
        index = np.arange(total, dtype=np.int64) - np.repeat(starts, closing)
        put(f"win_index{r}", np.concatenate([index, np.full(nw - total, -1, np.int64)]))
    _pack_sampling(items, seeds, layout, out, pads)


def _pack_sampling(
    items: Sequence[StepItem], seeds: Sequence[int], layout: StepLayout, out: np.ndarray, pads: int
) -> None:
    """The sampled rows (items that sample, then padding: greedy, position 1)."""
    sampled = [i for i in items if i.sample]
    layout.put(out, "top_k", [*(top_k_of(i.sampling.top_k) for i in sampled), *[0] * pads])
    layout.put(out, "seed", [*(s & MASK32 for s in seeds), *[0] * pads])
    layout.put(out, "sample_pos", [*(i.seq_len for i in sampled), *[1] * pads])
    floats = out[layout.num_ints :].view(np.float32)
    S = layout.shape.samples
    floats[:S] = [*(i.sampling.temperature for i in sampled), *[0.0] * pads]
    floats[S:] = [*(i.sampling.top_p for i in sampled), *[1.0] * pads]


def host_words(
    items: Sequence[StepItem], seeds: Sequence[int], ratios: Sequence[int]
) -> tuple[StepLayout, torch.Tensor]:
    """An eager step's layout and its words in a new host tensor."""
    layout = StepLayout(StepShape.of(items, ratios), ratios)
    words = torch.empty(layout.num_words, dtype=torch.int64)
    pack(items, seeds, layout, words.numpy(), pad_row=0)
    return layout, words


def forward_batch(
    items: Sequence[StepItem], ratios: Sequence[int], device: torch.device | str
) -> ForwardBatch:
    """An eager step's batch on `device` (a plain copy; tests and benchmarks)."""
    layout, words = host_words(items, [0] * sum(i.sample for i in items), ratios)
    max_len = max((i.seq_len for i in items), default=0)
    return layout.views(words.to(device), max_len, SamplingFlags.of(items))[0]
