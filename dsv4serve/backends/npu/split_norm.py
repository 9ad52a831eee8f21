"""GLM's fused split + norm on the NPU: `backends/split_norm.py`'s Triton source as triton-ascend compiles
it (one program per token, plain launches), within its grid limit; more tokens, or a capture of an NPU
graph (a Triton launch is recorded like any kernel; none has been tried there), take the reference.
**Never run on an Ascend NPU**: tested on CPU tensors through Triton's interpreter."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4serve.attention.mla import QkvLatents
from dsv4serve.backends import split_norm
from dsv4serve.backends.npu.graphs import capturing

SplitNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, int | None, int, float], QkvLatents]


def qkv_split_norm(
    y: torch.Tensor,
    q_norm: torch.Tensor | None,
    kv_norm: torch.Tensor,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    eps: float,
    *,
    fallback: SplitNorm,
) -> QkvLatents:
    if y.shape[0] > split_norm.MAX_PROGRAMS or y.stride(-1) != 1 or capturing() is not None:
        return fallback(y, q_norm, kv_norm, q_lora_rank, kv_lora_rank, eps)
    return split_norm.qkv_split_norm(y, q_norm, kv_norm, q_lora_rank, kv_lora_rank, eps)
