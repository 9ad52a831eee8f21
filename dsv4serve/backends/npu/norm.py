"""RMSNorm on Ascend: `torch_npu.npu_rms_norm` behind the contract of `attention.core.rms_norm`.

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
