"""The MoE router of both models: `npu_moe_gating_top_k`'s contract on router logits (hash routing by
`tid2eid[token_id]`, or grouped top-k with a selection-only bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")  # indexed by npu_moe_gating_top_k's norm_type


def score_fn(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring function {scoring!r}")


def gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract of `torch_npu.npu_moe_gating_top_k` on router logits x (T, E) (its reference,
    op-plugin doc torch_npu-npu_moe_gating_top_k.md): (weights (T, k) in x's dtype, expert ids (T, k) int32).

    Scores s = norm_type's function of x (0 softmax, 1 sigmoid, 2 sqrtsoftplus); `bias` shifts the
    selection only, in fp32. Hash routing (`input_ids` + `tid2eid`) takes the table's experts.
    Otherwise, with groups, each group is scored by its max (group_select_mode 0) or the sum of its
    top 2 (mode 1) of the biased scores, the best `k_group` groups are kept (ties to the lower
    group), and the top k of the kept experts are chosen (ties to the lower expert id). Weights are
    the unbiased scores, divided by their sum (+ eps) for sigmoid and sqrtsoftplus (never for
    softmax), times `routed_scaling_factor`.

    Precision: the scores and the weights' arithmetic are in x's dtype, each op rounded as torch
    rounds it. For fp32 logits that is the contract's fp32 exactly; for bf16 logits it is what
    transformers' DeepseekV4 routers compute (bit for bit, test_glm_ops.py), where the contract's
    fp32 scoring of the same logits picks other experts for some tokens (6% at E 256, k 6) and
    differs in the weights' last bits; the npu op scores in fp32.
    """
    assert renorm == 0, "npu_moe_gating_top_k requires renorm == 0"
    t, e = x.shape
    assert e % group_count == 0 and 1 <= k_group <= group_count, (e, group_count, k_group)
    scores = score_fn(x, SCORINGS[norm_type])  # (T, E) in x's dtype
    if input_ids is not None and tid2eid is not None:
        ids = tid2eid[input_ids.long()].long()  # (T, k)
    else:
        sel = scores.float() if bias is None else scores.float() + bias.float()
        if group_count > 1:
            grouped = sel.view(t, group_count, e // group_count)
            group_score = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, -1).values.sum(-1)
            keep = torch.sort(-group_score, dim=-1, stable=True).indices[:, :k_group]  # (T, k_group)
            mask = torch.zeros(t, group_count, dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            sel = sel.masked_fill(~mask.repeat_interleave(e // group_count, 1), float("-inf"))
        ids = torch.sort(-sel, dim=-1, stable=True).indices[:, :k]  # descending, ties to the lower id
    weights = scores.gather(1, ids)
    if norm_type in (1, 2):
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * routed_scaling_factor, ids.int()
