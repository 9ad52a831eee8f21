"""Triton sparse shared-KV attention over the pools (the contract of `reference.sparse_attention`).

One program per (query token, block of heads): the query reads its keys (K = V) straight from the
pools through the slot tables: the sliding window's raw positions from the SWA pool, then the
compressed entries the indexer chose (ratio 4) or every visible one (heavily compressed ratio). Online
softmax in fp32 that starts from the per-head sink (max = sink, sum = 1), as the Ascend kernel does.
Masked and padded keys are never loaded (masked loads give 0) and their logits are -inf: nothing they
hold reaches the output. The epilogue rotates the output's rope slice back by -position.

Each token's keys are visited in one fixed order with fixed tiles, so its output does not depend on
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4serve.attention.step import StepMeta
from dsv4serve.triton_utils import pow2


@dataclass(frozen=True)
class AttentionConfig:
    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2


CONFIG = AttentionConfig()  # decode-sized steps: many programs per token (latency)
PREFILL_CONFIG = AttentionConfig(block_h=64, block_n=32, num_warps=8)  # one key tile serves all heads
PREFILL_TOKENS = 64  # steps with more tokens than this use PREFILL_CONFIG (the H200 sweep's best)


@triton.jit
def _attend(q, acc, m, s_sum, pool_ptr, slot, valid, d, dmask, D, scale, FP32: tl.constexpr):
    """One tile of keys (BLOCK_N rows, gathered by slot) into the online softmax state."""
    k = tl.load(
        pool_ptr + slot.to(tl.int64)[:, None] * D + d[None, :],
        mask=valid[:, None] & dmask[None, :],
        other=0.0,
    )
    k = k.to(q.dtype)
    if FP32:
        logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        logits = tl.dot(q, tl.trans(k)) * scale
    logits = tl.where(valid[None, :], logits, float("-inf"))  # (BLOCK_H, BLOCK_N)
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(logits - m_new[:, None])
    s_sum = s_sum * alpha + tl.sum(p, axis=1)
    if FP32:
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
    return acc, m_new, s_sum


@triton.jit
def _sparse_attention_kernel(
    q_ptr,
    swa_ptr,
    cmp_ptr,
    idx_ptr,
    sinks_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    row_ptr,
    pos_ptr,
    swa_table,
    cmp_table,
    H,
    D,
    HALF,
    W,
    RATIO,
    NUM_IDX,
    swa_tstride,
    cmp_tstride,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_idx,
    stride_cos,
    scale,
    HAS_CMP: tl.constexpr,
    HAS_IDX: tl.constexpr,
    FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row = tl.load(row_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    m = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32)  # the sink: max = sink, sum = 1
    s_sum = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    n_win = tl.minimum(W, pos + 1)  # window: raw positions pos - n_win + 1 .. pos
    start = pos + 1 - n_win
    for j0 in range(0, n_win, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j < n_win
        slot = tl.load(swa_table + row * swa_tstride + start + j, mask=valid, other=0)
        acc, m, s_sum = _attend(q, acc, m, s_sum, swa_ptr, slot, valid, d, dmask, D, scale, FP32)
    if HAS_CMP:
        if HAS_IDX:
            n_cmp = NUM_IDX
        else:
            n_cmp = (pos + 1) // RATIO  # every visible compressed entry
        for c0 in range(0, n_cmp, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            if HAS_IDX:
                entry = tl.load(idx_ptr + t * stride_idx + c, mask=c < n_cmp, other=-1)
                valid = entry >= 0
            else:
                entry = c
                valid = c < n_cmp
            slot = tl.load(cmp_table + row * cmp_tstride + entry, mask=valid, other=0)
            acc, m, s_sum = _attend(q, acc, m, s_sum, cmp_ptr, slot, valid, d, dmask, D, scale, FP32)
    out = acc / s_sum[:, None]
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh
    tl.store(dst + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)
    # rotate the rope slice back by -pos, from the rounded output, as the reference does
    tl.debug_barrier()
    i = tl.arange(0, BLOCK_HALF)
    imask = hmask[:, None] & (i < HALF)[None, :]
    even = D - 2 * HALF + 2 * i[None, :]
    xe = tl.load(dst + even, mask=imask, other=0.0).to(tl.float32)
    xo = tl.load(dst + even + 1, mask=imask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
    s = -tl.load(sin_ptr + t * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
    tl.debug_barrier()
    tl.store(dst + even, (xe * c - xo * s).to(out_ptr.dtype.element_ty), mask=imask)
    tl.store(dst + even + 1, (xo * c + xe * s).to(out_ptr.dtype.element_ty), mask=imask)


def sparse_attention(
    q: torch.Tensor,
    swa: torch.Tensor,
    compressed: torch.Tensor | None,
    indices: torch.Tensor | None,
    meta: StepMeta,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
) -> torch.Tensor:
    T, H, D = q.shape
    assert q.stride(-1) == 1 and swa.is_contiguous() and swa.shape[-1] == D
    assert sinks.shape == (H,) and sinks.is_contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    cos, sin = meta.rope[ratio > 0]
    tables = meta.tables
    has_cmp = ratio > 0
    if has_cmp:
        assert compressed is not None and compressed.is_contiguous() and compressed.shape[-1] == D
        cmp_table = tables.c4 if ratio == 4 else tables.c128
    else:
        compressed, cmp_table = swa, tables.swa
    if indices is not None:
        assert ratio == 4 and indices.dtype == torch.int32 and indices.stride(-1) == 1
        idx, num_idx, stride_idx = indices, indices.shape[1], indices.stride(0)
    else:
        idx, num_idx, stride_idx = meta.positions, 0, 0
    cfg = PREFILL_CONFIG if T > PREFILL_TOKENS and q.dtype != torch.float32 else CONFIG
    _sparse_attention_kernel[(T, triton.cdiv(H, cfg.block_h))](
        q,
        swa,
        compressed,
        idx,
        sinks,
        out,
        cos,
        sin,
        meta.token_row,
        meta.positions,
        tables.swa,
        cmp_table,
        H,
        D,
        cos.shape[-1],
        meta.sliding_window,
        max(ratio, 1),
        num_idx,
        tables.swa.stride(0),
        cmp_table.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        stride_idx,
        cos.stride(0),
        scale,
        HAS_CMP=has_cmp,
        HAS_IDX=indices is not None,
        FP32=q.dtype == torch.float32,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_D=pow2(D, 16),
        BLOCK_HALF=pow2(cos.shape[-1]),
        num_warps=cfg.num_warps * (2 if q.dtype == torch.float32 and D >= 256 else 1),
        num_stages=cfg.num_stages,
    )
    return out
