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

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4serve.backends.cuda.triton_utils import (
    arrival_counters,
    arrive_last,
    enter,
    launch_options,
    pow2,
    sum_partials,
)
from dsv4serve.layers.linear import INT8_MAX, Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight
from dsv4serve.layers.linear import grouped_linear as reference_grouped_linear
from dsv4serve.layers.linear import linear as reference_linear

SKINNY_MAX_M = 16
TARGET_PROGRAMS = 264  # about two per SM of an H200
SCALED_MM_ROWS = 16


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
    GROUP_N,
    stride_am,
    stride_wn,
    stride_om,
    INT8: tl.constexpr,
    FP8: tl.constexpr,
    FP32: tl.constexpr,
    SPLITS: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile over one of SPLITS slices of K. Split partials go to the workspace;
    the tile's last program to finish (an arrival counter per tile, left at zero again) sums them in
    slice order, so the result never depends on which program came last. GROUPED: output columns in
    groups of GROUP_N (a multiple of BLOCK_N) read a's columns g K .. (g + 1) K for their group g."""
    enter(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(2)
    k_lo = s * K_PER_SPLIT
    if GROUPED:  # a grouped product: this tile's group's columns of a
        a_ptr += (tl.program_id(1) * BLOCK_N // GROUP_N) * K
    mmask = m < M
    nmask = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
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
        if FP8:  # W8A8, one 128-block of K: a quantized per row in registers, e4m3 (as bytes) weights
            bs = tl.load(block_scale_ptr + (n // 128) * tl.cdiv(K, 128) + k0 // 128, mask=nmask, other=0.0)
            if FP32:  # both operands dequantized, fp32 products
                a = _fp8_round_trip(a.to(tl.float32), BLOCK_M, BLOCK_K)
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * bs[:, None]
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:  # an FP8 MMA of the block, scaled into the fp32 sums (as cuBLAS's block-wise GEMM)
                e = _fp8_exponent(tl.max(tl.abs(a.to(tl.float32)), axis=1))
                aq = (a.to(tl.float32) * _pow2(-e)[:, None]).to(tl.float8e4nv)
                part = tl.dot(aq, tl.trans(w.to(tl.float8e4nv, bitcast=True)))
                acc += part * _pow2(e)[:, None] * bs[None, :]
        elif FP32:
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
        if arrive_last(counter_ptr, tile, s < SPLITS, SPLITS):  # (every program is live) the others stored
            total = sum_partials(part, mask, M * N, acc, SPLITS)
            _store_tile(total, out_ptr, a_scale_ptr, w_scale_ptr, m, n, mmask, nmask, stride_om, INT8)


@triton.jit
def _fp8_exponent(amax):
    """ceil(log2(max(amax, 1e-4) / 448)) from the quotient's bits (exact; a rounded log2 is not)."""
    bits = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2(e):
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_round_trip(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(ROWS, COLS) fp32, COLS a multiple of 128 starting at a multiple of 128: each row's 128-blocks
    quantized to e4m3 with their power-of-two scale and dequantized (formats.quantize_fp8_activation)."""
    g = tl.reshape(x, (ROWS, COLS // 128, 128))
    e = _fp8_exponent(tl.max(tl.abs(g), axis=2))
    q = (g * _pow2(-e)[:, :, None]).to(tl.float8e4nv).to(tl.float32) * _pow2(e)[:, :, None]
    return tl.reshape(q, (ROWS, COLS))


@triton.jit
def _fp8_quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, M_PAD, K, stride_x, ROWS: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr
):
    """ROWS rows' GROUP blocks of 128: e4m3 values, fp32 scales stored column-major (K / 128, M_PAD);
    rows M.. of the padding quantize zeros."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    k = b[:, None] * 128 + tl.arange(0, 128)[None, :]  # (GROUP, 128)
    mask = (row < M_PAD)[:, None, None] & (k < K)[None, :, :]
    x = tl.load(
        x_ptr + row[:, None, None] * stride_x + k[None, :, :], mask=mask & (row < M)[:, None, None], other=0.0
    ).to(tl.float32)
    e = _fp8_exponent(tl.max(tl.abs(x), axis=2))  # (ROWS, GROUP)
    tl.store(
        q_ptr + row[:, None, None] * K + k[None, :, :],
        (x * _pow2(-e)[:, :, None]).to(tl.float8e4nv),
        mask=mask,
    )
    smask = (row < M_PAD)[:, None] & (b < tl.cdiv(K, 128))[None, :]
    tl.store(s_ptr + b[None, :] * M_PAD + row[:, None], _pow2(e), mask=smask)


def quantize_fp8_rows(x: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of `formats.quantize_fp8_activation`: (M, K) -> e4m3 (M', K) and fp32 scales
    (M', ceil(K / 128)), the scales' M dimension the fastest (the layout `torch._scaled_mm` reads);
    M' is M rounded up to `multiple`, its extra rows zeros."""
    assert x.dim() == 2 and x.stride(-1) == 1
    M, K = x.shape
    m_pad = triton.cdiv(M, multiple) * multiple
    blocks = triton.cdiv(K, 128)
    q = torch.empty(m_pad, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(blocks, m_pad, dtype=torch.float32, device=x.device)
    if m_pad:
        rows, group = 4, min(pow2(blocks), 8)
        grid = (triton.cdiv(m_pad, rows), triton.cdiv(blocks, group))
        _fp8_quantize_kernel[grid](
            x, q, s, M, m_pad, K, x.stride(0), ROWS=rows, GROUP=group, num_warps=4, **launch_options(x)
        )
    return q, s.t()


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


def _plan(M: int, N: int, K: int, int8: bool, fp32: bool, fp8: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, num_warps, num_stages) from the shape alone (FP8: K tiles
    of whole 128-blocks, the activations' quantization blocks)."""
    if fp8:  # one weight scale per tile row: K tiles of exactly 128 (shared memory bounds the stages)
        bm, bn, _, splits, warps, stages = _plan(M, N, K, int8, fp32, False)
        if M > SKINNY_MAX_M:
            return bm, 64, 128, 1, warps, 2 if fp32 else 3
        # 16-bit inputs: 64-wide N tiles (bench_fp8.py --decode, run 86 on an H100, each weight read
        # cold: Flash's seven decode projections 0.083 -> 0.069 ms at one row, 0.084 -> 0.068 at 8;
        # 32 / 128 wide, more programs, 8 warps or 6 stages all slower)
        bn = bn if fp32 else 64
        return (
            bm,
            bn,
            128,
            max(1, min(triton.cdiv(TARGET_PROGRAMS, triton.cdiv(N, bn)), K // 512)),
            warps,
            stages,
        )
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
    group_n: int = 0,
) -> torch.Tensor:
    """a (M, K) @ w (N, K)^T -> (M, N); int8 operands take (a_scale (M,), w_scale (N,)); an e4m3 w (as
    uint8 bytes) takes its fp32 block scales `fp8` (ceil(N / 128), ceil(K / 128)): each weight decoded
    in a's dtype. group_n: a (M, G K), output columns in G groups of group_n, group g's from a's
    columns g K .. (g + 1) K (`grouped_linear`)."""
    M, K = a.shape[0], w.shape[1]
    N = w.shape[0]
    group_n = group_n or N
    assert N % group_n == 0 and a.shape[1] == N // group_n * K and a.stride(-1) == 1 and w.stride(-1) == 1
    int8 = scales is not None
    fp32 = a.dtype == torch.float32
    assert fp8 is None or (fp8.is_contiguous() and fp8.shape == (triton.cdiv(N, 128), triton.cdiv(K, 128)))
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    bm, bn, bk, splits, warps, stages = _plan(M, N, K, int8, fp32, fp8 is not None)
    assert group_n == N or group_n % bn == 0, "a tile within one group"
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
        group_n, a.stride(0), w.stride(0), out.stride(0),
        INT8=int8, FP8=fp8 is not None, FP32=fp32, SPLITS=splits, GROUPED=group_n != N,
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
    elif isinstance(w, Fp8BlockWeight):
        out = fp8_linear(rows if rows.stride(-1) == 1 else rows.contiguous(), w)
    elif rows.shape[0] > SKINNY_MAX_M:
        out = F.linear(rows, w)
    else:
        out = gemm(rows if rows.stride(-1) == 1 else rows.contiguous(), w, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def fp8_linear(a: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """W8A8 FP8 (the contract of the reference's `Fp8BlockWeight` product). Up to SKINNY_MAX_M rows,
    and wherever the shape does not suit cuBLAS: this module's GEMM, the activations quantized per
    128-block in its registers and one FP8 MMA per block scaled into fp32 sums (fp32 inputs: both
    operands dequantized, fp32 products).
    Larger bf16 inputs of whole 128-blocks on Hopper: `torch._scaled_mm` with 1 x 128 activation and
    128 x 128 weight scales (FP8 tensor cores, fp32 accumulation of each 128-deep block)."""
    M, K = a.shape
    N = w.shape[0]
    if M > SKINNY_MAX_M and scaled_mm_serves(a, N, K):  # cuBLAS refuses some M: rows padded to 16
        q, s = quantize_fp8_rows(a, SCALED_MM_ROWS)
        return torch._scaled_mm(q, w.qweight.t(), s, w.scale.t(), out_dtype=a.dtype)[:M]
    return gemm(a, w.qweight.view(torch.uint8), a.dtype, fp8=w.scale)


# One launch for every group of an FP8 grouped product of up to SKINNY_MAX_M rows (wo_a: 8 per layer
# at Flash dimensions, each 4 MB) instead of one per group: run 87 on an H100, official weights, 4
# layers, the b1 1k decode step's replay 1.474 -> 1.338 ms, b8 3.009 -> 2.872, b64 unchanged (6.5).
GROUPED_FP8_LAUNCH = True


def grouped_linear(x: torch.Tensor, w: Weight, groups: int) -> torch.Tensor:
    """The contract of `layers.linear.grouped_linear`: FP8 blocks, a `fp8_linear` per group; with
    GROUPED_FP8_LAUNCH and up to SKINNY_MAX_M rows, one launch of this module's GEMM over every group
    (a program's tile reads its group's columns of x); float weights: the reference's batched product."""
    fp8 = isinstance(w, Fp8BlockWeight) and (w.shape[0] // groups) % 128 == 0
    if fp8 and GROUPED_FP8_LAUNCH and x.shape[0] <= SKINNY_MAX_M:
        assert isinstance(w, Fp8BlockWeight)
        rows = x if x.stride(-1) == 1 else x.contiguous()
        return gemm(rows, w.qweight.view(torch.uint8), x.dtype, fp8=w.scale, group_n=w.shape[0] // groups)
    return reference_grouped_linear(x, w, groups, linear)


def scaled_mm_serves(a: torch.Tensor, N: int, K: int) -> bool:
    """torch._scaled_mm's block-wise scaling: CUDA compute capability 9.x, bf16 out, whole blocks."""
    return a.is_cuda and a.dtype == torch.bfloat16 and not (K % 128 or N % 128) and _hopper(a.device)


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9
