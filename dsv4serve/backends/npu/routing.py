"""The router on Ascend: `torch_npu.npu_moe_gating_top_k` behind the contract of `routing.gating_top_k`.

Written against the documented op (op-plugin doc `torch_npu-npu_moe_gating_top_k.md`); **never run
on an Ascend NPU**. The op is feature-checked (older builds lack it) and its documented constraints are
checked before the call (E <= 2048, E % group_count == 0, E / group_count > 2, k <= k_group * E /
group_count, hash routing only with input_ids and tid2eid on builds that take them); anything else
takes the reference. Unset options (None) are left out of the call (older builds lack `input_ids`
and `tid2eid`). The op scores in fp32 whatever x's dtype: on bf16 logits (DSV4's) its weights and,
for a few tokens, its experts differ from the reference's, which rounds as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

RouterFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
MAX_EXPERTS = 2048


def npu_gating_top_k(
    x: torch.Tensor, k: int, *, npu: ModuleType, fallback: RouterFn, **options: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in x's dtype, expert ids (T, k) int32), as `routing.gating_top_k`."""
    op = getattr(npu, "npu_moe_gating_top_k", None)
    if op is None or not _supported(x, k, options):
        return fallback(x, k, **options)
    options = {name: value for name, value in options.items() if value is not None}
    bias = options.get("bias")
    if isinstance(bias, torch.Tensor):
        options = {**options, "bias": bias.to(x.dtype)}  # the op takes bias in x's dtype
    y, expert_idx, _ = op(x, k, **options)
    return y, expert_idx


def _supported(x: torch.Tensor, k: int, options: dict[str, object]) -> bool:
    e = x.shape[-1]
    groups = options.get("group_count", 1)
    k_group = options.get("k_group", 1)
    assert isinstance(groups, int) and isinstance(k_group, int)
    if x.dim() != 2 or e > MAX_EXPERTS or e % groups or e // groups <= 2:
        return False
    return 1 <= k_group <= groups and 1 <= k <= k_group * (e // groups) and options.get("renorm", 0) == 0
