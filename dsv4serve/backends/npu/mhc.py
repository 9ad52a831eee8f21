"""DeepSeek-V4's mHC on Ascend: the custom ops `npu_hc_pre_v2` and `npu_hc_post` behind the contracts of
`layers/mhc.py` (`hc_pre`, `hc_post`).

The ops come from a custom-op library, not stock torch_npu: vllm-ascend registers them as
`torch.ops._C_ascend.*` (its `csrc` build for CANN 8.5 on Atlas A2 / A3), SGLang's Ascend kernels as
`torch.ops.custom.*` (`npu_find_op` looks in both). The documented contract (vllm-ascend's op test,
`../reference` notes): `npu_hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters,
norm_eps, hc_eps) -> (y, post, comb)` with x (T, hc, D) bf16, fn / scale / base fp32, y (T, D) bf16,
post (T, hc) and comb (T, hc, hc) fp32; the mix GEMM runs in HF32 (the op's own test allows 4e-3 on y,
1e-4 on post / comb). Supported: hc == 4, D in {4096, 7168}; any other shape or dtype (the tiny test
checkpoints, fp32 runs) takes the reference for that call. `npu_hc_post(x, residual, post, comb)` takes
a leading batch dim of 1 on each operand and returns (1, T, hc, D) in x's dtype. The block input's
RMSNorm, which the family's contract includes, runs on `npu_rms_norm`.

CANN's newer generation (hicann ops-transformer `mhc/mhc_pre_sinkhorn/docs/torchapi_mhc_pre_sinkhorn.md`,
`mhc/mhc_post/docs/torchapi_mhc_post.md`): `mhc_pre_sinkhorn(x, phi, alpha, bias, hc_mult, num_iters,
hc_eps, norm_eps)` (the eps in the other order) with x BSND (B, S, hc, C) on A2 / A3, fp16 / bf16, hc 4,
C a multiple of 128, 20 Sinkhorn iterations, returning hin (B, S, C), h_post (B, S, hc) and h_res
(B, S, hc * hc) fp32 first; `mhc_post(x, h_res, h_out, h_post)` with the streams x (T, hc, D) first and
h_res required on A2 / A3, returning (T, hc, D) in x's dtype.

`hc_head` (the final collapse, `mhc.hc_head_norm`) has no op of its own: its pre is hc_pre's (sigmoid of
the RMS-scaled mix times scale plus base, plus eps) over the head's own hc rows of fn, and y is the same
pre-weighted sum. So it runs on the same op with the head's parameters padded by zero post / comb rows
(fn, base) and zero post / comb scales, padded once per weight; the op's post / comb are dropped. Then
`npu_rms_norm`. **Never run on an Ascend NPU.**
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from dsv4serve.layers import mhc
from dsv4serve.layers.mhc import HcParams, HyperConnection

HC_MULT = 4
HIDDEN = (4096, 7168)
SINKHORN_ITERS, CANN_ALIGN = 20, 128  # the newer ops' limits


def supported(h: torch.Tensor, p: HcParams) -> bool:
    """The shapes and dtype the custom ops take (x bf16, hc_mult 4, hidden 4096 or 7168)."""
    return h.dtype == torch.bfloat16 and p.mult == HC_MULT and h.dim() == 3 and h.shape[-1] in HIDDEN


def npu_hc_pre(
    h: torch.Tensor,
    hc: HyperConnection,
    norm_weight: torch.Tensor,
    p: HcParams,
    *,
    pre: Callable[..., Any],
    rms_norm: Callable[..., Any],
    newer: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The streams h (T, hc, D) collapsed into the block input (RMSNormed), post (T, hc), comb (T, hc, hc);
    on `npu_hc_pre_v2`, or (`newer`) CANN's `mhc_pre_sinkhorn` (the streams as one BSND batch entry)."""
    if not (cann_supported(h, p) if newer else supported(h, p)):
        return mhc.hc_pre(h, hc, norm_weight, p)
    y, post, comb = _pre_op(pre, h, hc, p, newer)
    normed, _ = rms_norm(y, norm_weight, p.norm_eps)
    T = h.shape[0]
    return normed, post.reshape(T, p.mult), comb.reshape(T, p.mult, p.mult)


def _pre_op(
    pre: Callable[..., Any], h: torch.Tensor, hc: HyperConnection, p: HcParams, newer: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call of the pre op of either generation: y (T, D), post and comb as it shapes them. The newer
    takes the streams as one BSND batch entry, and its two eps the other way round."""
    if newer:
        y, post, comb = pre(h[None], hc.fn, hc.scale, hc.base, p.mult, p.sinkhorn_iters, p.eps, p.norm_eps)[
            :3
        ]
        return y[0], post, comb  # y (1, T, D); post (1, T, hc), comb (1, T, hc * hc)
    y, post, comb = pre(h, hc.fn, hc.scale, hc.base, p.mult, p.sinkhorn_iters, p.norm_eps, p.eps)
    return y, post, comb


def npu_hc_head(
    h: torch.Tensor,
    hc: HyperConnection,
    norm_weight: torch.Tensor,
    p: HcParams,
    *,
    pre: Callable[..., Any],
    rms_norm: Callable[..., Any],
    padded: dict[int, tuple[torch.Tensor, HyperConnection]],
    newer: bool = False,
) -> torch.Tensor:
    """The head's collapse of the streams (T, hc, D) RMSNormed: hc_pre's op over the head's parameters
    padded to hc_pre's shapes (`head_as_pre`), its y the collapse, post / comb dropped."""
    q = replace(p, sinkhorn_iters=SINKHORN_ITERS)  # comb is dropped: any count the op takes
    if not (cann_supported(h, q) if newer else supported(h, q)):
        return mhc.hc_head_norm(h, hc, norm_weight, p)
    if id(hc.fn) not in padded or padded[id(hc.fn)][0] is not hc.fn:  # (a warm-up step pads, not a capture)
        padded[id(hc.fn)] = (hc.fn, head_as_pre(hc, p.mult))
    y, _, _ = _pre_op(pre, h, padded[id(hc.fn)][1], q, newer)
    normed, _ = rms_norm(y, norm_weight, p.norm_eps)
    return normed


def head_as_pre(head: HyperConnection, mult: int) -> HyperConnection:
    """The head's parameters (fn (hc, hc*D), base (hc,), scale (1,)) as hc_pre's (fn ((2+hc)*hc, hc*D),
    base ((2+hc)*hc,), scale (3,)): the pre rows are the head's, the post / comb rows and scales zero."""
    rows = (2 + mult) * mult - mult
    fn = torch.cat([head.fn.float(), head.fn.new_zeros(rows, head.fn.shape[1], dtype=torch.float32)])
    base = torch.cat([head.base.float(), head.base.new_zeros(rows, dtype=torch.float32)])
    scale = torch.cat([head.scale.float().reshape(1), head.scale.new_zeros(2, dtype=torch.float32)])
    return HyperConnection(fn=fn, base=base, scale=scale)


def npu_hc_post(
    out: torch.Tensor,
    h: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    op: Callable[..., Any],
    newer: bool = False,
) -> torch.Tensor:
    """New streams post * out + comb^T h: (T, hc, D) in h's dtype; on `npu_hc_post`, or (`newer`) CANN's
    `mhc_post` (TND: the streams h first, h_res = comb, h_out = out)."""
    if newer:
        if h.dtype not in (torch.bfloat16, torch.float16) or out.dtype != h.dtype or h.shape[0] == 0:
            return mhc.hc_post(out, h, post, comb)
        return op(h, comb.float(), out, post.float())
    if (
        h.dtype != torch.bfloat16
        or out.dtype != h.dtype
        or h.shape[1] != HC_MULT
        or h.shape[-1] not in HIDDEN
    ):
        return mhc.hc_post(out, h, post, comb)
    return op(out[None], h[None], post[None], comb[None])[0]


def cann_supported(h: torch.Tensor, p: HcParams) -> bool:
    """The newer ops' limits (A2 / A3): fp16 / bf16 streams, hc_mult 4, C a multiple of 128, 20 iterations."""
    return (
        h.dtype in (torch.bfloat16, torch.float16)
        and h.dim() == 3
        and h.shape[0] > 0
        and p.mult == HC_MULT == h.shape[1]
        and p.sinkhorn_iters == SINKHORN_ITERS
        and h.shape[-1] % CANN_ALIGN == 0
    )
