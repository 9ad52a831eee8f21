"""DeepSeek-V4's rope on Ascend: `torch_npu.npu_rotary_mul` in interleave mode behind the contracts of
`attention/dsv4.py` (`rope`, `q_norm_rope`, `kv_norm_rope_store`).

The documented op (op-plugin doc `torch_npu-npu_rotary_mul.md`, rotary_mode="interleave") returns
x * cos + rot(x) * sin with rot pairing x[2i] and x[2i+1] (-x[2i+1], x[2i]), cos / sin at full width
(each frequency repeated twice), the output in the input's interleaved layout; x is 3-D (T, N, D) with
cos / sin (T, 1, D). The reference rotates in fp32 and casts back: the op is called on fp32 operands,
so it computes the very same values. Only the trailing rope dims rotate; the norms are the reference's
(`kv_norm_rope_store`'s weighted one through `npu_rms_norm`). **Never run on an Ascend NPU.**
"""

from __future__ import annotations

from types import ModuleType

import torch

from dsv4serve.attention import core
from dsv4serve.attention.dsv4 import swa_slots
from dsv4serve.attention.step import StepMeta


def npu_rope(
    x: torch.Tensor, meta: StepMeta, compress: bool, inverse: bool = False, *, npu: ModuleType
) -> torch.Tensor:
    """Interleaved rope of each token's position on the trailing dims of x (T, ..., D)."""
    cos, sin = meta.rope[compress]  # (T, rd / 2) each
    rd = 2 * cos.shape[-1]
    full_cos = cos.float().repeat_interleave(2, -1).unsqueeze(1)  # (T, 1, rd)
    full_sin = (-sin if inverse else sin).float().repeat_interleave(2, -1).unsqueeze(1)
    part = x[..., -rd:].float().reshape(x.shape[0], -1, rd)  # (T, N, rd)
    rotated = npu.npu_rotary_mul(part, full_cos, full_sin, rotary_mode="interleave")
    return torch.cat([x[..., :-rd], rotated.view(*x.shape[:-1], rd).to(x.dtype)], dim=-1)


def npu_q_norm_rope(
    q: torch.Tensor, meta: StepMeta, compress: bool, eps: float, *, npu: ModuleType
) -> torch.Tensor:
    """Per-head unweighted RMSNorm (the reference's: multiplied in q's dtype), then rope. q: (T, H, D)."""
    return npu_rope(core.unweighted_rms_norm(q, eps), meta, compress, npu=npu)


def npu_kv_norm_rope_store(
    kv: torch.Tensor,
    weight: torch.Tensor,
    swa: torch.Tensor,
    meta: StepMeta,
    compress: bool,
    eps: float,
    *,
    npu: ModuleType,
) -> None:
    """RMSNorm (`npu_rms_norm`), rope, then each token's K=V row into its SWA slot. kv: (T, D)."""
    normed, _ = npu.npu_rms_norm(kv, weight, eps)
    swa.index_copy_(0, swa_slots(meta), npu_rope(normed, meta, compress, npu=npu).to(swa.dtype))
