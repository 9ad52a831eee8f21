"""Triton kernels of the norm and rope op families: RMSNorm, per-head norm + rope, rope, and the fused
K=V norm + rope + SWA-pool write. Same signatures and rounding steps as the reference
(`attention/core.py`, `attention/dsv4.py`): norms in fp32, the normed value rounded to the
activation dtype before the rope, the rope in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.attention.step import StepMeta
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2

NONE, UNWEIGHTED, WEIGHTED = 0, 1, 2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    N,
    stride_x,
    stride_d,
    stride_o,
    stride_s,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row's RMSNorm; with ADD, of x + d (stored, rounded to x's dtype first, as torch's add)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * (x * scale)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim, fp32 inside, x's dtype out."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its weighted RMSNorm) in one kernel: the sum as torch rounds it, then normed."""
    assert delta.shape == x.shape and delta.dtype == x.dtype, (delta.shape, x.shape, delta.dtype, x.dtype)
    return _norm(x, delta, weight, eps)


def _norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its norm); without delta, (the norm, the norm): one tensor, the kernel's only output."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    assert rows.stride(-1) == 1 and weight.shape == (n,) and weight.is_contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    adds = delta.reshape(-1, n) if delta is not None else rows
    assert adds.stride(-1) == 1
    total = torch.empty_like(out) if delta is not None else out
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            adds,
            weight,
            out,
            total,
            n,
            rows.stride(0),
            adds.stride(0),
            out.stride(0),
            total.stride(0),
            eps,
            ADD=delta is not None,
            BLOCK=pow2(n),
            num_warps=4,
            **launch_options(rows),
        )
    return total.view(x.shape), out.view(x.shape)


@triton.jit
def _normed(x, w_ptr, offs, mask, scale, NORM: tl.constexpr, DTYPE: tl.constexpr):
    """x (fp32 loads) normed as the reference does it, rounded to the activation dtype."""
    if NORM == 1:
        return (x * scale.to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    if NORM == 2:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return (w * (x * scale)).to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    table_ptr,
    row_ptr,
    pos_ptr,
    R,
    D,
    HALF,
    stride_xt,
    stride_xr,
    stride_ot,
    stride_or,
    stride_cos,
    table_stride,
    eps,
    sign,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_R (token, head) rows of D channels: optional norm, then rope on the trailing 2*HALF
    channels (interleaved pairs, read as one contiguous slice and split in registers).

    STORE: the row goes to the pool slot table[row[t], pos[t]] (stride_ot is the pool's row stride).
    """
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    DTYPE = x_ptr.dtype.element_ty
    src = x_ptr + t * stride_xt + r.to(tl.int64)[:, None] * stride_xr
    d = tl.arange(0, BLOCK_D)[None, :]
    x = tl.load(src + d, mask=rmask[:, None] & (d < D), other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)[:, None]
    scale = ss  # unused without a norm (no rsqrt of the masked rows' zeros)
    if NORM != 0:
        scale = tl.rsqrt(ss / D + eps)
    y = _normed(x, w_ptr, d, d < D, scale, NORM, DTYPE)
    if STORE:
        slot = tl.load(table_ptr + tl.load(row_ptr + t).to(tl.int64) * table_stride + tl.load(pos_ptr + t))
        dst = out_ptr + slot.to(tl.int64) * stride_ot + r.to(tl.int64)[:, None] * 0
    else:
        dst = out_ptr + t * stride_ot + r.to(tl.int64)[:, None] * stride_or
    tl.store(dst + d, y.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D - 2 * HALF))
    j = D - 2 * HALF + tl.arange(0, 2 * BLOCK_HALF)[None, :]  # the rope slice, pairs (even, odd)
    jmask = rmask[:, None] & (j < D)
    xr = _normed(tl.load(src + j, mask=jmask, other=0.0).to(tl.float32), w_ptr, j, j < D, scale, NORM, DTYPE)
    xe, xo = tl.split(tl.reshape(xr, (BLOCK_R, BLOCK_HALF, 2)))
    i = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + t * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * stride_cos + i, mask=i < HALF, other=0.0)[None, :] * sign
    re = (xe * c - xo * s).to(DTYPE)  # the reference rounds the rotated pairs to x's dtype
    ro = (xo * c + xe * s).to(DTYPE)
    rotated = tl.reshape(tl.join(re, ro), (BLOCK_R, 2 * BLOCK_HALF))
    tl.store(dst + j, rotated.to(out_ptr.dtype.element_ty), mask=jmask)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    meta: StepMeta,
    compress: bool,
    eps: float,
    norm: int,
    sign: float,
    pool: torch.Tensor | None = None,
) -> torch.Tensor:
    T, D = x.shape[0], x.shape[-1]
    rows = x.reshape(T, -1, D)  # (T, R, D)
    assert rows.stride(-1) == 1
    cos, sin = meta.rope[compress]
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[0] == T
    half = cos.shape[-1]
    table = meta.tables.window
    if pool is None:
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        strides = (out.stride(0), out.stride(1))
    else:
        assert pool.stride(-1) == 1 and pool.shape[-1] == D and rows.shape[1] == 1
        out, strides = pool, (pool.stride(0), 0)
    block_d, R = pow2(D), rows.shape[1]
    block_r = min(pow2(R), max(1, 4096 // block_d))  # ~4k channels per program
    if T:
        _norm_rope_kernel[(T, triton.cdiv(R, block_r))](
            rows,
            weight if weight is not None else rows,
            cos,
            sin,
            out,
            table,
            meta.token_row,
            meta.positions,
            R,
            D,
            half,
            rows.stride(0),
            rows.stride(1),
            *strides,
            cos.stride(0),
            table.stride(0),
            eps,
            sign,
            NORM=norm,
            STORE=pool is not None,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            BLOCK_HALF=pow2(half),
            num_warps=4 if block_r * block_d >= 512 else 1,
            **launch_options(rows),
        )
    return out.view(x.shape) if pool is None else pool


def rope(x: torch.Tensor, meta: StepMeta, compress: bool, inverse: bool = False) -> torch.Tensor:
    return _launch(x, None, meta, compress, 0.0, NONE, -1.0 if inverse else 1.0)


def q_norm_rope(q: torch.Tensor, meta: StepMeta, compress: bool, eps: float) -> torch.Tensor:
    return _launch(q, None, meta, compress, eps, UNWEIGHTED, 1.0)


def kv_norm_rope_store(
    kv: torch.Tensor, weight: torch.Tensor, swa: torch.Tensor, meta: StepMeta, compress: bool, eps: float
) -> None:
    assert weight.is_contiguous() and kv.dim() == 2
    _launch(kv, weight, meta, compress, eps, WEIGHTED, 1.0, pool=swa)
