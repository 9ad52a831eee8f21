"""RMSNorm on Ascend: `torch_npu.npu_rms_norm` behind the contract of `attention.core.rms_norm`, and
`npu_add_rms_norm` behind `attention.core.add_rms_norm`.

The documented op (op-plugin doc `torch_npu-npu_rms_norm.md`) computes the statistics in fp32 and
applies gamma in fp32 before casting back to x's dtype, as the reference does; gamma may be fp32
(the engine keeps norms in fp32). It returns (y, rstd): y is the family's result. **Never run on an
Ascend NPU.**
"""

from __future__ import annotations

from types import ModuleType

import torch


def npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, npu: ModuleType) -> torch.Tensor:
    """x (..., H) normed over its last dim, times weight (H,), in x's dtype."""
    y, _ = npu.npu_rms_norm(x, weight, eps)
    return y


def npu_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, npu: ModuleType
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its norm) through `npu_add_rms_norm` (doc `torch_npu-npu_add_rms_norm.md`): the sum
    rounded to the inputs' dtype, then normed as `npu_rms_norm` does; it returns (y, rstd, sum)."""
    y, _, total = npu.npu_add_rms_norm(x, delta, weight, eps)
    return total, y
