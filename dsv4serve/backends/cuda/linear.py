"""Triton GEMMs behind `Backend.linear` on CUDA: float and W8A8 int8 (the contract of
`layers.linear.linear`).

Decode-sized inputs (M <= SKINNY_MAX_M rows) are weight-bandwidth bound: one 16-row tile, the weight
streamed in wide K tiles, and the K loop split over a fixed number of programs when N alone gives
too few, so small projections still keep the GPU's memory system busy. Split partials go to an fp32
(float) or int32 (int8: exact) workspace and the last program of each tile sums them in a fixed order
(one launch per GEMM: a decode step's graph has one node fewer per split GEMM): a row's result
depends only on (N, K), never on the other rows or on the programs' timing. Larger float inputs go
to cuBLAS; larger int8 ones to the same kernel with large tiles. int8: activations quantized per row
(round half to even, like torch.round), int8 x int8 products accumulated in int32, scaled by row
scale x channel scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4serve.backends.cuda.triton_utils import arrival_counters, enter, launch_options, pow2
from dsv4serve.layers.linear import INT8_MAX, Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight
from dsv4serve.layers.linear import linear as reference_linear

SKINNY_MAX_M = 16
TARGET_PROGRAMS = 264  # about two per SM of an H200


@triton.jit
def _round_half_even(v):
    f = tl.floor(v)
    frac = v - f
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, tl.where(even, f, f + 1.0)))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 127.0
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scale)), -127.0), 127.0)
        tl.store(q_ptr + row * stride_q + k, q.to(tl.int8), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 (the contract of `quant.quantize_activation`): (M, K) -> int8, fp32 (M,)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](
            x, q, s, K, x.stride(0), q.stride(0), BLOCK=min(pow2(K), 4096), num_warps=4, **launch_options(x)
        )
    assert INT8_MAX == 127.0
    return q, s


@triton.jit
def _gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    a_scale_ptr,
    w_scale_ptr,
    block_scale_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_am,
    stride_wn,
    stride_om,
    INT8: tl.constexpr,
    FP8: tl.constexpr,
    FP32: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile over one of SPLITS slices of K. Split partials go to the workspace;
    the tile's last program to finish (an arrival counter per tile, left at zero again) sums them in
    slice order, so the result never depends on which program came last."""
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(2)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
    k_lo = s * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = tl.load(
            a_ptr + m.to(tl.int64)[:, None] * stride_am + k[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0,
        )
        w = tl.load(
            w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
            mask=nmask[:, None] & kmask[None, :],
            other=0,
        )
        if FP8:  # e4m3 (loaded as bytes) times its block's scale, in a's dtype (as decoding at load)
            blocks = (n // 128)[:, None] * tl.cdiv(K, 128) + (k // 128)[None, :]
            bs = tl.load(block_scale_ptr + blocks, mask=nmask[:, None] & kmask[None, :], other=0.0)
            w = (w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * bs).to(a.dtype)
        if FP32:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    mask = mmask[:, None] & nmask[None, :]
    if SPLITS == 1:
        _store_tile(acc, out_ptr, a_scale_ptr, w_scale_ptr, m, n, mmask, nmask, stride_om, INT8)
    else:
        part = ws_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(part + s * M * N, acc, mask=mask)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()  # every warp's partial stored before the (one-thread) release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # every other slice's partial is in the workspace
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
            for j in tl.static_range(SPLITS):  # a fixed order: the result never depends on scheduling
                total += tl.load(part + j * M * N, mask=mask, other=0, cache_modifier=".cg")
            _store_tile(total, out_ptr, a_scale_ptr, w_scale_ptr, m, n, mmask, nmask, stride_om, INT8)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next call (and graph replay)


@triton.jit
def _store_tile(acc, out_ptr, a_scale_ptr, w_scale_ptr, m, n, mmask, nmask, stride_om, INT8: tl.constexpr):
    if INT8:
        a_scale = tl.load(a_scale_ptr + m, mask=mmask, other=0.0)
        w_scale = tl.load(w_scale_ptr + n, mask=nmask, other=0.0)
        y = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    else:
        y = acc
    tl.store(
        out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


def _plan(M: int, N: int, K: int, int8: bool, fp32: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, num_warps, num_stages) from the shape alone."""
    if M <= SKINNY_MAX_M:
        # bf16 (H200 sweep, run 25, each call after an L2 flush): 32 x 128 tiles beat 16/32 x 256 on
        # every projection of a decode step (101 vs 107 us for one of each at one row) but the head's
        # 1 GB weight, which streams at ~4.3 TB/s in 32 x 256 tiles
        bf16 = not (fp32 or int8)
        block_n = 32 if bf16 or N >= 4096 else 16
        block_k = 64 if fp32 else 128 if bf16 and N * K < (1 << 28) else 256
        n_blocks = triton.cdiv(N, block_n)
        splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, n_blocks), K // (4 * block_k)))
        return 16, block_n, block_k, splits, 4, 2 if fp32 else 4
    block_m = 64 if M <= 64 else 128
    return block_m, 128, 32 if fp32 else 64, 1, 8, 3


def gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: torch.Tensor | None = None,
) -> torch.Tensor:
    """a (M, K) @ w (N, K)^T -> (M, N); int8 operands take (a_scale (M,), w_scale (N,)); an e4m3 w (as
    uint8 bytes) takes its fp32 block scales `fp8` (ceil(N / 128), ceil(K / 128)): each weight decoded
    in a's dtype."""
    M, K = a.shape
    N = w.shape[0]
    assert w.shape[1] == K and a.stride(-1) == 1 and w.stride(-1) == 1
    int8 = scales is not None
    fp32 = a.dtype == torch.float32
    assert fp8 is None or (fp8.is_contiguous() and fp8.shape == (triton.cdiv(N, 128), triton.cdiv(K, 128)))
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    bm, bn, bk, splits, warps, stages = _plan(M, N, K, int8, fp32)
    per_split = triton.cdiv(triton.cdiv(K, splits), bk) * bk
    splits = triton.cdiv(K, per_split)
    ws, counters = out, out
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), splits)
    if splits > 1:
        ws = torch.empty(splits, M, N, dtype=torch.int32 if int8 else torch.float32, device=a.device)
        counters = arrival_counters(a.device, grid[0] * grid[1])
    a_scale, w_scale = scales if scales is not None else (out, out)
    _gemm_kernel[grid](
        a, w, out, ws, counters, a_scale, w_scale, fp8 if fp8 is not None else out, M, N, K, per_split,
        a.stride(0), w.stride(0), out.stride(0), INT8=int8, FP8=fp8 is not None, FP32=fp32, SPLITS=splits,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, **launch_options(a),
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x (..., in) @ w^T -> (..., out) in x's dtype (MXFP4, only routed experts' format: the
    reference's per-call decode)."""
    if isinstance(w, Mxfp4Weight):
        return reference_linear(x, w)
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(w, Int8Weight):
        q, s = quantize_rows(rows if rows.stride(-1) == 1 else rows.contiguous())
        out = gemm(q, w.qweight, x.dtype, (s, w.scale))
    elif isinstance(w, Fp8BlockWeight):  # W8A16: decoded in the GEMV's registers; larger M: decoded once
        if rows.shape[0] > SKINNY_MAX_M:
            out = F.linear(rows, w.dequantized(x.dtype))
        else:
            a = rows if rows.stride(-1) == 1 else rows.contiguous()
            out = gemm(a, w.qweight.view(torch.uint8), x.dtype, fp8=w.scale)
    elif rows.shape[0] > SKINNY_MAX_M:
        out = F.linear(rows, w)
    else:
        out = gemm(rows if rows.stride(-1) == 1 else rows.contiguous(), w, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])
