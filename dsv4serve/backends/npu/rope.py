"""DeepSeek-V4's rope on Ascend: `torch_npu.npu_rotary_mul` in interleave mode behind the contracts of
`attention/dsv4.py` (`rope`, `q_norm_rope`, `kv_norm_rope_store`).

The documented op (op-plugin doc `torch_npu-npu_rotary_mul.md`, rotary_mode="interleave") returns
x * cos + rot(x) * sin with rot pairing x[2i] and x[2i+1] (-x[2i+1], x[2i]), cos / sin at full width
(each frequency repeated twice), the output in the input's interleaved layout; x is 3-D (T, N, D) with
cos / sin (T, 1, D). The reference rotates in fp32 and casts back: the op is called on fp32 operands,
so it computes the very same values. Only the trailing rope dims rotate; the norms are the reference's
(`kv_norm_rope_store`'s weighted one through `npu_rms_norm`).

GLM-4.7-Flash's MLA rope (`attention/mla.rope_store`) on `torch_npu.npu_interleave_rope` (op-plugin doc
`torch_npu-npu_interleave_rope.md`; the `../reference` notes 3.2): x (B, N, S, 64) fp16 / bf16, contiguous,
cos / sin (B, 1, S, 64) in the half layout ([c | c]); it de-interleaves the pairs (x[2i], x[2i+1]) and
rotates the halves, its output in the half layout, as DeepSeek-V2 / V3's MLA rope and the reference's
`rope_interleaved` ([evens' | odds']). q_pe (T, H, 64) and k_pe (T, 64) go in one call as H + 1 heads of
one token each (B = T, S = 1); cos / sin in the half layout once a step. Other widths or dtypes take the
reference. **Never run on an Ascend NPU.**
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dsv4serve.attention import core
from dsv4serve.attention.dsv4 import swa_slots
from dsv4serve.attention.mla import MlaMeta, QkvLatents, rope_store, store_latents
from dsv4serve.attention.step import StepMeta
from dsv4serve.backends.npu.attention import PerStep

INTERLEAVE_ROPE = 64  # the width npu_interleave_rope takes


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


def npu_mla_rope_store(
    q_pe: torch.Tensor,
    latents: QkvLatents,
    cache: torch.Tensor,
    meta: MlaMeta,
    *,
    op: Callable[..., Any],
    shared: PerStep,
) -> None:
    """GLM's step rope and latent write (the contract of `mla.rope_store`): q_pe (T, H, 64), a view of q,
    rotated in place; each token's row [c | rotated k_pe] stored at its slot; one npu_interleave_rope."""
    T, H, R = q_pe.shape
    if T == 0 or R != INTERLEAVE_ROPE or q_pe.dtype not in (torch.float16, torch.bfloat16):
        return rope_store(q_pe, latents, cache, meta)
    cos, sin = shared.get(meta, q_pe.dtype, lambda: _half_layout(meta, q_pe.dtype))
    x = torch.cat([q_pe, latents.k_pe[:, None].to(q_pe.dtype)], dim=1)[:, :, None]  # (T, H + 1, 1, 64)
    out = op(x, cos, sin)[:, :, 0]  # (T, H + 1, 64) in the half layout
    store_latents(cache, meta, latents.kv, out[:, H])
    q_pe.copy_(out[:, :H])


def _half_layout(meta: MlaMeta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's cos / sin (T, 32) as npu_interleave_rope's (T, 1, 1, 64): [c | c] in the input's dtype."""
    T = meta.cos.shape[0]
    cos, sin = (t.to(dtype).repeat(1, 2).view(T, 1, 1, -1) for t in (meta.cos, meta.sin))
    return cos, sin
