"""DeepSeek-V4's compressor (the contract of `attention/dsv4.compressor`) on Ascend's `compressor` op, in
either of its two documented generations, chosen once at start-up (the backend's `generation`):

- fused: a custom-op library's `compressor` (vllm-ascend `_C_ascend`, SGLang `custom`; ../reference notes
  5.3, hicann ops-transformer `experimental/attention/compressor/README.md` and its `compressor_golden.py`):
  projection, ape, the windows' softmax-gated sums, RMSNorm and interleaved rope (rotary_mode 2) in one op.
- unfused: CANN's newer `torch.ops.cann_ops_transformer.compressor` (ops-transformer
  `attention/compressor/docs/torchapi_compressor.md`): the same up to the sums, no norm and no rope; the
  engine's RMSNorm and rope follow it here.

Both keep the state as the engine does: fp32 rows [kv | score + ape] of width 2 * coff * D, paged by raw
position ([blocks, block_size, 2 * coff * D] with a per-request block table, block 0 = skip, `cache_mode`
1); they read the rows of the windows a request's earlier steps left open and write the rows from
(end // r - (coff - 1)) * r on, the engine's `keep_start`. Their output is packed: the windows that
close, request after request, in order, then padding rows ([min(T, T // r + B), D], x's dtype).

Mapping, built once per step (`PerStep`, shared by the attention's and the indexer's compressors):
- batch entries: the step's requests (contiguous runs of one table row) padded with empty entries to T,
  so every shape is fixed by T (no host sync; a captured step keeps its shapes);
- the state block table: each page's physical page read off the state slot table (slot = page *
  page_size + offset) at a live position of it (`state_pages`), 0 (skip) for pages the op never touches;
- the output row of a closing window is the number of window-closing tokens ((p + 1) % r == 0) before
  its last token: the packed order is the flat token order. Each row's rope angles (window k at k * r)
  and entry slot come from the step's window list; padding rows go to slot 0, the pools' sentinel.
The ops' `compressor_metadata` helper is not used: its contract is documented only by its binding's
shape checks, and it needs the full rope tables, which the step's metadata does not carry.

The reference runs outside the ops' limits: fp32 (the tiny test models), hidden sizes off 1K..10K in
steps of 512, (ratio, D) other than (4, 512), (4, 128), (128, 512), rope other than 64, pages not a
multiple of 16 up to 1,024, and the ring state mode (cache_mode 2's ring holds coff * r + S - 1 rows a
request, not the engine's coff * r, and A3 does not take it). **Never run on an Ascend NPU.**
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from dsv4serve.attention import core, dsv4
from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.int8_index import Int8Rows, Quantize, store_rows
from dsv4serve.attention.rope import apply_rope
from dsv4serve.attention.step import StepMeta
from dsv4serve.backends.npu.attention import PerStep

ROPE, MAX_BLOCK = 64, 1024
FORMS = {4: (2, (128, 512)), 128: (1, (512,))}  # ratio -> (coff, head dims) the op takes


def supported(x: torch.Tensor, w: CompressorWeights, state: torch.Tensor, meta: StepMeta, ratio: int) -> bool:
    page, hidden = meta.tables.page_size, x.shape[-1]
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and w.wkv_gate.dtype == x.dtype
        and x.shape[0] > 0
        and ratio in FORMS
        and w.norm.shape[0] in FORMS[ratio][1]
        and 2 * meta.rope[True][0].shape[-1] == ROPE
        and 1024 <= hidden <= 10240
        and hidden % 512 == 0
        and meta.tables.state_sentinels[ratio] == 0  # paged state: a ring's sentinel lies past the rings
        and 0 < page <= MAX_BLOCK
        and page % 16 == 0
        and state.is_contiguous()
    )


@dataclass(frozen=True)
class CompressPlan:
    """One ratio's compressor inputs for a step, as the op takes them (T batch entries, T output rows)."""

    cu_seqlens: torch.Tensor  # (T + 1,) int32: the requests' token runs, then empty entries
    start_pos: torch.Tensor  # (T,) int32: each entry's first position (0 for the empty ones)
    state_table: torch.Tensor  # (T, pages) int32: each entry's state pages, by raw position // page
    cos: torch.Tensor  # (T, rd / 2) each output row's window rope (at k * r); 0 on padding rows
    sin: torch.Tensor
    slots: torch.Tensor  # (T,) int64: the entry slot of each output row (0, the sentinel, for padding)

    @classmethod
    def of(cls, meta: StepMeta, ratio: int) -> CompressPlan:
        T, device = meta.positions.shape[0], meta.positions.device
        tokens = torch.arange(T, device=device)
        first = torch.ones(T, dtype=torch.bool, device=device)
        first[1:] = meta.token_row[1:] != meta.token_row[:-1]
        entry = torch.cumsum(first, 0) - 1  # (T,) each token's batch entry
        starts = torch.full((T,), T, device=device).scatter_reduce(0, entry, tokens, "amin")  # (T,)
        cu_seqlens = torch.cat([starts, starts.new_full((1,), T)])  # (T + 1,)
        real, head = starts < T, starts.clamp(max=T - 1)
        start_pos = torch.where(real, meta.positions[head], 0)
        pages = state_pages(meta, ratio, head, start_pos, start_pos + cu_seqlens.diff())
        rows, cos, sin, slots = cls.output_rows(meta, ratio)
        return cls(
            cu_seqlens=cu_seqlens.to(torch.int32),
            start_pos=start_pos.to(torch.int32),
            state_table=torch.where(real[:, None], pages, 0).to(torch.int32),
            cos=cos.new_zeros(T + 1, cos.shape[-1]).index_put((rows,), cos)[:T],
            sin=sin.new_zeros(T + 1, sin.shape[-1]).index_put((rows,), sin)[:T],
            slots=slots.new_zeros(T + 1).index_put((rows,), slots)[:T],
        )

    @cached_property
    def full_cos(self) -> torch.Tensor:
        """(T, 64) fp32: each angle for its pair of channels, as the fused op takes it (once a step)."""
        return self.cos.float().repeat_interleave(2, -1)

    @cached_property
    def full_sin(self) -> torch.Tensor:
        return self.sin.float().repeat_interleave(2, -1)

    @staticmethod
    def output_rows(meta: StepMeta, ratio: int) -> tuple[torch.Tensor, ...]:
        """Each listed window's output row (T for padding), rope angles and entry slot: (NW,) each."""
        T, win = meta.positions.shape[0], meta.windows[ratio]
        closes = (meta.positions + 1) % ratio == 0  # (T,) the token closes its window
        before = torch.cumsum(closes, 0) - 1  # (T,) output row of the window a token closes
        k = win.index.clamp(min=0)
        last = (win.token0 + (k + 1) * ratio - 1 - win.prefix).clamp(0, T - 1)  # (NW,) flat closing token
        rows = torch.where(win.index >= 0, before[last], T)
        slots = meta.tables.entries[ratio][win.row, k].long()
        return rows, win.cos, win.sin, torch.where(win.index >= 0, slots, 0)


def state_pages(
    meta: StepMeta, ratio: int, head: torch.Tensor, start: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """(T, pages) each entry's physical state page of each logical page (raw position // page) the op
    touches, else 0 (skip). Rows are live only where the op reads (from keep_start(start), kept by the
    last step) and writes (from `keep_from`, this step's): a page's table entries elsewhere may be 0 or
    stale, so each page is read off the table at a position of it in one of those ranges."""
    page, table = meta.tables.page_size, meta.tables.states[ratio]
    firsts = torch.arange(0, max(meta.max_seq_len, 1), page, device=start.device)[None, :]  # (1, pages)
    read_from = ((start // ratio - (FORMS[ratio][0] - 1)) * ratio).clamp(min=0)  # keep_start(ratio, start)
    spans = [(read_from, start), (meta.keep_from[ratio][head], end)]  # (T,) each: [from, to)
    at = [torch.maximum(firsts, lo[:, None]) for lo, _ in spans]  # (T, pages): the span's first in the page
    inside = [p < torch.minimum(firsts + page, hi[:, None]) for p, (_, hi) in zip(at, spans, strict=True)]
    position = torch.where(inside[0], at[0], at[1]).clamp(max=table.shape[1] - 1)
    pages = table[meta.token_row[head][:, None], position] // page
    return torch.where(inside[0] | inside[1], pages, 0)


def npu_compressor(
    x: torch.Tensor,
    w: CompressorWeights,
    state: torch.Tensor,
    out: torch.Tensor | Int8Rows,
    meta: StepMeta,
    ratio: int,
    eps: float,
    *,
    op: Callable[..., Any],
    fused: bool,
    shared: PerStep,
    quant: Quantize,
) -> None:
    """Project, close this step's windows into `out` and persist the state rows later steps need (the
    int8 indexer's keys quantized by `quant`, torch_npu's `npu_dynamic_quant`)."""
    if not supported(x, w, state, meta, ratio):
        dsv4.compressor(x, w, state, out, meta, ratio, eps)
        return
    coff, page = FORMS[ratio][0], meta.tables.page_size
    plan: CompressPlan = shared.get(meta, ("compressor", ratio), lambda: CompressPlan.of(meta, ratio))
    paged = {
        "state_block_table": plan.state_table, "cu_seqlens": plan.cu_seqlens, "seqused": None,
        "start_pos": plan.start_pos, "coff": coff, "cache_mode": 1,
    }  # fmt: skip
    state_cache = state.view(-1, page, state.shape[-1])  # (blocks, block_size, 2 * coff * D)
    if fused:
        entries = op(
            x, w.wkv, w.wgate, state_cache, w.ape.float(), w.norm.float(), plan.full_sin, plan.full_cos,
            rope_head_dim=ROPE, cmp_ratio=ratio, norm_eps=eps, rotary_mode=2, **paged,
        )  # fmt: skip
    else:
        pooled = op(x, w.wkv, w.wgate, state_cache, w.ape.float(), ratio, **paged)  # (T, D)
        entries = apply_rope(core.rms_norm(pooled, w.norm, eps), plan.cos, plan.sin)
    store_rows(out, plan.slots, entries.to(x.dtype), quant)  # int8 keys: `npu_dynamic_quant` per row
