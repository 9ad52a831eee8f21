"""GLM's fused split + norm (the contract of `attention/mla.qkv_split_norm`) as Triton source every
Triton backend compiles: the CUDA backend (with its launch options, PDL) and the npu backend through
triton-ascend (plain launches; one program per token, within its 65,535 programs).

One program per token reads its row of the `q_a_proj | kv_a_proj_with_mqa` output once and writes all
three outputs: the normed q latent (skipped when q_lora_rank is None), the normed kv latent and the
rope part k_pe (copied out contiguous). Norms in fp32, weights in fp32, the result rounded to the
activation dtype, as the reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4serve.attention.mla import QkvLatents

MAX_PROGRAMS = 65535  # triton-ascend's grid limit (programs map onto the AI cores)


@triton.jit
def _norm_part(y_ptr, w_ptr, out_ptr, start, N, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(y_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (w * (x * scale)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_norm_row(
    y_ptr, q_w_ptr, kv_w_ptr, q_ptr, kv_ptr, pe_ptr, t, Q, KV, R, stride_y, stride_q, stride_kv, stride_pe,
    eps, HAS_Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Token t's row: its q and kv latents normed, its rope part copied."""
    row = y_ptr + t * stride_y
    if HAS_Q:
        _norm_part(row, q_w_ptr, q_ptr + t * stride_q, 0, Q, eps, BLOCK_Q)
    _norm_part(row, kv_w_ptr, kv_ptr + t * stride_kv, Q, KV, eps, BLOCK_KV)
    cols = tl.arange(0, BLOCK_R)
    mask = cols < R
    pe = tl.load(row + Q + KV + cols, mask=mask, other=0.0)
    tl.store(pe_ptr + t * stride_pe + cols, pe, mask=mask)


@triton.jit
def split_norm_kernel(
    y_ptr, q_w_ptr, kv_w_ptr, q_ptr, kv_ptr, pe_ptr, Q, KV, R, stride_y, stride_q, stride_kv, stride_pe,
    eps, HAS_Q: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    split_norm_row(
        y_ptr, q_w_ptr, kv_w_ptr, q_ptr, kv_ptr, pe_ptr, tl.program_id(0).to(tl.int64), Q, KV, R,
        stride_y, stride_q, stride_kv, stride_pe, eps, HAS_Q, BLOCK_Q, BLOCK_KV, BLOCK_R,
    )  # fmt: skip


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def qkv_split_norm(
    y: torch.Tensor,
    q_norm: torch.Tensor | None,
    kv_norm: torch.Tensor,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    eps: float,
    *,
    kernel: Any = split_norm_kernel,
    options: Callable[[torch.Tensor], dict[str, Any]] = lambda y: {},
) -> QkvLatents:
    """y: (T, [q_lora_rank +] kv_lora_rank + rope), rows contiguous; `kernel` takes split_norm_kernel's
    arguments plus `options(y)` (a backend's launch arguments)."""
    q_width = q_lora_rank or 0
    assert (q_norm is None) == (q_lora_rank is None), "q_norm goes with q_lora_rank"
    assert y.dim() == 2 and y.stride(-1) == 1, "y must be (T, width) with contiguous rows"
    rope = y.shape[1] - q_width - kv_lora_rank
    assert rope > 0, f"{tuple(y.shape)} too narrow for the latents and the rope part"
    assert kv_norm.shape == (kv_lora_rank,) and kv_norm.is_contiguous()
    assert q_norm is None or (q_norm.shape == (q_width,) and q_norm.is_contiguous())
    t = y.shape[0]
    q = torch.empty(t, q_width, dtype=y.dtype, device=y.device) if q_norm is not None else None
    kv = torch.empty(t, kv_lora_rank, dtype=y.dtype, device=y.device)
    k_pe = torch.empty(t, rope, dtype=y.dtype, device=y.device)
    if t:
        q_arg = q if q is not None else kv  # never touched when HAS_Q is off
        kernel[(t,)](
            y, q_norm if q_norm is not None else kv_norm, kv_norm, q_arg, kv, k_pe, q_width, kv_lora_rank,
            rope, y.stride(0), q_arg.stride(0), kv.stride(0), k_pe.stride(0), eps, HAS_Q=q is not None,
            BLOCK_Q=_pow2(q_width), BLOCK_KV=_pow2(kv_lora_rank), BLOCK_R=_pow2(rope), **options(y),
        )  # fmt: skip
    return QkvLatents(q=q, kv=kv, k_pe=k_pe)
