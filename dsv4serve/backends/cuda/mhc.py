"""Triton mHC kernels (the contracts of `mhc.hc_pre` / `mhc.hc_post`).

hc_pre runs as two kernels: `_mix_partials` splits the fp32 GEMV `h_flat @ fn^T` (and the sum of
squares of h_flat) over K-slices; `_hc_pre_epilogue` sums the slices in a fixed order, applies the
sigmoids and the Sinkhorn iterations, collapses the streams and RMSNorms the block input (for steps of
up to 16 tokens the Sinkhorn in a program of its own beside the collapse's: two latency chains side
by side). The number of K-slices comes in three classes of step size: MAX_SPLITS for steps of up to
16 tokens (a single decode token keeps many SMs busy; the result never depends on the batch),
MID_SPLITS below LARGE_STEP tokens, LARGE_SPLITS above (at 8 x 1024 tokens 128 slices wrote a
workspace half the size of the streams). The epilogue's tile of slices follows the class, so at most
three variants compile.
hc_post is one elementwise kernel with the reference's rounding steps. hc_head (the final collapse and
the last norm) runs hc_pre's two kernels with the pre weights only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2
from dsv4serve.layers.mhc import HcParams, HyperConnection

BLOCK_K = 128
MAX_SPLITS = 128  # K-slices of the mixes GEMV: a single decode token still spreads over 128 programs
MIX_ROWS = 32  # (2 + hc) * hc = 24 mixes, padded; the last column carries the sum of squares
MID_SPLITS = 32  # steps of 17 .. LARGE_STEP - 1 tokens
LARGE_STEP = 2048
LARGE_SPLITS = 8  # at 8 x 1024 tokens: 64 token tiles x 8 slices (the H200 sweep, run 13)
PREFILL_TILES = (128, 64, 8)  # steps of more than 16 tokens: BLOCK_T, BLOCK_K, warps (H200 sweep, run 30)


@triton.jit
def _mix_partials_kernel(
    h_ptr,
    fn_ptr,
    ws_ptr,
    T,
    K,
    K_PER_SPLIT,
    NUM_MIX,
    stride_ht,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MIX_ROWS: tl.constexpr,
    BF16: tl.constexpr,  # h in bf16: three bf16 products with fn cut in three bf16 pieces
    PDL: tl.constexpr,
):
    """ws[s, t, :NUM_MIX] = h[t, k-slice s] @ fn[:, k-slice s]^T; ws[s, t, MIX_ROWS - 1] = sum h^2.

    fp32-accurate on the tensor cores: a bf16 h is exact in bf16, so fn = hi + mid + lo (each bf16, 24
    bits of fn in all) gives three exact bf16 products summed in fp32, at half the cost of tf32x3's
    three tf32 ones (which float h needs)."""
    enter(PDL)
    tb = tl.program_id(0)
    s = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    r = tl.arange(0, MIX_ROWS)
    rmask = r < NUM_MIX
    acc = tl.zeros((BLOCK_T, MIX_ROWS), tl.float32)
    small = tl.zeros((BLOCK_T, MIX_ROWS), tl.float32)  # the bf16 path's products of fn's low pieces
    sumsq = tl.zeros((BLOCK_T,), tl.float32)
    k_lo = s * K_PER_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        hmask = tmask[:, None] & kmask[None, :]
        h = tl.load(h_ptr + t.to(tl.int64)[:, None] * stride_ht + k[None, :], mask=hmask, other=0.0)
        fn = tl.load(fn_ptr + r[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if BF16:
            hi = fn.to(tl.bfloat16)
            rest = fn - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(h, tl.trans(hi), acc)
            small = tl.dot(h, tl.trans(mid), small)  # apart: the MMA's adder drops what is far below acc
            small = tl.dot(h, tl.trans(lo), small)
            h = h.to(tl.float32)
        else:
            h = h.to(tl.float32)
            acc += tl.dot(h, tl.trans(fn), input_precision="tf32x3")
        sumsq += tl.sum(h * h, axis=1)
    if BF16:
        acc += small
    acc = tl.where(r[None, :] == MIX_ROWS - 1, sumsq[:, None], acc)
    dst = ws_ptr + (s * T + t.to(tl.int64))[:, None] * MIX_ROWS + r[None, :]
    tl.store(dst, acc, mask=tmask[:, None])


@triton.jit
def _post_comb(part, smask, rs, base_ptr, scale_ptr, post_ptr, comb_ptr, t, hc_eps, ITERS: tl.constexpr,
               HC: tl.constexpr):  # fmt: skip
    """A token's post weights and its Sinkhorn-normalised comb from the summed mixes, stored."""
    n = tl.arange(0, HC)
    post_w = tl.sum(tl.load(part[:, None] + HC + n[None, :], mask=smask[:, None], other=0.0), axis=0)
    cm = 2 * HC + n[:, None] * HC + n[None, :]  # (HC, HC): row m, column n of comb
    comb_w = tl.sum(
        tl.load(part[:, None, None] + cm[None, :, :], mask=smask[:, None, None], other=0.0), axis=0
    )
    post = 2.0 * tl.sigmoid(post_w * rs * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + n))
    logits = comb_w * rs * tl.load(scale_ptr + 2) + tl.load(base_ptr + cm)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + t * HC + n, post)
    tl.store(comb_ptr + t * HC * HC + n[:, None] * HC + n[None, :], comb)


@triton.jit
def _hc_pre_epilogue_kernel(
    h_ptr,
    ws_ptr,
    base_ptr,
    scale_ptr,
    norm_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    T,
    D,
    K,
    SPLITS,
    stride_ht,
    stride_hn,
    norm_eps,
    hc_eps,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    BLOCK_S: tl.constexpr,
    MIX_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD: tl.constexpr,  # the head's collapse: pre weights only (no post, no comb), one scale
    ROLES: tl.constexpr,  # 2: the Sinkhorn in a program of its own beside the collapse's; 1: one program
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    DTYPE = h_ptr.dtype.element_ty
    n = tl.arange(0, HC)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < SPLITS
    part = ws_ptr + (sp * T + t) * MIX_ROWS  # (BLOCK_S,): the K-slices' partials, summed as one tile
    sumsq = tl.sum(tl.load(part + MIX_ROWS - 1, mask=smask, other=0.0), axis=0)
    rs = tl.rsqrt(sumsq / K + norm_eps)  # the RMS of the flat streams
    if not HEAD:
        if ROLES == 1:  # one program per token: the Sinkhorn, then the collapse (straight-line code)
            _post_comb(part, smask, rs, base_ptr, scale_ptr, post_ptr, comb_ptr, t, hc_eps, ITERS, HC)
        elif tl.program_id(1) == 0:  # the Sinkhorn's own program; program 1 collapses
            _post_comb(part, smask, rs, base_ptr, scale_ptr, post_ptr, comb_ptr, t, hc_eps, ITERS, HC)
            return
    pre_w = tl.sum(tl.load(part[:, None] + n[None, :], mask=smask[:, None], other=0.0), axis=0)
    pre = tl.sigmoid(pre_w * rs * tl.load(scale_ptr) + tl.load(base_ptr + n)) + hc_eps
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    hs = tl.load(h_ptr + t * stride_ht + n[:, None] * stride_hn + d[None, :], mask=dmask[None, :], other=0.0)
    collapsed = tl.sum(pre[:, None] * hs.to(tl.float32), axis=0).to(DTYPE).to(tl.float32)  # (BLOCK_D,)
    scale = tl.rsqrt(tl.sum(collapsed * collapsed, axis=0) / D + norm_eps)
    w = tl.load(norm_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(x_ptr + t * D + d, (w * (collapsed * scale)).to(x_ptr.dtype.element_ty), mask=dmask)


def hc_pre(
    h: torch.Tensor, hc: HyperConnection, norm_weight: torch.Tensor, p: HcParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, n, D = h.shape
    assert hc.fn.shape == ((2 + n) * n, n * D), hc.fn.shape
    post = torch.empty(T, n, dtype=torch.float32, device=h.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=h.device)
    return _collapse(h, hc, norm_weight, p, post, comb), post, comb


def hc_head(h: torch.Tensor, hc: HyperConnection, norm_weight: torch.Tensor, p: HcParams) -> torch.Tensor:
    """The head's collapse + the last norm (the contract of `mhc.hc_head_norm`): hc_pre's kernels
    with the pre weights only."""
    _, n, D = h.shape
    assert hc.fn.shape == (n, n * D) and hc.scale.numel() == 1, (hc.fn.shape, hc.scale.shape)
    return _collapse(h, hc, norm_weight, p, None, None)


def _collapse(
    h: torch.Tensor,
    hc: HyperConnection,
    norm_weight: torch.Tensor,
    p: HcParams,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
) -> torch.Tensor:
    """The normed block input (T, hidden); fills post and comb unless this is the head (both None)."""
    T, n, D = h.shape
    head = post is None
    assert n == p.mult and n & (n - 1) == 0 and (2 + n) * n < MIX_ROWS, n
    assert h.stride(-1) == 1 and h.stride(1) == D, "streams must be contiguous per token"
    assert hc.fn.dtype == torch.float32 and hc.fn.is_contiguous()
    x = torch.empty(T, D, dtype=h.dtype, device=h.device)
    if T == 0:
        return x
    K = n * D
    block_t, block_k, warps = (16, BLOCK_K, 4) if T <= 16 else PREFILL_TILES
    splits = MAX_SPLITS if T <= 16 else MID_SPLITS if T < LARGE_STEP else LARGE_SPLITS
    splits = min(splits, triton.cdiv(K, BLOCK_K))
    per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, per_split)
    ws = torch.empty(splits, T, MIX_ROWS, dtype=torch.float32, device=h.device)
    _mix_partials_kernel[(triton.cdiv(T, block_t), splits)](
        h, hc.fn, ws, T, K, per_split, hc.fn.shape[0], h.stride(0),
        BLOCK_T=block_t, BLOCK_K=block_k, MIX_ROWS=MIX_ROWS, BF16=h.dtype == torch.bfloat16, num_warps=warps,
        **launch_options(h),
    )  # fmt: skip
    # decode-sized steps run the Sinkhorn beside the collapse (latency: 75 -> 60 us for 9 calls of a
    # batch-1 step, run 32); larger ones in the same program (at 8 x 1024 two roles cost 0.89 -> 1.08 ms)
    roles = 1 if head or T > 16 else 2
    _hc_pre_epilogue_kernel[(T, roles)](
        h, ws, hc.base, hc.scale, norm_weight, x, x if post is None else post, x if comb is None else comb,
        T, D, K, splits, h.stride(0), h.stride(1), p.norm_eps, p.eps, ITERS=p.sinkhorn_iters, HC=n,
        BLOCK_S=pow2(splits), MIX_ROWS=MIX_ROWS, BLOCK_D=pow2(D), HEAD=head, ROLES=roles,
        num_warps=8, **launch_options(h),  # the collapse over hidden dominates: one warp was 3x slower
    )  # fmt: skip
    return x


@triton.jit
def _hc_post_kernel(
    out_ptr,
    h_ptr,
    post_ptr,
    comb_ptr,
    new_ptr,
    D,
    stride_ot,
    stride_ht,
    stride_hn,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """new[t, n] = post[t, n] * out[t] + sum_m comb[t, m, n] * h[t, m], rounded as the reference."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dmask = d < D
    DTYPE = h_ptr.dtype.element_ty
    m = tl.arange(0, HC)
    out = tl.load(out_ptr + t * stride_ot + d, mask=dmask, other=0.0).to(tl.float32)
    hs = tl.load(h_ptr + t * stride_ht + m[:, None] * stride_hn + d[None, :], mask=dmask[None, :], other=0.0)
    hs = hs.to(tl.float32)
    for n in tl.static_range(HC):
        p = tl.load(post_ptr + t * HC + n).to(DTYPE).to(tl.float32)
        c = tl.load(comb_ptr + t * HC * HC + m * HC + n).to(DTYPE).to(tl.float32)  # column n
        mixed = tl.sum(c[:, None] * hs, axis=0).to(DTYPE).to(tl.float32)
        value = ((p * out).to(DTYPE).to(tl.float32) + mixed).to(new_ptr.dtype.element_ty)
        tl.store(new_ptr + t * stride_ht + n * stride_hn + d, value, mask=dmask)


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    T, n, D = h.shape
    assert out.shape == (T, D) and out.stride(-1) == 1 and h.is_contiguous()
    assert post.is_contiguous() and comb.is_contiguous() and post.dtype == comb.dtype == torch.float32
    new = torch.empty_like(h)
    if T:
        block = min(pow2(D), 1024)
        _hc_post_kernel[(T, triton.cdiv(D, block))](
            out,
            h,
            post,
            comb,
            new,
            D,
            out.stride(0),
            h.stride(0),
            h.stride(1),
            HC=n,
            BLOCK=block,
            num_warps=4,
            **launch_options(out),
        )
    return new
