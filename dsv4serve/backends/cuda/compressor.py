"""Triton fused compressor (the contract of `reference.compressor`).

One GEMM projects x through [Wkv; Wgate]; then two kernels, in this order (every read of a layer's state
happens before any write to it, as the allocator requires):
- close: one program per closing window gathers its `coff * r` rows (this step's tokens from the
  projection, older ones from the state pool through the state table; window 0's missing rows weigh
  0), adds `ape`, takes the per-channel softmax over rows, pools, RMSNorms, ropes at the window's first
  position and writes the entry into its slot of the compressed pool;
- persist: every token whose state row stays live writes `[kv | score + ape]` (fp32) to its state slot.
Rounding follows the reference: rows and weights in the activation dtype, softmax and norm in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.int8_index import Int8Rows
from dsv4serve.attention.step import StepMeta
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2
from dsv4serve.layers.linear import Weight


@triton.jit
def _close_windows_kernel(
    proj_ptr,
    ape_ptr,
    state_ptr,
    out_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    win_row_ptr,
    win_index_ptr,
    win_token0_ptr,
    win_prefix_ptr,
    state_table,
    out_table,
    D,
    WIDTH,
    RATIO,
    HALF,
    proj_stride,
    state_table_stride,
    out_table_stride,
    cos_stride,
    eps,
    COFF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    w = tl.program_id(0)
    DTYPE = proj_ptr.dtype.element_ty
    k = tl.load(win_index_ptr + w)
    closes = k >= 0
    kk = tl.maximum(k, 0).to(tl.int64)
    row = tl.load(win_row_ptr + w).to(tl.int64)
    token0 = tl.load(win_token0_ptr + w)
    prefix = tl.load(win_prefix_ptr + w)
    i = tl.arange(0, ROWS)
    in_window = (i < COFF * RATIO) & closes
    pos = (kk - (COFF - 1)) * RATIO + i
    present = in_window & (pos >= 0)  # window 0 of ratio 4 has no previous window: those rows weigh 0
    fresh = present & (pos >= prefix)
    stored = present & (pos < prefix)
    stored_slot = tl.load(state_table + row * state_table_stride + tl.maximum(pos, 0), mask=stored, other=0)
    stored_row = state_ptr + stored_slot.to(tl.int64) * (2 * WIDTH)
    fresh_row = proj_ptr + (token0 + pos - prefix).to(tl.int64) * proj_stride
    ape_row = ape_ptr + (tl.maximum(pos, 0) % RATIO) * WIDTH
    if COFF == 2:
        half = (i >= RATIO).to(tl.int64) * D  # rows of window k-1 feed half A, its own rows half B
    else:
        half = i.to(tl.int64) * 0
    slot = tl.load(out_table + row * out_table_stride + kk, mask=closes, other=0).to(tl.int64)
    dst = out_ptr + slot * D
    n_channels = tl.where(closes, D, 0)
    sumsq = 0.0
    for c0 in range(0, n_channels, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < D
        ch = half[:, None] + c[None, :]  # (ROWS, BLOCK_C)
        fm = fresh[:, None] & cmask[None, :]
        sm = stored[:, None] & cmask[None, :]
        kv = tl.load(fresh_row[:, None] + ch, mask=fm, other=0.0).to(tl.float32)
        score = tl.load(fresh_row[:, None] + WIDTH + ch, mask=fm, other=0.0).to(tl.float32)
        score += tl.load(ape_row[:, None] + ch, mask=fm, other=0.0)
        kv = tl.where(sm, tl.load(stored_row[:, None] + ch, mask=sm, other=0.0), kv)
        score = tl.where(sm, tl.load(stored_row[:, None] + WIDTH + ch, mask=sm, other=0.0), score)
        valid = present[:, None] & cmask[None, :]
        kv = tl.where(valid, kv, 0.0).to(DTYPE).to(tl.float32)
        score = tl.where(valid, score, float("-inf"))
        e = tl.exp(score - tl.max(score, axis=0)[None, :])
        weights = (e / tl.sum(e, axis=0)[None, :]).to(DTYPE).to(tl.float32)
        pooled = tl.sum((kv * weights).to(DTYPE).to(tl.float32), axis=0).to(DTYPE).to(tl.float32)
        pooled = tl.where(cmask, pooled, 0.0)
        sumsq += tl.sum(pooled * pooled, axis=0)
        tl.store(dst + c, pooled.to(out_ptr.dtype.element_ty), mask=cmask)
    tl.debug_barrier()
    scale = tl.rsqrt(sumsq / D + eps)
    for c0 in range(0, n_channels, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < D
        pooled = tl.load(dst + c, mask=cmask, other=0.0).to(tl.float32)
        normed = tl.load(norm_ptr + c, mask=cmask, other=0.0).to(tl.float32) * (pooled * scale)
        tl.store(dst + c, normed.to(DTYPE).to(out_ptr.dtype.element_ty), mask=cmask)
    tl.debug_barrier()
    j = tl.arange(0, BLOCK_HALF)
    jmask = (j < HALF) & closes
    even = D - 2 * HALF + 2 * j
    xe = tl.load(dst + even, mask=jmask, other=0.0).to(tl.float32)
    xo = tl.load(dst + even + 1, mask=jmask, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + w * cos_stride + j, mask=jmask, other=0.0)
    sn = tl.load(sin_ptr + w * cos_stride + j, mask=jmask, other=0.0)
    tl.debug_barrier()
    tl.store(dst + even, (xe * cs - xo * sn).to(DTYPE).to(out_ptr.dtype.element_ty), mask=jmask)
    tl.store(dst + even + 1, (xo * cs + xe * sn).to(DTYPE).to(out_ptr.dtype.element_ty), mask=jmask)


@triton.jit
def _persist_state_kernel(
    proj_ptr,
    ape_ptr,
    state_ptr,
    keep_ptr,
    row_ptr,
    pos_ptr,
    state_table,
    WIDTH,
    RATIO,
    proj_stride,
    state_table_stride,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(pos_ptr + t)
    keep = pos >= tl.load(keep_ptr + t)
    mask = (c < WIDTH) & keep
    row = tl.load(row_ptr + t).to(tl.int64)
    slot = tl.load(state_table + row * state_table_stride + pos, mask=keep, other=0).to(tl.int64)
    src = proj_ptr + t * proj_stride
    kv = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
    score = tl.load(src + WIDTH + c, mask=mask, other=0.0).to(tl.float32)
    score += tl.load(ape_ptr + (pos % RATIO) * WIDTH + c, mask=mask, other=0.0)
    dst = state_ptr + slot * (2 * WIDTH)
    tl.store(dst + c, kv, mask=mask)
    tl.store(dst + WIDTH + c, score, mask=mask)


def compressor(
    x: torch.Tensor,
    w: CompressorWeights,
    state: torch.Tensor,
    out: torch.Tensor | Int8Rows,
    meta: StepMeta,
    ratio: int,
    eps: float,
    *,
    linear: Callable[[torch.Tensor, Weight], torch.Tensor],
) -> None:
    assert isinstance(out, torch.Tensor), "int8 index keys: not on cuda (EngineConfig refuses them)"
    T = x.shape[0]
    coff = 2 if ratio == 4 else 1
    width, d = w.wkv.shape[0], out.shape[-1]
    assert (
        width == coff * d and state.shape[-1] == 2 * width and state.is_contiguous() and out.is_contiguous()
    )
    assert w.ape.dtype == torch.float32 and w.ape.is_contiguous() and w.norm.is_contiguous()
    proj = linear(x, w.wkv_gate)  # (T, 2 * width): [kv | score before ape]
    state_table, out_table = meta.tables.states[ratio], meta.tables.entries[ratio]
    win = meta.windows[ratio]
    if win.index.numel():
        _close_windows_kernel[(win.index.numel(),)](
            proj,
            w.ape,
            state,
            out,
            w.norm,
            win.cos,
            win.sin,
            win.row,
            win.index,
            win.token0,
            win.prefix,
            state_table,
            out_table,
            d,
            width,
            ratio,
            win.cos.shape[-1],
            proj.stride(0),
            state_table.stride(0),
            out_table.stride(0),
            win.cos.stride(0),
            eps,
            COFF=coff,
            ROWS=pow2(coff * ratio),
            BLOCK_C=max(16, min(pow2(d), 4096 // pow2(coff * ratio))),
            BLOCK_HALF=pow2(win.cos.shape[-1]),
            num_warps=4,
            **launch_options(proj),
        )
    if T:
        block = min(pow2(width), 1024)
        _persist_state_kernel[(T, triton.cdiv(width, block))](
            proj,
            w.ape,
            state,
            meta.keep_from[ratio],
            meta.token_row,
            meta.positions,
            state_table,
            width,
            ratio,
            proj.stride(0),
            state_table.stride(0),
            BLOCK=block,
            num_warps=4,
            **launch_options(proj),
        )
