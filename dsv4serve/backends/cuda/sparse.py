"""Triton sparse shared-KV attention over the pools (the contract of `reference.sparse_attention`).

One program per (query token, block of heads): the query reads its keys (K = V) straight from the
pools through the slot tables: the sliding window's raw positions from the SWA pool, then the
compressed entries the indexer chose (ratio 4) or every visible one (heavily compressed ratio). Online
softmax in fp32 that starts from the per-head sink (max = sink, sum = 1), as the Ascend kernel does.
Masked and padded keys are never loaded (masked loads give 0) and their logits are -inf: nothing they
hold reaches the output. Each walk gathers the slots of several key tiles before it loads any key
(the window's from its table row, the compressed entries' through the indexer's picks), so no key's
address waits on a load inside the loop and the next tile's keys are fetched while the current tile
computes. The epilogue rotates the output's rope slice back by -position in registers.

Small steps (decodes) split each token's keys over programs (flash-decoding): the window and the
compressed entries are cut into fixed chunks of SPLIT keys, each chunk's program writes its partial
softmax state (max, sum, unnormalised output), and the token's last program to finish folds the
partials into the sink's state in chunk order (one launch). One program per (token, heads) would
leave the GPU nearly idle at batch 1.

Each token's keys are visited in one fixed order with fixed tiles, so its output does not depend on
what else is in the batch (beyond the step's size class: small enough to split, or large enough for
the prefill tiles of 64 keys, bf16 only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4serve.attention.step import StepMeta
from dsv4serve.backends.cuda.sparse_walks import (
    attend_entries,
    attend_window,
    num_entries,
    store_rotated_back,
)
from dsv4serve.backends.cuda.triton_utils import arrival_counters, enter, launch_options, pow2


@dataclass(frozen=True)
class AttentionConfig:
    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    split: int = 0  # keys per split program (block_n times a power of two); 0: one program walks all keys

    def __post_init__(self) -> None:
        # a key tile is the K of the P @ V dot: a GPU's tl.dot takes K >= 16 (the interpreter takes less)
        if self.block_n < 16:
            raise ValueError(f"block_n {self.block_n}: key tiles hold at least 16 keys")
        tiles = self.split // self.block_n  # a split's keys are one block of slots: a power of two of tiles
        if self.split and (self.split % self.block_n or tiles & (tiles - 1)):
            raise ValueError(f"split {self.split}: a power of two of {self.block_n}-key tiles")


SPLIT_CONFIG = AttentionConfig(split=64)  # steps of at most SPLIT_TOKENS tokens (the H200 sweep, run 9)
SPLIT_TOKENS = 16
CONFIG = AttentionConfig()  # decode-sized steps: many programs per token (latency)
# one key tile serves all heads; 64-key tiles since the slots are gathered up front (H200 run 54: 8 x 1024
# window-only 1.12 vs 1.24 ms with 32-key tiles, ratio 4 2.13 vs 2.31)
PREFILL_CONFIG = AttentionConfig(block_h=64, block_n=64, num_warps=8)
PREFILL_TOKENS = 64  # steps with more tokens than this use PREFILL_CONFIG (the H200 sweep's best)
NO_MAX = -1e30  # the running max of a split that saw no key (finite: exp(NO_MAX - m) is 0, not NaN)


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
    NT: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
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
    acc, m, s_sum = attend_window(q, acc, m, s_sum, swa_ptr, swa_table, row, swa_tstride, start, 0, n_win,
                                   d, dmask, D, scale, FP32, BLOCK_N, NT)  # fmt: skip
    if HAS_CMP:
        n_cmp = num_entries(pos, RATIO, NUM_IDX, HAS_CMP, HAS_IDX)
        acc, m, s_sum = attend_entries(q, acc, m, s_sum, cmp_ptr, cmp_table, row, cmp_tstride,
                                        idx_ptr + t * stride_idx, 0, n_cmp, d, dmask, D, scale, FP32,
                                        HAS_IDX, BLOCK_N, NT)  # fmt: skip
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh
    store_rotated_back(dst, acc / s_sum[:, None], hmask, d, dmask, cos_ptr, sin_ptr, t, stride_cos, D, HALF,
                        BLOCK_H, BLOCK_D)  # fmt: skip


@triton.jit
def _split_partials_kernel(
    q_ptr,
    swa_ptr,
    cmp_ptr,
    idx_ptr,
    acc_ptr,
    ml_ptr,
    row_ptr,
    pos_ptr,
    swa_table,
    cmp_table,
    H,
    D,
    W,
    RATIO,
    NUM_IDX,
    WIN_SPLITS,
    swa_tstride,
    cmp_tstride,
    stride_qt,
    stride_qh,
    stride_idx,
    scale,
    counter_ptr,
    sinks_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    HALF,
    stride_ot,
    stride_oh,
    stride_cos,
    HAS_CMP: tl.constexpr,
    HAS_IDX: tl.constexpr,
    FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One chunk of SPLIT keys of one token (window chunks first, then compressed ones): its partial
    softmax state (max, sum, unnormalised output) for a block of heads, without the sink. The last
    of the token's split programs to finish (an arrival counter per (token, heads), left at zero
    again) folds the partials in chunk order into the sink's state and stores the output."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    T = tl.num_programs(0)
    hmask = h < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    row = tl.load(row_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    n_win = tl.minimum(W, pos + 1)  # window: raw positions pos - n_win + 1 .. pos
    start = pos + 1 - n_win
    n_cmp = num_entries(pos, RATIO, NUM_IDX, HAS_CMP, HAS_IDX)
    is_win = sp < WIN_SPLITS
    lo = tl.where(is_win, sp, sp - WIN_SPLITS) * SPLIT
    n = tl.where(is_win, n_win, n_cmp)
    if lo < n:
        qmask = hmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        m = tl.full((BLOCK_H,), -1e30, tl.float32)  # NO_MAX: finite, so exp(m - m_new) is never NaN
        s_sum = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        hi = tl.minimum(lo + SPLIT, n)
        nt: tl.constexpr = SPLIT // BLOCK_N  # a split's tiles: one block of slots
        if is_win:
            acc, m, s_sum = attend_window(q, acc, m, s_sum, swa_ptr, swa_table, row, swa_tstride, start, lo,
                                           hi, d, dmask, D, scale, FP32, BLOCK_N, nt)  # fmt: skip
        else:
            acc, m, s_sum = attend_entries(q, acc, m, s_sum, cmp_ptr, cmp_table, row, cmp_tstride,
                                            idx_ptr + t * stride_idx, lo, hi, d, dmask, D, scale, FP32,
                                            HAS_IDX, BLOCK_N, nt)  # fmt: skip
        r = ((sp * T + t) * H + h).to(tl.int64)
        tl.store(acc_ptr + r[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(ml_ptr + r * 2, m, mask=hmask)
        tl.store(ml_ptr + r * 2 + 1, s_sum, mask=hmask)
    counter = counter_ptr + t * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()  # every warp's partial stored before the (one-thread) release below
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
        _combine(acc_ptr, ml_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr, t, T, H, h, hmask, d, dmask, D, HALF,
                 W, RATIO, NUM_IDX, WIN_SPLITS, pos, stride_ot, stride_oh, stride_cos, HAS_CMP, HAS_IDX,
                 SPLIT, BLOCK_H, BLOCK_D)  # fmt: skip
        tl.atomic_xchg(counter, 0)  # ready for the next call (and graph replay)


@triton.jit
def _fold_split(acc, m, s_sum, acc_ptr, ml_ptr, sp, T, t, H, h, hmask, d, dmask, D):
    """Fold one split's partial state into the running (acc, max, sum)."""
    r = ((sp * T + t) * H + h).to(tl.int64)
    m_s = tl.load(ml_ptr + r * 2, mask=hmask, other=-1e30, cache_modifier=".cg")  # other programs' stores
    s_s = tl.load(ml_ptr + r * 2 + 1, mask=hmask, other=0.0, cache_modifier=".cg")
    dmask2 = hmask[:, None] & dmask[None, :]
    a_s = tl.load(acc_ptr + r[:, None] * D + d[None, :], mask=dmask2, other=0.0, cache_modifier=".cg")
    m_new = tl.maximum(m, m_s)
    alpha = tl.exp(m - m_new)
    beta = tl.exp(m_s - m_new)
    return acc * alpha[:, None] + a_s * beta[:, None], m_new, s_sum * alpha + s_s * beta


@triton.jit
def _combine(
    acc_ptr, ml_ptr, sinks_ptr, out_ptr, cos_ptr, sin_ptr, t, T, H, h, hmask, d, dmask, D, HALF, W, RATIO,
    NUM_IDX, WIN_SPLITS, pos, stride_ot, stride_oh, stride_cos, HAS_CMP: tl.constexpr, HAS_IDX: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A token's splits folded in order into the sink's state (max = sink, sum = 1), normalised,
    stored, and the rope slice rotated back."""
    m = tl.load(sinks_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    s_sum = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    n_win = tl.minimum(W, pos + 1)
    for sp in range(0, tl.cdiv(n_win, SPLIT)):
        acc, m, s_sum = _fold_split(acc, m, s_sum, acc_ptr, ml_ptr, sp, T, t, H, h, hmask, d, dmask, D)
    if HAS_CMP:
        n_cmp = num_entries(pos, RATIO, NUM_IDX, HAS_CMP, HAS_IDX)
        for c in range(0, tl.cdiv(n_cmp, SPLIT)):
            acc, m, s_sum = _fold_split(
                acc, m, s_sum, acc_ptr, ml_ptr, WIN_SPLITS + c, T, t, H, h, hmask, d, dmask, D
            )
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh
    store_rotated_back(dst, acc / s_sum[:, None], hmask, d, dmask, cos_ptr, sin_ptr, t, stride_cos, D, HALF,
                        BLOCK_H, BLOCK_D)  # fmt: skip


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
    assert D % 2 == 0, "the epilogue rotates (even, odd) pairs: head_dim must be even"
    assert sinks.shape == (H,) and sinks.is_contiguous()
    out = torch.empty_like(q)
    if T == 0:
        return out
    cos, sin = meta.rope[ratio > 0]
    tables = meta.tables
    has_cmp = ratio > 0
    if has_cmp:
        assert compressed is not None and compressed.is_contiguous() and compressed.shape[-1] == D
        cmp_table = tables.entries[ratio]
    else:
        compressed, cmp_table = swa, tables.window
    if indices is not None:
        assert ratio == 4 and indices.dtype == torch.int32 and indices.stride(-1) == 1
        idx, num_idx, stride_idx = indices, indices.shape[1], indices.stride(0)
    else:
        idx, num_idx, stride_idx = meta.positions, 0, 0
    if T <= SPLIT_TOKENS:
        cfg = SPLIT_CONFIG
    else:
        cfg = PREFILL_CONFIG if T > PREFILL_TOKENS and q.dtype != torch.float32 else CONFIG
    if cfg.split:
        max_cmp = (num_idx if indices is not None else meta.num_entries[ratio]) if has_cmp else 0
        _split_attention(q, out, swa, compressed, cmp_table, idx, num_idx, stride_idx, meta, sinks, scale,
                         ratio, indices is not None, max_cmp, cfg)  # fmt: skip
        return out
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
        tables.window,
        cmp_table,
        H,
        D,
        cos.shape[-1],
        meta.sliding_window,
        max(ratio, 1),
        num_idx,
        tables.window.stride(0),
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
        NT=pow2(triton.cdiv(meta.sliding_window, cfg.block_n)),
        num_warps=cfg.num_warps * (2 if q.dtype == torch.float32 and D >= 256 else 1),
        num_stages=cfg.num_stages,
        **launch_options(q),
    )
    return out


def _split_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    swa: torch.Tensor,
    compressed: torch.Tensor,
    cmp_table: torch.Tensor,
    idx: torch.Tensor,
    num_idx: int,
    stride_idx: int,
    meta: StepMeta,
    sinks: torch.Tensor,
    scale: float,
    ratio: int,
    has_idx: bool,
    max_cmp: int,
    cfg: AttentionConfig,
) -> None:
    """The split-keys path: a fixed grid (host-known bounds on the window and the compressed entries),
    so a captured decode step replays it whatever its positions."""
    T, H, D = q.shape
    cos, sin = meta.rope[ratio > 0]
    tables = meta.tables
    win_splits = triton.cdiv(meta.sliding_window, cfg.split)
    splits = win_splits + triton.cdiv(max_cmp, cfg.split)
    acc = torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(splits, T, H, 2, dtype=torch.float32, device=q.device)
    fp32 = q.dtype == torch.float32
    common = dict(HAS_CMP=ratio > 0, HAS_IDX=has_idx, SPLIT=cfg.split, BLOCK_H=cfg.block_h,
                  BLOCK_D=pow2(D, 16))  # fmt: skip
    heads = triton.cdiv(H, cfg.block_h)
    _split_partials_kernel[(T, heads, splits)](
        q, swa, compressed, idx, acc, ml, meta.token_row, meta.positions, tables.window, cmp_table,
        H, D, meta.sliding_window, max(ratio, 1), num_idx, win_splits, tables.window.stride(0),
        cmp_table.stride(0), q.stride(0), q.stride(1), stride_idx, scale,
        arrival_counters(q.device, T * heads), sinks, out, cos, sin, cos.shape[-1], out.stride(0),
        out.stride(1), cos.stride(0), FP32=fp32, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps * (2 if fp32 and D >= 256 else 1), num_stages=cfg.num_stages, **common,
        **launch_options(q),
    )  # fmt: skip
