"""MoE routers: hash routing (`tid2eid[token_id]`) and score top-k with a selection-only bias."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def score_fn(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring function {scoring!r}")


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    scaling: float,
    bias: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts per token. x: (T, hidden), gate: (E, hidden).

    Returns (weights (T, k), expert ids (T, k)): the chosen experts' scores renormalised to sum 1
    and multiplied by `scaling`. The correction `bias` only affects which experts are chosen.
    """
    scores = score_fn(F.linear(x, gate), scoring)  # (T, E)
    if tid2eid is not None:
        assert input_ids is not None
        ids = tid2eid[input_ids].long()  # (T, k)
    else:
        assert bias is not None
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
