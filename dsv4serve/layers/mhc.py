"""Manifold-constrained hyper-connections (mHC): the reference of the hc_pre / hc_post op family.

The residual is `hc_mult` streams h (T, hc, hidden). Before a block, `hc_pre` collapses them into the
block's input (and RMSNorms it, as the block's first op); after it, `hc_post` expands the block output
back into the streams and mixes in the residual through `comb`, which Sinkhorn iterations make doubly
stochastic; `hc_head_norm` is the final collapse before the LM head. All mixing math in fp32. The
shapes follow torch_npu's `npu_hc_pre_v2` / `npu_hc_post`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4serve.attention.core import rms_norm


@dataclass(frozen=True)
class HyperConnection:
    fn: torch.Tensor  # ((2+hc)*hc, hc*hidden) fp32; the head's is (hc, hc*hidden)
    base: torch.Tensor  # ((2+hc)*hc,) fp32
    scale: torch.Tensor  # (3,) fp32; the head's is (1,)


@dataclass(frozen=True)
class HcParams:
    mult: int  # hc_mult streams
    sinkhorn_iters: int
    eps: float  # hc_eps
    norm_eps: float  # rms_norm_eps


def mixes(h: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """RMS-normalized flat streams times fn^T: (T, hc, hidden) -> (T, rows of fn), fp32."""
    flat = h.flatten(1).float()  # (T, hc*hidden)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn.float())


def hc_pre(
    h: torch.Tensor, hc: HyperConnection, norm_weight: torch.Tensor, p: HcParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams into the block input, RMSNormed with `norm_weight`.

    h: (T, hc, hidden). Returns x (T, hidden) in h's dtype, post (T, hc) and comb (T, hc, hc) fp32.
    """
    n, eps = p.mult, p.eps
    pre_w, post_w, comb_w = mixes(h, hc.fn, p.norm_eps).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * hc.scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * hc.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * hc.scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(p.sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # (T, hidden)
    return rms_norm(collapsed, norm_weight, p.norm_eps), post, comb


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams post * out + comb^T h. out: (T, hidden); h: (T, hc, hidden) -> (T, hc, hidden)."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), h
    )


def hc_head(h: torch.Tensor, hc: HyperConnection, p: HcParams) -> torch.Tensor:
    """The final collapse of the streams (T, hc, hidden) -> (T, hidden), before the last norm."""
    pre = torch.sigmoid(mixes(h, hc.fn, p.norm_eps) * hc.scale.float() + hc.base.float()) + p.eps
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


def hc_head_norm(
    h: torch.Tensor, hc: HyperConnection, norm_weight: torch.Tensor, p: HcParams
) -> torch.Tensor:
    """The head's collapse RMSNormed with the model's last norm: the `hc_head` op family."""
    return rms_norm(hc_head(h, hc, p), norm_weight, p.norm_eps)
