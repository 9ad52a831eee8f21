"""Per-step metadata that every backend's attention ops read, prepared once per forward.

`prepare_step` turns the flat batch and the slot tables into per-token and per-window tensors of fixed
shape (so a decode step can be captured in a graph): each token's table row and position, its rope
angles, the first position whose compressor-state row is kept, and the windows that close this step.
Fused kernels address the pools through the tables themselves; the reference backend also asks for
the gathered `StepGeometry` (its executable spec reads keys through it). No host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4serve.attention.geometry import StepGeometry, StepTables, step_geometry
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.memory.paged import keep_start

__all__ = ["StepMeta", "StepTables", "WindowRefs", "prepare_step"]


@dataclass(frozen=True)
class WindowRefs:
    """Compressor windows of one ratio that close in this step (index -1 = padding, nothing closes)."""

    row: torch.Tensor  # (NW,) table row of the window's request
    index: torch.Tensor  # (NW,) compressed index k: the window covers raw positions [k*r, (k+1)*r)
    token0: torch.Tensor  # (NW,) flat index of the request's first token in this step
    prefix: torch.Tensor  # (NW,) tokens of the request cached before this step
    cos: torch.Tensor  # (NW, rd/2) compress rope at the window's first position k*r
    sin: torch.Tensor


@dataclass(frozen=True)
class StepMeta:
    tables: StepTables
    token_row: torch.Tensor  # (T,) table row of each token's request
    positions: torch.Tensor  # (T,) absolute position of each token
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # compress? -> cos, sin (T, rd/2)
    keep_from: dict[int, torch.Tensor]  # ratio -> (T,) first position whose state row stays live
    windows: dict[int, WindowRefs]  # ratio -> closing windows
    num_entries: dict[int, int]  # ratio -> J, host-known width of per-token compressed-entry lists
    max_seq_len: int  # host-known bound on every request's length after the step
    sliding_window: int
    geometry: StepGeometry | None  # the reference's gathers; None for fused backends


def prepare_step(
    batch: ForwardBatch, tables: StepTables, rope: RopeTables, sliding_window: int, with_geometry: bool
) -> StepMeta:
    """The step's metadata; `with_geometry`: also the reference's gathers (fused kernels need none)."""
    req = batch.token_req
    windows, keep_from = {}, {}
    for r, win in batch.windows.items():
        k = win.index.clamp(min=0)
        cos, sin = rope.lookup(k * r, compress=True)
        windows[r] = WindowRefs(
            row=batch.rows[win.req],
            index=win.index,
            token0=batch.cu_seqlens[win.req],
            prefix=batch.prefix_lens[win.req],
            cos=cos,
            sin=sin,
        )
        keep_from[r] = torch.maximum(batch.prefix_lens, keep_start(r, batch.seq_lens))[req]
    geometry = None
    if with_geometry:
        geometry = step_geometry(batch, tables, rope, sliding_window)
    return StepMeta(
        tables=tables,
        token_row=batch.rows[req],
        positions=batch.positions,
        rope={c: rope.lookup(batch.positions, compress=c) for c in (False, True)},
        keep_from=keep_from,
        windows=windows,
        num_entries={r: batch.max_seq_len // r for r in batch.windows},
        max_seq_len=batch.max_seq_len,
        sliding_window=sliding_window,
        geometry=geometry,
    )
