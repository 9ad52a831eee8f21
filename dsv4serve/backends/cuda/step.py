"""`prepare_step` in Triton (the contract of `step.prepare_step` without the reference's geometry).

The step metadata is a few dozen gathers and integer ops on tiny tensors; as torch ops a decode step
paid ~30 launches for it (each a graph node: ~1.5 us of kernel plus the gap to the next at batch 1).
Here one kernel fills the per-token fields and one per compress ratio the closing windows' fields,
with the same values (gathers and integer arithmetic only: exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.attention.step import StepMeta, StepTables, WindowRefs, prepare_step
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2

BLOCK = 64  # tokens (or windows) per program


@triton.jit
def _gather_rows(src_ptr, dst_ptr, index, out_row, mask, HALF, BLOCK_HALF: tl.constexpr):
    """dst[out_row] = src[index], rows of HALF values."""
    i = tl.arange(0, BLOCK_HALF)
    m = mask[:, None] & (i < HALF)[None, :]
    v = tl.load(src_ptr + index.to(tl.int64)[:, None] * HALF + i[None, :], mask=m, other=0.0)
    tl.store(dst_ptr + out_row.to(tl.int64)[:, None] * HALF + i[None, :], v, mask=m)


@triton.jit
def _keep_from(prefix, seq, ratio):
    """max(prefix, keep_start(ratio, seq)): the first position whose state row stays live."""
    start = (seq // ratio - (ratio == 4).to(seq.dtype)) * ratio
    return tl.maximum(prefix, tl.maximum(start, 0))


@triton.jit
def _token_meta_kernel(
    req_ptr, rows_ptr, pos_ptr, prefix_ptr, seq_ptr, main_cos, main_sin, comp_cos, comp_sin,
    token_row_ptr, mcos_ptr, msin_ptr, ccos_ptr, csin_ptr, keep_ptr,
    T, HALF, RATIO_A, RATIO_B,
    NUM_RATIOS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Per token: its table row, both ropes' cos / sin at its position, and keep_from per ratio
    (keep_ptr: (NUM_RATIOS, T))."""
    enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    req = tl.load(req_ptr + t, mask=tm, other=0)
    tl.store(token_row_ptr + t, tl.load(rows_ptr + req, mask=tm, other=0), mask=tm)
    pos = tl.load(pos_ptr + t, mask=tm, other=0)
    _gather_rows(main_cos, mcos_ptr, pos, t, tm, HALF, BLOCK_HALF)
    _gather_rows(main_sin, msin_ptr, pos, t, tm, HALF, BLOCK_HALF)
    _gather_rows(comp_cos, ccos_ptr, pos, t, tm, HALF, BLOCK_HALF)
    _gather_rows(comp_sin, csin_ptr, pos, t, tm, HALF, BLOCK_HALF)
    prefix = tl.load(prefix_ptr + req, mask=tm, other=0)
    seq = tl.load(seq_ptr + req, mask=tm, other=0)
    if NUM_RATIOS >= 1:
        tl.store(keep_ptr + t, _keep_from(prefix, seq, RATIO_A), mask=tm)
    if NUM_RATIOS >= 2:
        tl.store(keep_ptr + T + t, _keep_from(prefix, seq, RATIO_B), mask=tm)


@triton.jit
def _window_meta_kernel(
    win_req_ptr, win_index_ptr, rows_ptr, cu_ptr, prefix_ptr, comp_cos, comp_sin,
    row_ptr, token0_ptr, wprefix_ptr, cos_ptr, sin_ptr,
    NW, HALF, RATIO, BLOCK_W: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Per closing window of one ratio: its request's table row, first token, cached prefix, and the
    compress rope at the window's first position (index -1, padding: position 0)."""
    enter(PDL)
    w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    wm = w < NW
    req = tl.load(win_req_ptr + w, mask=wm, other=0)
    tl.store(row_ptr + w, tl.load(rows_ptr + req, mask=wm, other=0), mask=wm)
    tl.store(token0_ptr + w, tl.load(cu_ptr + req, mask=wm, other=0), mask=wm)
    tl.store(wprefix_ptr + w, tl.load(prefix_ptr + req, mask=wm, other=0), mask=wm)
    first = tl.maximum(tl.load(win_index_ptr + w, mask=wm, other=0), 0) * RATIO
    _gather_rows(comp_cos, cos_ptr, first, w, wm, HALF, BLOCK_HALF)
    _gather_rows(comp_sin, sin_ptr, first, w, wm, HALF, BLOCK_HALF)


def prepare_step_fused(
    batch: ForwardBatch, tables: StepTables, rope: RopeTables, sliding_window: int
) -> StepMeta:
    """`prepare_step(..., with_geometry=False)` in 1 + (number of ratios) launches."""
    ratios = list(batch.windows)
    tables_ok = all(t.is_contiguous() for t in (rope.main_cos, rope.main_sin, rope.comp_cos, rope.comp_sin))
    ints = [batch.token_req, batch.rows, batch.prefix_lens, batch.seq_lens, batch.cu_seqlens, batch.positions]
    ints += [t for w in batch.windows.values() for t in (w.req, w.index)]
    if len(ratios) > 2 or not tables_ok or any(t.dtype != torch.int64 or not t.is_contiguous() for t in ints):
        return prepare_step(batch, tables, rope, sliding_window, with_geometry=False)
    T, half = batch.num_tokens, rope.main_cos.shape[-1]
    dev, ftype = batch.positions.device, rope.main_cos.dtype
    token_row = torch.empty(T, dtype=torch.int64, device=dev)
    cos_sin = torch.empty(4, T, half, dtype=ftype, device=dev)
    keep = torch.empty(max(len(ratios), 1), T, dtype=torch.int64, device=dev)
    if T:
        _token_meta_kernel[(triton.cdiv(T, BLOCK),)](
            batch.token_req, batch.rows, batch.positions, batch.prefix_lens, batch.seq_lens,
            rope.main_cos, rope.main_sin, rope.comp_cos, rope.comp_sin,
            token_row, cos_sin[0], cos_sin[1], cos_sin[2], cos_sin[3], keep,
            T, half, *[*ratios, 1, 1][:2],
            NUM_RATIOS=len(ratios), BLOCK_T=BLOCK, BLOCK_HALF=pow2(half), num_warps=4,
            **launch_options(batch.token_req),
        )  # fmt: skip
    windows = {}
    for r, win in batch.windows.items():
        nw = win.index.shape[0]
        fields = torch.empty(3, nw, dtype=torch.int64, device=dev)
        rot = torch.empty(2, nw, half, dtype=ftype, device=dev)
        if nw:
            _window_meta_kernel[(triton.cdiv(nw, BLOCK),)](
                win.req, win.index, batch.rows, batch.cu_seqlens, batch.prefix_lens,
                rope.comp_cos, rope.comp_sin, fields[0], fields[1], fields[2], rot[0], rot[1],
                nw, half, r, BLOCK_W=BLOCK, BLOCK_HALF=pow2(half), num_warps=4, **launch_options(win.req),
            )  # fmt: skip
        windows[r] = WindowRefs(
            row=fields[0], index=win.index, token0=fields[1], prefix=fields[2], cos=rot[0], sin=rot[1]
        )
    return StepMeta(
        tables=tables,
        token_row=token_row,
        positions=batch.positions,
        rope={False: (cos_sin[0], cos_sin[1]), True: (cos_sin[2], cos_sin[3])},
        keep_from={r: keep[i] for i, r in enumerate(ratios)},
        windows=windows,
        num_entries={r: batch.max_seq_len // r for r in batch.windows},
        max_seq_len=batch.max_seq_len,
        sliding_window=sliding_window,
        geometry=None,
    )
