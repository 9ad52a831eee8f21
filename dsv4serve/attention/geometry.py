"""Where a step's tokens read and write, computed once per forward and shared by every layer.

Slot ids are layer-agnostic (one id addresses the same row in every layer's buffer of a pool), so the
table lookups, window positions, visibility masks and rope angles of a step are the same for all
layers of a kind; only the buffers differ. All of it is tensor arithmetic on the batch metadata and
the slot tables: no host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.memory.paged import coff, keep_start


@dataclass(frozen=True)
class StepTables:
    """The slot tables (request row x logical index -> slot) a DeepSeek-V4 step reads, by role; the
    model resolves them once from its layout."""

    window: torch.Tensor  # (rows, L) raw position -> sliding-window K=V slot
    entries: dict[int, torch.Tensor]  # ratio -> (rows, L // r + 1) compressed index -> entry slot
    states: dict[int, torch.Tensor]  # ratio -> (rows, L) raw position -> compressor-state slot
    state_sentinels: dict[int, int]  # ratio -> the state pool's padding slot (padding writes land there)
    page_size: int = 0  # slots of a page (slot = page * page_size + index % page_size); 0: not given


@dataclass(frozen=True)
class CompressGeometry:
    """One compression ratio's reads and writes (shared by the attention and indexer compressors)."""

    ape_row: torch.Tensor  # (T,) position % r: the row of `ape` each token's score adds
    state_write: torch.Tensor  # (T,) state slot of each token's row, or the sentinel if not kept
    window_pos: torch.Tensor  # (NW, coff*r) raw positions of each closing window's rows
    fresh: torch.Tensor  # (NW, coff*r) the row is this step's token (else it is in the state pool)
    fresh_index: torch.Tensor  # (NW, coff*r) flat token index of fresh rows
    state_read: torch.Tensor  # (NW, coff*r) state slot of stored rows
    out_slots: torch.Tensor  # (NW,) slot of each closing window's entry (0 = sentinel for padding)
    window_cos: torch.Tensor  # (NW, rd/2) rope at each window's first position
    window_sin: torch.Tensor
    entry_slots: torch.Tensor  # (T, J) slots of compressed entries 0..J-1 of each token's request
    entry_visible: torch.Tensor  # (T, J) entry j is visible to query t iff j < (t + 1) // r


@dataclass(frozen=True)
class StepGeometry:
    swa_write: torch.Tensor  # (T,) SWA slot of each token
    window_slots: torch.Tensor  # (T, W) SWA slots of positions t-W+1..t
    window_visible: torch.Tensor  # (T, W)
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # compress? -> cos, sin (T, rd/2)
    compress: dict[int, CompressGeometry]  # ratio -> its geometry


def step_geometry(batch: ForwardBatch, tables: StepTables, rope: RopeTables, window: int) -> StepGeometry:
    rows = batch.rows[batch.token_req]  # (T,)
    pos = batch.positions[:, None] - torch.arange(window - 1, -1, -1, device=rows.device)  # (T, W)
    return StepGeometry(
        swa_write=tables.window[rows, batch.positions].long(),
        window_slots=tables.window[rows[:, None], pos.clamp(min=0)].long(),
        window_visible=pos >= 0,
        rope={c: rope.lookup(batch.positions, compress=c) for c in (False, True)},
        compress={r: _compress(batch, tables, rope, r, rows) for r in tables.entries},
    )


def _compress(
    batch: ForwardBatch, tables: StepTables, rope: RopeTables, ratio: int, rows: torch.Tensor
) -> CompressGeometry:
    state, out, sentinel = tables.states[ratio], tables.entries[ratio], tables.state_sentinels[ratio]
    start = torch.maximum(batch.prefix_lens, keep_start(ratio, batch.seq_lens))[batch.token_req]
    kept = batch.positions >= start
    windows = batch.windows[ratio]
    k = windows.index.clamp(min=0)  # (NW,) padding entries (-1) compute window 0, written to slot 0
    b = windows.req
    rows_per_token = coff(ratio)
    pos = ((k - (rows_per_token - 1)) * ratio)[:, None] + torch.arange(
        rows_per_token * ratio, device=k.device
    )
    prefix = batch.prefix_lens[b][:, None]
    last = max(batch.num_tokens - 1, 0)
    cos, sin = rope.lookup(k * ratio, compress=True)
    j = torch.arange(batch.max_seq_len // ratio, device=rows.device)  # (J,)
    return CompressGeometry(
        ape_row=batch.positions % ratio,
        state_write=torch.where(kept, state[rows, batch.positions].long(), sentinel),
        window_pos=pos,
        fresh=pos >= prefix,
        fresh_index=(batch.cu_seqlens[b][:, None] + pos - prefix).clamp(0, last),
        state_read=state[batch.rows[b][:, None], pos.clamp(min=0)].long(),
        out_slots=torch.where(windows.index >= 0, out[batch.rows[b], k].long(), 0),
        window_cos=cos,
        window_sin=sin,
        entry_slots=out[rows[:, None], j[None, :]].long(),
        entry_visible=j[None, :] < ((batch.positions + 1) // ratio)[:, None],
    )
