"""Triton routed experts: a grouped GEMM over the chosen experts only (the contract of
`experts.routed_experts_reference`), float, W8A8 int8 or MXFP4 (W4A16).

1. align (torch ops, fixed shapes, no host sync): the T*k (token, slot) pairs sorted by expert (stable),
   each expert's run padded to a multiple of BLOCK_M; every block of BLOCK_M pairs has one expert.
2. gate/up: per block, x rows of its pairs times W1[e] and W3[e], the clamped SwiGLU in the epilogue.
3. down: per block, times W2[e], scaled by each pair's routing weight, one row per pair.
4. reduce: each token sums its k rows in slot order (fixed: the result never depends on the batch).
Blocks past the last real one (the grid is sized for the worst case) do nothing. int8 quantizes x per
token and the SwiGLU output per pair (the reference's per-row activation quantization). MXFP4 decodes
each weight tile in registers (e2m1 pairs times their power-of-two scale: exact in bf16), then runs
the float path's products: the bytes read are a quarter of bf16's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.backends.cuda.linear import linear, quantize_rows
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2
from dsv4serve.layers.linear import Fp8BlockWeight, Int8Weight, Mxfp4Weight, Weight
from dsv4serve.moe.experts import gate_up_view, swiglu

SMALL_ALIGN = 1024  # at most this many pairs: align in one Triton program instead of a dozen torch ops


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


@triton.jit
def _e2m1(code):
    """e2m1 codes (0..15, bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa) -> fp32."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e, 1) - 1).to(tl.float32))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _fp4_tile(packed_rows, scale_rows, nmask, k0, K, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_K) weights of columns k0.. decoded: packed_rows (BLOCK_N,) pointers to each row's
    e2m1 pairs (K / 2 bytes, low nibble first), scale_rows to its ue8m0 exponents (one per 32)."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(packed_rows[:, None] + j[None, :], mask=nmask[:, None] & (2 * j < K)[None, :], other=0)
    pairs = tl.join(_e2m1(byte & 15), _e2m1(byte >> 4))  # (N, K / 2, 2): elements 2j, 2j + 1
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    raw = tl.load(scale_rows[:, None] + g[None, :], mask=nmask[:, None] & (32 * g < K)[None, :], other=127)
    raw = raw.to(tl.int32)
    scale = (raw << 23).to(tl.float32, bitcast=True)  # 2^(raw - 127), exact
    scale = tl.where(raw == 0, 5.877471754111438e-39, tl.where(raw == 255, float("nan"), scale))
    w = tl.reshape(pairs, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DTYPE)


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
    NUM_PAIRS,
    NUM_EXPERTS,
    TOPK,
    HIDDEN,
    INTER,
    stride_x,
    stride_w1,
    stride_w3,
    limit,
    INT8: tl.constexpr,
    FP4: tl.constexpr,
    FP32: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
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
    for k0 in range(0, tl.where(live, HIDDEN, 0), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < HIDDEN
        a = tl.load(
            x_ptr + tok[:, None] * stride_x + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0
        )
        if FP4:
            w1 = _fp4_tile(p1, c1, nmask, k0, HIDDEN, DTYPE, BLOCK_N, BLOCK_K)
            w3 = _fp4_tile(p3, c3, nmask, k0, HIDDEN, DTYPE, BLOCK_N, BLOCK_K)
        else:
            wmask = nmask[:, None] & kmask[None, :]
            w1 = tl.load(w1_rows + k[None, :], mask=wmask, other=0)
            w3 = tl.load(w3_rows + k[None, :], mask=wmask, other=0)
        if FP32:
            acc_g += tl.dot(a, tl.trans(w1), input_precision="ieee")
            acc_u += tl.dot(a, tl.trans(w3), input_precision="ieee")
        else:
            acc_g += tl.dot(a, tl.trans(w1))
            acc_u += tl.dot(a, tl.trans(w3))
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
    NUM_PAIRS,
    NUM_EXPERTS,
    ROUTED,
    HIDDEN,
    INTER,
    stride_w2,
    INT8: tl.constexpr,
    FP4: tl.constexpr,
    FP32: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
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
    for k0 in range(0, tl.where(live, INTER, 0), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < INTER
        a = tl.load(h_ptr + r[:, None] * INTER + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0)
        if FP4:
            w = _fp4_tile(p2, c2, nmask, k0, INTER, DTYPE, BLOCK_N, BLOCK_K)
        else:
            w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        if FP32:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
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
def _sum_slots_kernel(y_ptr, out_ptr, HIDDEN, TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < HIDDEN
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * HIDDEN + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * HIDDEN + c, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(num_pairs: int, fp32: bool, int8: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): 16-row blocks for decode-sized batches."""
    if num_pairs <= 2048:
        return 16, 64, 32 if fp32 else (64 if int8 else 128), 4
    if fp32:
        return 64, 64, 32, 4
    return 128, 128, 64, 8  # the fastest of bench_kernels.py's sweep on the H200


# prefill-sized bf16 experts through torch._grouped_mm (CUTLASS): 7.6 vs 8.2 ms per layer for 8 x 1024
# tokens on the H200 (benchmarks/bench_kernels.py)
GROUPED_MM_PREFILL = hasattr(torch, "_grouped_mm")


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
    extra = None
    if shared is not None:
        s1, s2, s3 = shared
        extra = linear(_swiglu_rows(linear(x, s1), linear(x, s3), limit), s2)  # (T, hidden)
        assert extra.is_contiguous()  # the kernel reads row t at t * hidden
    where = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    out = torch.empty_like(x)
    block = min(pow2(x.shape[1]), 1024)
    _sum_pairs_kernel[(T, triton.cdiv(x.shape[1], block))](
        y, where, weights.contiguous(), out, out if extra is None else extra, x.shape[1], TOPK=k,
        HAS_EXTRA=extra is not None, BLOCK=block, num_warps=4, **launch_options(y),
    )  # fmt: skip
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
) -> torch.Tensor:
    """The chosen experts' SwiGLU outputs, weighted and summed per token, plus the shared expert's.

    The shared expert rides along as expert E (every token's extra pair, weight 1) when its weights
    have the routed ones' format and size: no launches of its own. In the bf16 prefill path
    (`torch._grouped_mm`) it runs as dense GEMMs and the same SwiGLU kernel, added in the un-permute.
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
    prefill_mm = GROUPED_MM_PREFILL and T * ids.shape[1] > 2048 and x.dtype == torch.bfloat16 and x.is_cuda
    prefill_mm = prefill_mm and not int8 and not fp4
    plain_shared = shared is None or all(isinstance(s, torch.Tensor) for s in shared)
    if prefill_mm and plain_shared:
        assert isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and isinstance(w3, torch.Tensor)
        return grouped_mm_experts(x, weights, ids, w1, w2, w3, limit, shared)  # type: ignore[arg-type]
    if shared is not None and (not fused or prefill_mm):  # computed on its own, then added
        return routed_experts(x, weights, ids, w1, w2, w3, limit) + swiglu(
            x, *shared, limit=limit, matmul=linear
        )
    # the shared expert: expert E, every token's pair k + 1 with weight 1 (the kernels add it)
    routed = ids.shape[1]
    top_k = routed + (shared is not None)
    num_pairs = T * top_k
    bm, bn, bk, warps = _tiles(num_pairs, fp32, int8)
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
    for s in (s1, s3) if fp4 else ():
        assert s is not None and s.is_contiguous(), "MXFP4 experts: scales (E, out, in / 32) contiguous"
    scaled = int8 or fp4
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        a, a_scale, q1, q3, s1 if scaled else a, s3 if scaled else a, sq1, sq3, ss1 if int8 else a,
        ss3 if int8 else a, pairs, block_expert, h, num_pairs, num_experts, top_k, hidden, inter,
        a.stride(0), q1.stride(0), q3.stride(0), limit,
        INT8=int8, FP4=fp4, FP32=fp32, HAS_SHARED=shared is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=3, **launch_options(a),
    )  # fmt: skip
    a2, a2_scale = quantize_rows(h) if int8 else (h, h)
    q2, s2 = _parts(w2)
    sq2, ss2 = _parts(shared[1]) if shared is not None else (q2, s2)
    assert q2.stride(-1) == 1 and q2.stride(-2) == (inter // 2 if fp4 else inter) and sq2.stride(-1) == 1
    assert s2 is None or s2.is_contiguous()
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        a2, a2_scale, q2, s2 if scaled else a2, sq2, ss2 if int8 else a2, pairs, block_expert,
        weights.contiguous(), y, num_pairs, num_experts, routed, hidden, inter, q2.stride(0),
        INT8=int8, FP4=fp4, FP32=fp32, HAS_SHARED=shared is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=3, **launch_options(a2),
    )  # fmt: skip
    out = torch.empty_like(x)
    block = min(pow2(hidden), 1024)
    _sum_slots_kernel[(T, triton.cdiv(hidden, block))](
        y, out, hidden, TOPK=top_k, BLOCK=block, num_warps=4, **launch_options(y)
    )
    return out
