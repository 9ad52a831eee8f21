"""Triton lightning-indexer scores + top-k over visible entries (the contract of
`reference.indexer_topk`).

One program per (query token, block of entries) reads the entries' index keys from the pool through the
c4 table and writes `sum_h w_h * relu(q_h . k) * scale` as a distinct int64 sort key (score bits above,
reversed entry index below, as `core.topk_lowest_ties` builds it); invisible entries get -inf. Then
`torch.topk` of the keys picks the highest scores, exact ties to the lowest index, whatever the row width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.attention.core import in_index_order
from dsv4serve.attention.int8_index import Int8Rows
from dsv4serve.attention.step import StepMeta
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2

BLOCK_J = 32


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    table_ptr,
    row_ptr,
    pos_ptr,
    out_ptr,
    HI,
    DI,
    J,
    table_stride,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_ot,
    scale,
    FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    row = tl.load(row_ptr + t).to(tl.int64)
    visible = j < (tl.load(pos_ptr + t) + 1) // 4
    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    slot = tl.load(table_ptr + row * table_stride + j, mask=visible, other=0).to(tl.int64)
    k = tl.load(keys_ptr + slot[:, None] * DI + d[None, :], mask=visible[:, None] & dmask[None, :], other=0.0)
    score = tl.zeros((BLOCK_J,), tl.float32)
    for h0 in range(0, HI, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hmask = h < HI
        q = tl.load(
            q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hmask[:, None] & dmask[None, :]
        )
        w = tl.load(w_ptr + t * stride_wt + h, mask=hmask, other=0.0)
        if FP32:
            dots = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            dots = tl.dot(q, tl.trans(k.to(q.dtype)))
        score += tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)  # (BLOCK_J,)
    score = tl.where(visible, score, float("-inf")) + 0.0  # + 0.0: -0.0 ties with 0.0
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = ordered * 4294967296 + (4294967295 - j.to(tl.int64))
    tl.store(out_ptr + t * stride_ot + j, key, mask=j < J)


def indexer_topk(
    q: torch.Tensor,
    head_w: torch.Tensor,
    keys: torch.Tensor | Int8Rows,
    meta: StepMeta,
    topk: int,
    scale: float,
) -> torch.Tensor:
    assert isinstance(keys, torch.Tensor), "int8 index keys: not on cuda (EngineConfig refuses them)"
    T, Hi, Di = q.shape
    J = meta.num_entries[4]
    k = min(topk, J)
    if T == 0 or k == 0:
        return torch.full((T, k), -1, dtype=torch.int32, device=q.device)
    assert q.stride(-1) == 1 and head_w.dtype == torch.float32 and head_w.stride(-1) == 1
    assert keys.is_contiguous() and keys.shape[-1] == Di
    sort_keys = torch.empty(T, J, dtype=torch.int64, device=q.device)
    table = meta.tables.entries[4]
    _indexer_scores_kernel[(T, triton.cdiv(J, BLOCK_J))](
        q,
        head_w,
        keys,
        table,
        meta.token_row,
        meta.positions,
        sort_keys,
        Hi,
        Di,
        J,
        table.stride(0),
        q.stride(0),
        q.stride(1),
        head_w.stride(0),
        sort_keys.stride(0),
        scale,
        FP32=q.dtype == torch.float32,
        BLOCK_H=16 if q.dtype == torch.float32 else min(pow2(Hi, 16), 64),
        BLOCK_J=BLOCK_J,
        BLOCK_D=pow2(Di, 16),
        num_warps=4,
        **launch_options(q),
    )
    chosen = sort_keys.topk(k, dim=-1).indices  # (T, k)
    return in_index_order(chosen, chosen < ((meta.positions + 1) // 4)[:, None])
