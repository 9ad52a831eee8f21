"""Batch metadata for one forward over a flat, unpadded batch of tokens from many requests.

Built on the host from plain integers (the step plan), then moved to the device once; the forward
itself reads only these tensors and the slot tables, so it has no host syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4serve.devices import to_device


@dataclass(frozen=True)
class WindowMeta:
    """Compressor windows that close in this step for one ratio (padding entries have index -1)."""

    req: torch.Tensor  # (NW,) batch index of the window's request
    index: torch.Tensor  # (NW,) compressed index k (window covers raw [k*r, (k+1)*r)), -1 = padding


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64 absolute position of each token
    token_req: torch.Tensor  # (T,) int64 batch index of each token's request
    rows: torch.Tensor  # (B,) int64 table row of each request
    prefix_lens: torch.Tensor  # (B,) tokens cached before this step
    seq_lens: torch.Tensor  # (B,) tokens cached after this step
    cu_seqlens: torch.Tensor  # (B+1,) flat offset of each request's first token
    sample_index: torch.Tensor  # (S,) flat index of the last token of each request that samples
    max_seq_len: int  # host-known bound on seq_lens (sizes the compressed-entry gathers)
    windows: dict[int, WindowMeta]  # ratio -> closing windows

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class BatchItem:
    """One request's share of a step, in plain ints."""

    row: int
    prefix_len: int
    token_ids: Sequence[int]
    sample: bool


def build_forward_batch(
    items: Sequence[BatchItem], ratios: Sequence[int], device: torch.device | str
) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    token_req: list[int] = []
    cu = [0]
    sample_index: list[int] = []
    win: dict[int, tuple[list[int], list[int]]] = {r: ([], []) for r in ratios}
    for b, item in enumerate(items):
        n = len(item.token_ids)
        seq = item.prefix_len + n
        input_ids.extend(item.token_ids)
        positions.extend(range(item.prefix_len, seq))
        token_req.extend([b] * n)
        cu.append(cu[-1] + n)
        if item.sample:
            sample_index.append(cu[-1] - 1)
        for r, (reqs, idx) in win.items():
            closing = range(item.prefix_len // r, seq // r)
            reqs.extend([b] * len(closing))
            idx.extend(closing)

    parts: dict[str, list[int]] = {
        "input_ids": input_ids,
        "positions": positions,
        "token_req": token_req,
        "rows": [i.row for i in items],
        "prefix_lens": [i.prefix_len for i in items],
        "seq_lens": [i.prefix_len + len(i.token_ids) for i in items],
        "cu_seqlens": cu,
        "sample_index": sample_index,
    }
    for r, (reqs, idx) in win.items():
        parts[f"win_req{r}"], parts[f"win_index{r}"] = reqs, idx
    # one host tensor and one copy to the device, then views: not one transfer per field
    flat = to_device(
        torch.tensor([v for values in parts.values() for v in values], dtype=torch.int64), device
    )
    views = dict(zip(parts, flat.split([len(v) for v in parts.values()]), strict=True))
    return ForwardBatch(
        **{name: views[name] for name in list(parts)[:8]},
        max_seq_len=max((i.prefix_len + len(i.token_ids) for i in items), default=0),
        windows={r: WindowMeta(req=views[f"win_req{r}"], index=views[f"win_index{r}"]) for r in win},
    )
