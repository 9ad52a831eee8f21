"""Triton routed experts: a grouped GEMM over the chosen experts only (the contract of
`experts.routed_experts_reference`), float, W8A8 int8 or MXFP4 (W4A16).

1. align (torch ops, fixed shapes, no host sync): the T*k (token, slot) pairs sorted by expert (stable),
   each expert's run padded to a multiple of BLOCK_M; every block of BLOCK_M pairs has one expert.
2. gate/up: per block, x rows of its pairs times W1[e] and W3[e], the clamped SwiGLU in the epilogue.
3. down: per block, times W2[e], scaled by each pair's routing weight, one row per pair.
4. reduce: each token sums its k rows in slot order (fixed: the result never depends on the batch).
Decode-sized calls sum gate/up's and down's K loops in fixed slices, split over programs when a step
has few tiles (see DECODE_SLICES).
Blocks past the last real one (the grid is sized for the worst case) do nothing. int8 quantizes x per
token and the SwiGLU output per pair (the reference's per-row activation quantization). MXFP4 (W4A16)
decodes each 32-block of weights in registers (e2m1 values times their power-of-two scale: exact in
bf16; on a GPU eight weights per few PTX bit operations and two bf16x2 products), the even and the odd
columns apart (no interleave: the activations are read the same way), then bf16 products with fp32
sums: the bytes read are about a quarter of bf16's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from dsv4serve.backends.cuda.linear import linear, quantize_rows
from dsv4serve.backends.cuda.triton_utils import (
    arrival_counters,
    arrive_last,
    enter,
    launch_options,
    pow2,
    ptx_enabled,
    sum_partials,
)
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight
from dsv4serve.moe.experts import gate_up_view, swiglu

SMALL_ALIGN = 1024  # at most this many pairs: align in one Triton program instead of a dozen torch ops
DECODE_PAIRS = 2048  # at most this many (token, slot) pairs: decode tiles and K slices; more: prefill paths


@triton.jit
def _align_small_kernel(
    ids_ptr,
    pairs_ptr,
    block_expert_ptr,
    scratch_ptr,
    N,
    E,
    K,
    MAX_BLOCKS,
    SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: the (token, slot) pairs sorted by expert (stable), each expert's run padded to
    BLOCK_M; `scratch` (2 * BLOCK_E int32) holds per-expert offsets between the two phases. ids holds K
    per token; SHARED: each token has a (K+1)-th pair, with the shared expert E - 1."""
    enter(PDL)
    i = tl.arange(0, BLOCK_N)
    valid = i < N
    if SHARED:
        t, j = i // (K + 1), i % (K + 1)
        routed = tl.load(ids_ptr + t * K + j, mask=valid & (j < K), other=0).to(tl.int32)
        expert = tl.where(valid, tl.where(j < K, routed, E - 1), BLOCK_E - 1)
    else:
        expert = tl.load(ids_ptr + i, mask=valid, other=BLOCK_E - 1).to(tl.int32)  # BLOCK_E - 1 >= E: spare
    counts = tl.histogram(expert, BLOCK_E)
    x = tl.arange(0, BLOCK_E)
    counts = tl.where(x < E, counts, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    tl.store(scratch_ptr + x, (block_end - blocks) * BLOCK_M)  # first padded row of each expert
    tl.store(scratch_ptr + BLOCK_E + x, tl.cumsum(counts, axis=0) - counts)  # first sorted rank of each
    for r0 in range(0, MAX_BLOCKS * BLOCK_M, CHUNK):  # every row padding first
        r = r0 + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + r, N, mask=r < MAX_BLOCKS * BLOCK_M)
    for b0 in range(0, MAX_BLOCKS, CHUNK):  # block b belongs to the expert whose block range holds it
        b = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(owner, E), mask=b < MAX_BLOCKS)
    tl.debug_barrier()
    key = tl.where(valid, expert * BLOCK_N + i, BLOCK_E * BLOCK_N)  # distinct: sorts by expert, then pair
    key = tl.sort(key)
    pair = key % BLOCK_N
    sorted_expert = key // BLOCK_N
    live = sorted_expert < E
    e = tl.minimum(sorted_expert, BLOCK_E - 1)
    rank = tl.arange(0, BLOCK_N) - tl.load(scratch_ptr + BLOCK_E + e)
    row = tl.load(scratch_ptr + e) + rank
    tl.store(pairs_ptr + row, pair.to(tl.int64), mask=live)


def align(
    ids: torch.Tensor, num_experts: int, block_m: int, shared: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (T, k), int32 or int64 -> (pair id per padded row (blocks * block_m,), n = padding; expert
    per block (blocks,), E = none). shared: every token's pair k + 1 (pairs T * (k + 1)) is expert
    num_experts - 1."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    n = T * (k + shared)
    max_blocks = triton.cdiv(n, block_m) + min(n, num_experts)
    if n <= SMALL_ALIGN:
        pairs = torch.empty(max_blocks * block_m, dtype=torch.int64, device=ids.device)
        block_expert = torch.empty(max_blocks, dtype=torch.int64, device=ids.device)
        bins = pow2(num_experts + 1)
        scratch = torch.empty(2 * bins, dtype=torch.int32, device=ids.device)
        _align_small_kernel[(1,)](
            flat, pairs, block_expert, scratch, n, num_experts, k, max_blocks,
            SHARED=shared, BLOCK_M=block_m, BLOCK_N=pow2(n, 16), BLOCK_E=bins, CHUNK=64, num_warps=4,
            **launch_options(flat),
        )  # fmt: skip
        return pairs, block_expert
    if shared:
        last = torch.full((T, 1), num_experts - 1, dtype=ids.dtype, device=ids.device)
        flat = torch.cat([ids, last], dim=1).reshape(-1)
    return align_torch(flat.long(), num_experts, block_m, max_blocks)


def align_torch(
    flat: torch.Tensor, num_experts: int, block_m: int, max_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align` for any number of pairs, in torch ops (fixed shapes, no host sync)."""
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m  # (E,)
    block_end = torch.cumsum(blocks, 0)
    order = torch.sort(flat, stable=True).indices  # pairs by expert, in token order within one
    expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    pairs = torch.full((max_blocks * block_m,), n, dtype=torch.int64, device=flat.device)
    pairs[(block_end - blocks)[expert] * block_m + rank] = order
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=flat.device), right=True)
    return pairs, block_expert


@triton.jit
def _block_pairs(
    block_expert_ptr, pairs_ptr, b, NUM_EXPERTS, NUM_PAIRS, HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr
):
    """Block b's expert (NUM_EXPERTS: the shared one, when fused in) and its padded rows:
    (live, shared, expert for addressing, row ids, pair ids, which rows hold a pair)."""
    e = tl.load(block_expert_ptr + b)
    live = e < NUM_EXPERTS + HAS_SHARED
    r = (b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(pairs_ptr + r)
    return (
        live,
        e == NUM_EXPERTS,
        tl.minimum(e, NUM_EXPERTS - 1).to(tl.int64),
        r,
        pair,
        (pair < NUM_PAIRS) & live,
    )


# e2m1 -> bf16, four packed bytes (eight weights) at a time: each nibble's sign and magnitude bits put
# where a bf16 keeps them (magnitude code c -> bits 6-8: the bf16 of c's value times 2^-126, 0.5 a
# subnormal), then two exact products, by 2^126 and by the block's scale. $4: bytes b0..b3; $5, $6:
# the scale twice per register; $0, $1: the low nibbles (even weights) of b0 b1, b2 b3; $2, $3: the
# high ones (odd weights).
_E2M1_PTX = tl.constexpr("""{
.reg .b32 x, y, t, u, c, z, o;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
mov.b32 o, 0;
prmt.b32 x, $4, o, 0x4140;
prmt.b32 y, $4, o, 0x4342;
shl.b32 t, x, 6; and.b32 t, t, 0x01C001C0; shl.b32 u, x, 12; and.b32 u, u, 0x80008000; or.b32 t, t, u;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $0, t, $5, z;
shl.b32 t, y, 6; and.b32 t, t, 0x01C001C0; shl.b32 u, y, 12; and.b32 u, u, 0x80008000; or.b32 t, t, u;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $1, t, $6, z;
shl.b32 t, x, 2; and.b32 t, t, 0x01C001C0; shl.b32 u, x, 8; and.b32 u, u, 0x80008000; or.b32 t, t, u;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $2, t, $5, z;
shl.b32 t, y, 2; and.b32 t, t, 0x01C001C0; shl.b32 u, y, 8; and.b32 u, u, 0x80008000; or.b32 t, t, u;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $3, t, $6, z;
}""")


@triton.jit
def _e2m1_value(nibble, scale):
    """The plain-Triton twin of _E2M1_PTX for one nibble (int32): its value times scale (fp32)."""
    mag = nibble & 7
    bits = tl.where(mag >= 2, (mag << 6) + 0x3F00, tl.where(mag == 1, 0x3F00, 0)) | ((nibble & 8) << 12)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32) * scale


@triton.jit
def _fp4_halves(packed_rows, scale_rows, nmask, kc, K, GROUPS: tl.constexpr, PTX: tl.constexpr):
    """The weights of columns kc + 2j and kc + 2j + 1 (j < 16 * GROUPS: GROUPS 32-blocks, one ue8m0
    scale each) of each row, bf16 (BLOCK_N, 16 * GROUPS) each: packed_rows points at each row's e2m1
    pairs (K / 2 bytes, the low nibble the even column), scale_rows at its scales (K / 32). A scale's
    value is 2^(raw - 127) for raw 1..254 (0: zero, not 2^-127)."""
    g = kc // 32 + tl.arange(0, GROUPS)
    live = nmask[:, None] & (32 * g < K)[None, :]  # (N, GROUPS)
    j = 16 * g[:, None] + tl.arange(0, 16)[None, :]  # (GROUPS, 16) byte offsets
    byte = tl.load(packed_rows[:, None, None] + j[None, :, :], mask=live[:, :, None], other=0)
    raw = tl.load(scale_rows[:, None] + g[None, :], mask=live, other=127)
    scale = (raw.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)  # 2^(raw - 127), exact
    if PTX:
        s = tl.broadcast_to(scale[:, :, None], byte.shape)
        even, odd = tl.inline_asm_elementwise(
            _E2M1_PTX, "=r,=r,=r,=r,r,r,r", [byte, s], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        b, s = byte.to(tl.int32), scale.to(tl.float32)[:, :, None]
        even = _e2m1_value(b & 15, s).to(tl.bfloat16)
        odd = _e2m1_value(b >> 4, s).to(tl.bfloat16)
    shape: tl.constexpr = (byte.shape[0], 16 * GROUPS)
    return tl.reshape(even, shape), tl.reshape(odd, shape)


@triton.jit
def _fp4_step(acc, x_rows, amask, packed_rows, scale_rows, nmask, kc, K, GROUPS: tl.constexpr,
              FP32: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """acc plus the product of the activations' columns kc..kc + 32 * GROUPS - 1 (x_rows: pointers to
    each row's column 0) and as many MXFP4 weights, the even and the odd columns as two dots."""
    even, odd = _fp4_halves(packed_rows, scale_rows, nmask, kc, K, GROUPS, PTX)
    col = kc + tl.arange(0, 32 * GROUPS)  # one contiguous load, split into even and odd columns
    a = tl.load(x_rows[:, None] + col[None, :], mask=amask[:, None] & (col < K)[None, :], other=0)
    a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], 16 * GROUPS, 2)))
    if FP32:
        acc += tl.dot(a_even, tl.trans(even.to(tl.float32)), input_precision="ieee")
        acc += tl.dot(a_odd, tl.trans(odd.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(a_even, tl.trans(even.to(a_even.dtype)))
        acc += tl.dot(a_odd, tl.trans(odd.to(a_odd.dtype)))
    return acc


@triton.jit
def _dequantize_fp4_kernel(packed_ptr, scale_ptr, out_ptr, ROWS, K, ROWS_PER_SLAB, SLAB_STRIDE,
                           PTX: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                           PDL: tl.constexpr):  # fmt: skip
    """Rows of MXFP4 weights (ROWS, K / 2) packed, (ROWS, K / 32) scales -> bf16 rows of K, row r at
    (r // ROWS_PER_SLAB) * SLAB_STRIDE + (r % ROWS_PER_SLAB) * K (experts into a wider stack)."""
    enter(PDL)
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    kc = tl.program_id(1) * 32 * GROUPS
    nmask = n < ROWS
    even, odd = _fp4_halves(packed_ptr + n * (K // 2), scale_ptr + n * (K // 32), nmask, kc, K, GROUPS, PTX)
    w = tl.reshape(tl.join(even, odd), (BLOCK_N, 32 * GROUPS))  # columns 2j, 2j + 1 side by side
    col = kc + tl.arange(0, 32 * GROUPS)
    row = (n // ROWS_PER_SLAB) * SLAB_STRIDE + (n % ROWS_PER_SLAB) * K
    tl.store(out_ptr + row[:, None] + col[None, :], w, mask=nmask[:, None] & (col < K)[None, :])


FP4_DEQUANTIZE_TILE = (16, 16, 4)  # (rows, 32-blocks, warps) a program: run 76 sweep, 3.6 TB/s


def dequantize_fp4(w: Mxfp4Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 (E, out, in) weight of stacked MXFP4 experts on the GPU (the reference's
    `dequantized`), into `out` (a view of that shape whose rows are contiguous) when given."""
    E, n, k = w.shape
    if out is None:
        out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.packed.device)
    assert out.shape == w.shape and out.dtype == torch.bfloat16 and out.stride()[1:] == (k, 1)
    assert w.packed.is_contiguous() and w.scale.is_contiguous() and k % 32 == 0
    rows, (bn, groups, warps) = E * n, FP4_DEQUANTIZE_TILE
    grid = (triton.cdiv(rows, bn), triton.cdiv(k, 32 * groups))
    _dequantize_fp4_kernel[grid](
        w.packed, w.scale, out, rows, k, n, out.stride(0), PTX=ptx_enabled(out.device), BLOCK_N=bn,
        GROUPS=groups, num_warps=warps, **launch_options(out),
    )  # fmt: skip
    return out


@triton.jit
def _gate_up_kernel(
    x_ptr,
    x_scale_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    sw1_ptr,
    sw3_ptr,
    ss1_ptr,
    ss3_ptr,
    pairs_ptr,
    block_expert_ptr,
    h_ptr,
    ws_ptr,
    counter_ptr,
    NUM_PAIRS,
    NUM_EXPERTS,
    TOPK,
    HIDDEN,
    INTER,
    K_PER_SLICE,
    SPLIT_STRIDE,
    stride_x,
    stride_w1,
    stride_w3,
    limit,
    INT8: tl.constexpr,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    FP32: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SLICES: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One block of pairs x BLOCK_N columns of gate and up, then the clamped SwiGLU into h. HIDDEN is
    summed in SLICES slices of K_PER_SLICE, each from zero, the slices' sums added in order: by this
    program alone (SPLITS 1) or one slice a program (SPLITS == SLICES: fp32 / int32 partials by pair,
    added in the same order by the tile's last program), the same bits either way."""
    enter(PDL)
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    live, shared, ee, r, pair, pmask = _block_pairs(
        block_expert_ptr, pairs_ptr, b, NUM_EXPERTS, NUM_PAIRS, HAS_SHARED, BLOCK_M
    )
    tok = (tl.minimum(pair, NUM_PAIRS - 1) // TOPK).to(tl.int64)
    nmask = n < INTER
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
    w_rows = n.to(tl.int64)[:, None] * HIDDEN
    w1_rows = tl.where(shared, sw1_ptr + w_rows, w1_ptr + ee * stride_w1 + w_rows)
    w3_rows = tl.where(shared, sw3_ptr + w_rows, w3_ptr + ee * stride_w3 + w_rows)
    if FP4:  # packed rows of HIDDEN / 2 bytes, scale rows of HIDDEN / 32 (the shared expert never rides)
        p1 = w1_ptr + ee * stride_w1 + n.to(tl.int64) * (HIDDEN // 2)
        p3 = w3_ptr + ee * stride_w3 + n.to(tl.int64) * (HIDDEN // 2)
        c1 = s1_ptr + (ee * INTER + n.to(tl.int64)) * (HIDDEN // 32)
        c3 = s3_ptr + (ee * INTER + n.to(tl.int64)) * (HIDDEN // 32)
    total_g, total_u = acc_g, acc_u
    first = tl.program_id(2) * (SLICES // SPLITS)  # this program's slices of HIDDEN
    for sl in range(first, first + SLICES // SPLITS):
        k_lo = sl * K_PER_SLICE
        k_hi = tl.where(live, tl.minimum(k_lo + K_PER_SLICE, HIDDEN), k_lo)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
        if not FP4:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < HIDDEN
                amask = pmask[:, None] & kmask[None, :]
                a = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=amask, other=0)
                wmask = nmask[:, None] & kmask[None, :]
                w1 = tl.load(w1_rows + k[None, :], mask=wmask, other=0)
                w3 = tl.load(w3_rows + k[None, :], mask=wmask, other=0)
                if FP32:
                    acc_g += tl.dot(a, tl.trans(w1), input_precision="ieee")
                    acc_u += tl.dot(a, tl.trans(w3), input_precision="ieee")
                else:
                    acc_g += tl.dot(a, tl.trans(w1))
                    acc_u += tl.dot(a, tl.trans(w3))
        if FP4:  # BLOCK_K columns a step: even and odd columns as two dots per matrix
            x_rows = x_ptr + tok * stride_x
            for k0 in range(k_lo, k_hi, BLOCK_K):
                acc_g = _fp4_step(acc_g, x_rows, pmask, p1, c1, nmask, k0, HIDDEN, BLOCK_K // 32, FP32, PTX)
                acc_u = _fp4_step(acc_u, x_rows, pmask, p3, c3, nmask, k0, HIDDEN, BLOCK_K // 32, FP32, PTX)
        total_g += acc_g  # slice by slice: the same sums whether one program or SLICES take the slices
        total_u += acc_u
    acc_g, acc_u = total_g, total_u
    if SPLITS > 1:  # each slice's partial by pair; the tile's last program sums them, then goes on
        cols = pair.to(tl.int64)[:, None] * (2 * INTER) + n[None, :]
        part = pmask[:, None] & nmask[None, :]
        tl.store(ws_ptr + tl.program_id(2) * SPLIT_STRIDE + cols, acc_g, mask=part)
        tl.store(ws_ptr + tl.program_id(2) * SPLIT_STRIDE + cols + INTER, acc_u, mask=part)
        last = arrive_last(counter_ptr, b * tl.num_programs(1) + tl.program_id(1), live, SPLITS)
        acc_g = sum_partials(ws_ptr + cols, part & last, SPLIT_STRIDE, acc_g, SPLITS)
        acc_u = sum_partials(ws_ptr + cols + INTER, part & last, SPLIT_STRIDE, acc_u, SPLITS)
        live = live & last
    if INT8:
        xs = tl.load(x_scale_ptr + tok, mask=pmask, other=0.0)[:, None]
        s1 = tl.load(tl.where(shared, ss1_ptr + n, s1_ptr + ee * INTER + n), mask=nmask, other=0.0)
        s3 = tl.load(tl.where(shared, ss3_ptr + n, s3_ptr + ee * INTER + n), mask=nmask, other=0.0)
        gate = acc_g.to(tl.float32) * xs * s1[None, :]
        up = acc_u.to(tl.float32) * xs * s3[None, :]
    else:
        gate, up = acc_g, acc_u
    gate = tl.minimum(gate.to(DTYPE).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up.to(DTYPE).to(tl.float32), -limit), limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    h = (silu * up).to(DTYPE)
    tl.store(h_ptr + r[:, None] * INTER + n[None, :], h, mask=live & nmask[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    h_scale_ptr,
    w2_ptr,
    s2_ptr,
    sw2_ptr,
    ss2_ptr,
    pairs_ptr,
    block_expert_ptr,
    route_ptr,
    y_ptr,
    ws_ptr,
    counter_ptr,
    NUM_PAIRS,
    NUM_EXPERTS,
    ROUTED,
    HIDDEN,
    INTER,
    K_PER_SLICE,
    SPLIT_STRIDE,
    stride_w2,
    INT8: tl.constexpr,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    FP32: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SLICES: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One block of pairs x BLOCK_N columns of the down projection over its share of INTER's SLICES
    (see `_gate_up_kernel`), then weighted by each pair's routing weight into its row of y."""
    enter(PDL)
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    live, shared, ee, r, pair, pmask = _block_pairs(
        block_expert_ptr, pairs_ptr, b, NUM_EXPERTS, NUM_PAIRS, HAS_SHARED, BLOCK_M
    )
    nmask = n < HIDDEN
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
    w_rows = tl.where(shared, sw2_ptr, w2_ptr + ee * stride_w2) + n.to(tl.int64)[:, None] * INTER
    if FP4:
        p2 = w2_ptr + ee * stride_w2 + n.to(tl.int64) * (INTER // 2)
        c2 = s2_ptr + (ee * HIDDEN + n.to(tl.int64)) * (INTER // 32)
    total = acc
    first = tl.program_id(2) * (SLICES // SPLITS)  # this program's slices of INTER
    for sl in range(first, first + SLICES // SPLITS):
        k_lo = sl * K_PER_SLICE
        k_hi = tl.where(live, tl.minimum(k_lo + K_PER_SLICE, INTER), k_lo)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
        if not FP4:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < INTER
                a = tl.load(
                    h_ptr + r[:, None] * INTER + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0
                )
                w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
                if FP32:
                    acc += tl.dot(a, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(a, tl.trans(w))
        if FP4:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                acc = _fp4_step(
                    acc, h_ptr + r * INTER, pmask, p2, c2, nmask, k0, INTER, BLOCK_K // 32, FP32, PTX
                )
        total += acc
    acc = total
    if SPLITS > 1:  # as in the gate/up kernel
        cols = pair.to(tl.int64)[:, None] * HIDDEN + n[None, :]
        part = pmask[:, None] & nmask[None, :]
        tl.store(ws_ptr + tl.program_id(2) * SPLIT_STRIDE + cols, acc, mask=part)
        last = arrive_last(counter_ptr, b * tl.num_programs(1) + tl.program_id(1), live, SPLITS)
        acc = sum_partials(ws_ptr + cols, part & last, SPLIT_STRIDE, acc, SPLITS)
        pmask = pmask & last
    if INT8:
        hs = tl.load(h_scale_ptr + r, mask=pmask, other=0.0)[:, None]
        s2 = tl.load(tl.where(shared, ss2_ptr + n, s2_ptr + ee * HIDDEN + n), mask=nmask, other=0.0)
        y = acc.to(tl.float32) * hs * s2[None, :]
    else:
        y = acc
    if HAS_SHARED:  # route holds the ROUTED weights per token; the shared pair (slot ROUTED) weighs 1
        slot = pair % (ROUTED + 1)
        w_pair = (pair // (ROUTED + 1)) * ROUTED + slot
        routed = tl.load(route_ptr + w_pair, mask=pmask & (slot < ROUTED), other=0.0).to(tl.float32)
        weight = tl.where(slot < ROUTED, routed, 1.0)[:, None]
    else:
        weight = tl.load(route_ptr + pair, mask=pmask, other=0.0).to(tl.float32)[:, None]
    y = (y.to(DTYPE).to(tl.float32) * weight).to(DTYPE)
    tl.store(y_ptr + pair[:, None] * HIDDEN + n[None, :], y, mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _sum_slots_kernel(
    y_ptr, out_ptr, extra_ptr, HIDDEN, TOPK: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = the sum of token t's TOPK rows in slot order, then (rounded) + extra[t] if HAS_EXTRA:
    torch's `routed + extra`."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < HIDDEN
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * HIDDEN + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        extra = tl.load(extra_ptr + t * HIDDEN + c, mask=mask, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) + extra  # routed rounded, then + extra rounded
    tl.store(out_ptr + t * HIDDEN + c, acc.to(dtype), mask=mask)


def _tiles(num_pairs: int, fp32: bool, int8: bool, fp4: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): 16-row blocks for decode-sized batches (MXFP4
    in bf16: 128 x 64, the best of bench_experts.py's sweep at 64 tokens on the H200, run 73)."""
    if num_pairs <= DECODE_PAIRS:
        if fp4 and not fp32:
            return 16, 128, 64, 4, 3
        return 16, 64, 32 if fp32 else (64 if int8 else 128), 4, 3
    if fp32:
        return 64, 64, 32, 4, 3
    return 128, 128, 64, 8, 3  # the fastest of bench_kernels.py's sweep on the H200


# Decode-sized calls (at most DECODE_PAIRS) sum each K loop in slices, a number fixed by the format and
# the weights' shape (gate/up, down), so that a few tokens' experts can spread over more programs
# (one slice each) when their tiles alone would leave SMs idle, with the same result as one program
# taking every slice: a token's output never depends on how many others share its step. int32 sums
# (W8A8) are exact in any order: always split. bench_experts.py --split-sweep (run 85, H100): MXFP4 at
# one token 0.117 -> 0.082 ms in 4 x 4 slices; int8 at 8 / 64 tokens 0.52 / 2.50 -> 0.44 / 2.09 ms in
# 8 x 4; bf16 (GLM) unchanged by any split.
DECODE_SLICES = {"mxfp4": (4, 4), "int8": (8, 4), "float": (1, 1)}
SPLIT_BELOW = 264  # split the slices over programs when a tile grid has fewer (about two per SM)


def _slices(k_dim: int, block_k: int, wanted: int) -> tuple[int, int]:
    """(slices, K per slice) of a K loop of k_dim in block_k steps: at most `wanted`, each slice at
    least two steps."""
    slices = max(1, min(wanted, k_dim // (2 * block_k)))
    per_slice = triton.cdiv(triton.cdiv(k_dim, slices), block_k) * block_k
    return triton.cdiv(k_dim, per_slice), per_slice


def _split_workspace(
    grid: tuple[int, int, int], rows: int, width: int, like: torch.Tensor, acc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace, arrival counters) of an expert kernel whose grid splits K over grid[2] programs:
    fp32 / int32 partials (splits, rows, width) by pair, a counter per tile; `like` stands in for
    both when nothing splits."""
    if grid[2] == 1:
        return like, like
    ws = torch.empty(grid[2], rows, width, dtype=acc_dtype, device=like.device)
    return ws, arrival_counters(like.device, grid[0] * grid[1])


# prefill-sized bf16 experts through torch._grouped_mm (CUTLASS): 7.6 vs 8.2 ms per layer for 8 x 1024
# tokens on the H200 (benchmarks/bench_kernels.py)
GROUPED_MM_PREFILL = hasattr(torch, "_grouped_mm")
# A shared expert that cannot ride along (official FP8 beside MXFP4 routed experts), decode-sized: its
# clamps, silu and product in one kernel (`_swiglu_rows`) and its output added in the routed experts'
# slot sum, instead of five torch ops a layer. Off: not yet timed on a GPU.
FUSED_SHARED_TAIL = False
# prefill-sized MXFP4 experts: decoded to bf16 per call (a Triton kernel), then torch._grouped_mm
FP4_PREFILL_DEQUANTIZED = True


def prefill_workspace(weights: Mapping[str, Weight]) -> int:
    """Device bytes a prefill-sized step's MXFP4 experts take for a while (FP4_PREFILL_DEQUANTIZED): one
    layer's w1 and w3 decoded to bf16 into one stack, then its w2, all three alive at once (the largest
    stacked MXFP4 weight, three times). Run 86: a KV pool sized without them left an 80 GB GPU short of
    the 12 GiB a 256-expert Flash layer asks."""
    sizes = [math.prod(w.shape) for w in weights.values() if isinstance(w, Mxfp4Weight) and len(w.shape) == 3]
    return 3 * 2 * max(sizes) if sizes and FP4_PREFILL_DEQUANTIZED else 0


def grouped_mm_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts through torch's grouped GEMM (bf16, CUDA sm90): the pairs sorted by expert
    (stable), three grouped GEMMs over the chosen experts only, the clamped SwiGLU between them (one
    kernel, the reference's rounding), then each token's k rows weighted and summed in slot order,
    read back through the inverse permutation (no scatter). No host sync. The shared expert (dense
    GEMMs, the same SwiGLU kernel) is added to each token's sum in the same kernel, rounded as the
    reference's `routed + shared`."""
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # (P,) pairs by expert, token order within one
    counts = torch.zeros(w1.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,) each expert's last row + 1
    rows = x.index_select(0, order // k)  # (P, hidden)
    w13 = gate_up_view(w1, w3)
    if w13 is not None:  # one GEMM of N = 2I: the rows read once
        both = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # (P, 2I)
        gate, up = both[:, : w1.shape[1]], both[:, w1.shape[1] :]
    else:
        gate = torch._grouped_mm(rows, w1.transpose(1, 2), offs=offs)  # (P, I)
        up = torch._grouped_mm(rows, w3.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(
        _swiglu_rows(gate, up, limit), w2.transpose(1, 2), offs=offs
    )  # (P, hidden), by expert
    extra = None if shared is None else _shared_output(x, shared, limit)  # (T, hidden)
    where = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    out = torch.empty_like(x)
    block = min(pow2(x.shape[1]), 1024)
    _sum_pairs_kernel[(T, triton.cdiv(x.shape[1], block))](
        y, where, weights.contiguous(), out, out if extra is None else extra, x.shape[1], TOPK=k,
        HAS_EXTRA=extra is not None, BLOCK=block, num_warps=4, **launch_options(y),
    )  # fmt: skip
    return out


def _shared_output(x: torch.Tensor, shared: tuple[Weight, Weight, Weight], limit: float) -> torch.Tensor:
    """The shared expert computed on its own, (T, hidden) contiguous (the slot sums read row t at
    t * hidden): its two projections, the clamped SwiGLU in one kernel, its down projection."""
    gate_w, down_w, up_w = shared
    out = linear(_swiglu_rows(linear(x, gate_w), linear(x, up_w), limit), down_w)
    assert out.is_contiguous()
    return out


def _swiglu_rows(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The clamped SwiGLU of (rows, I) gate and up projections (rows of one stride), in one kernel."""
    assert gate.shape == up.shape and gate.stride() == up.stride() and gate.stride(-1) == 1
    rows, inter = gate.shape
    h = torch.empty(rows, inter, dtype=gate.dtype, device=gate.device)
    block = min(pow2(inter), 1024)
    _swiglu_kernel[(rows, triton.cdiv(inter, block))](
        gate, up, h, inter, gate.stride(0), limit, BLOCK=block, num_warps=4, **launch_options(gate)
    )
    return h


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, h_ptr, INTER, stride_in, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """h = silu(min(gate, limit)) * clamp(up, -limit, limit), each step rounded to the dtype as torch
    rounds the separate ops."""
    enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < INTER
    g = tl.load(gate_ptr + r * stride_in + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r * stride_in + c, mask=mask, other=0.0).to(tl.float32)
    dtype = h_ptr.dtype.element_ty
    g = tl.minimum(g, limit).to(dtype).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit).to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(h_ptr + r * INTER + c, (silu * u).to(dtype), mask=mask)


@triton.jit
def _sum_pairs_kernel(
    y_ptr, where_ptr, w_ptr, out_ptr, extra_ptr, HIDDEN, TOPK: tl.constexpr, HAS_EXTRA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = sum over slots j, in order, of y[where[t, j]] * w[t, j] (each product rounded), then
    (rounded) + extra[t] if HAS_EXTRA (the shared expert's output)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < HIDDEN
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(where_ptr + t * TOPK + j)
        w = tl.load(w_ptr + t * TOPK + j).to(dtype).to(tl.float32)
        y = tl.load(y_ptr + row * HIDDEN + c, mask=mask, other=0.0).to(tl.float32)
        acc += (y * w).to(dtype).to(tl.float32)
    if HAS_EXTRA:
        extra = tl.load(extra_ptr + t * HIDDEN + c, mask=mask, other=0.0).to(tl.float32)
        acc = acc.to(dtype).to(tl.float32) + extra
    tl.store(out_ptr + t * HIDDEN + c, acc.to(dtype), mask=mask)


def _kind(w: Weight) -> type:
    return torch.Tensor if isinstance(w, torch.Tensor) else type(w)


def _parts(w: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert not isinstance(w, Fp8BlockWeight), (
        "FP8 experts are dequantized at load; FP8 shared ones never fuse"
    )
    if isinstance(w, Int8Weight):
        return w.qweight, w.scale
    return (w.packed, w.scale) if isinstance(w, Mxfp4Weight) else (w, None)


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: Weight,
    w2: Weight,
    w3: Weight,
    limit: float,
    shared: tuple[Weight, Weight, Weight] | None = None,
    *,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chosen experts' SwiGLU outputs, weighted and summed per token, plus the shared expert's.

    The shared expert rides along as expert E (every token's extra pair, weight 1) when its weights
    have the routed ones' format and size: no launches of its own. In the bf16 prefill path
    (`torch._grouped_mm`) it runs as dense GEMMs and the same SwiGLU kernel, added in the un-permute.
    `extra` (T, hidden), decode-sized calls only: added to each token's sum as `routed + extra` rounds.
    """
    T, hidden = x.shape
    num_experts, inter, _ = w1.shape
    assert x.is_contiguous() and ids.shape == weights.shape and w2.shape == (num_experts, hidden, inter)
    int8, fp4 = isinstance(w1, Int8Weight), isinstance(w1, Mxfp4Weight)
    assert int8 == isinstance(w2, Int8Weight) == isinstance(w3, Int8Weight)
    assert fp4 == isinstance(w2, Mxfp4Weight) == isinstance(w3, Mxfp4Weight)
    # the shared expert rides along as expert E in the routed experts' format (FP4 kernels: routed only)
    fused = (
        shared is not None
        and not fp4
        and all(
            _kind(s) is _kind(w) and s.shape[-2:] == w.shape[1:]
            for s, w in zip(shared, (w1, w2, w3), strict=True)
        )
    )
    if T == 0:
        return torch.zeros_like(x)
    fp32 = x.dtype == torch.float32
    big = T * ids.shape[1] > DECODE_PAIRS
    assert extra is None or (not big and shared is None and extra.shape == x.shape and extra.is_contiguous())
    prefill_mm = GROUPED_MM_PREFILL and big and x.dtype == torch.bfloat16 and x.is_cuda
    plain_shared = shared is None or all(isinstance(s, torch.Tensor) for s in shared)
    if prefill_mm and fp4 and FP4_PREFILL_DEQUANTIZED and plain_shared:  # W4A16 on bf16 tensor cores
        assert isinstance(w1, Mxfp4Weight) and isinstance(w2, Mxfp4Weight) and isinstance(w3, Mxfp4Weight)
        e, inter, _ = w1.shape  # w1 and w3 decoded into one stack: one grouped GEMM of N = 2I
        both = torch.empty(e, 2 * inter, hidden, dtype=torch.bfloat16, device=x.device)
        d1, d3 = dequantize_fp4(w1, both[:, :inter]), dequantize_fp4(w3, both[:, inter:])
        return grouped_mm_experts(x, weights, ids, d1, dequantize_fp4(w2), d3, limit, shared)  # type: ignore[arg-type]
    prefill_mm = prefill_mm and not int8 and not fp4
    if prefill_mm and plain_shared:
        assert isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and isinstance(w3, torch.Tensor)
        return grouped_mm_experts(x, weights, ids, w1, w2, w3, limit, shared)  # type: ignore[arg-type]
    if shared is not None and (not fused or prefill_mm):  # computed on its own, then added
        if FUSED_SHARED_TAIL and not big:  # its SwiGLU one kernel, its sum in the routed slot sum
            own = _shared_output(x, shared, limit)
            return routed_experts(x, weights, ids, w1, w2, w3, limit, extra=own)
        return routed_experts(x, weights, ids, w1, w2, w3, limit) + swiglu(
            x, *shared, limit=limit, matmul=linear
        )
    # the shared expert: expert E, every token's pair k + 1 with weight 1 (the kernels add it)
    routed = ids.shape[1]
    top_k = routed + (shared is not None)
    num_pairs = T * top_k
    bm, bn, bk, warps, stages = _tiles(num_pairs, fp32, int8, fp4)
    pairs, block_expert = align(ids, num_experts + (shared is not None), bm, shared=shared is not None)
    num_blocks = block_expert.numel()
    h = torch.empty(num_blocks * bm, inter, dtype=x.dtype, device=x.device)
    a, a_scale = quantize_rows(x) if int8 else (x, x)
    (q1, s1), (q3, s3) = _parts(w1), _parts(w3)
    (sq1, ss1), (sq3, ss3) = (
        (_parts(shared[0]), _parts(shared[2])) if shared is not None else ((q1, s1), (q3, s3))
    )
    row = hidden // 2 if fp4 else hidden
    for w in (q1, q3, sq1, sq3):
        assert w.stride(-1) == 1 and w.stride(-2) == row, "experts: rows of each expert contiguous"
    assert not fp4 or (hidden % 32 == 0 and inter % 32 == 0), "MXFP4: whole 32-blocks"
    for s in (s1, s3) if fp4 else ():
        assert s is not None and s.is_contiguous(), "MXFP4 experts: scales (E, out, in / 32) contiguous"
    scaled, ptx = int8 or fp4, fp4 and ptx_enabled(x.device)
    acc_dtype = torch.int32 if int8 else torch.float32
    decode = num_pairs <= DECODE_PAIRS  # as `_tiles` decides
    wanted = DECODE_SLICES["int8" if int8 else "mxfp4" if fp4 else "float"] if decode else (1, 1)
    tiles_live = min(num_pairs, num_experts + (shared is not None))  # at most one block each, when few
    slices, per_slice = _slices(hidden, bk, wanted[0])
    split = int8 or tiles_live * triton.cdiv(inter, bn) < SPLIT_BELOW  # int32 sums: exact in any order
    grid = (num_blocks, triton.cdiv(inter, bn), slices if split else 1)
    ws, counters = _split_workspace(grid, num_pairs, 2 * inter, h, acc_dtype)
    _gate_up_kernel[grid](
        a, a_scale, q1, q3, s1 if scaled else a, s3 if scaled else a, sq1, sq3, ss1 if int8 else a,
        ss3 if int8 else a, pairs, block_expert, h, ws, counters, num_pairs, num_experts, top_k, hidden,
        inter, per_slice, num_pairs * 2 * inter, a.stride(0), q1.stride(0), q3.stride(0), limit,
        INT8=int8, FP4=fp4, PTX=ptx, FP32=fp32, HAS_SHARED=shared is not None, SLICES=slices, SPLITS=grid[2],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, **launch_options(a),
    )  # fmt: skip
    del ws
    a2, a2_scale = quantize_rows(h) if int8 else (h, h)
    q2, s2 = _parts(w2)
    sq2, ss2 = _parts(shared[1]) if shared is not None else (q2, s2)
    assert q2.stride(-1) == 1 and q2.stride(-2) == (inter // 2 if fp4 else inter) and sq2.stride(-1) == 1
    assert s2 is None or s2.is_contiguous()
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    slices, per_slice = _slices(inter, bk, wanted[1])
    split = int8 or tiles_live * triton.cdiv(hidden, bn) < SPLIT_BELOW
    grid = (num_blocks, triton.cdiv(hidden, bn), slices if split else 1)
    ws, counters = _split_workspace(grid, num_pairs, hidden, y, acc_dtype)
    _down_kernel[grid](
        a2, a2_scale, q2, s2 if scaled else a2, sq2, ss2 if int8 else a2, pairs, block_expert,
        weights.contiguous(), y, ws, counters, num_pairs, num_experts, routed, hidden, inter, per_slice,
        num_pairs * hidden, q2.stride(0),
        INT8=int8, FP4=fp4, PTX=ptx, FP32=fp32, HAS_SHARED=shared is not None, SLICES=slices, SPLITS=grid[2],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages, **launch_options(a2),
    )  # fmt: skip
    out = torch.empty_like(x)
    block = min(pow2(hidden), 1024)
    _sum_slots_kernel[(T, triton.cdiv(hidden, block))](
        y, out, out if extra is None else extra, hidden, TOPK=top_k, HAS_EXTRA=extra is not None, BLOCK=block,
        num_warps=4, **launch_options(y),
    )  # fmt: skip
    return out
