"""Reference (pure PyTorch) ops of DeepSeek-V4 attention: norms, sink attention, window pooling.

These are the executable spec; faster backends implement the same signatures.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm computed in fp32 (weights kept in fp32), cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream plus a block's output, and that sum normed (a model's next block input)."""
    total = x + delta
    return total, rms_norm(total, weight, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-K=V MQA over a per-token key set, with a learnable per-head sink logit.

    q: (T, H, D); keys: (T, N, D) (also the values); visible: (T, N) bool; sinks: (H,) fp32.
    Returns (T, H, D).
    """
    logits = torch.einsum("thd,tnd->thn", q, keys) * scale  # (T, H, N)
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)  # (T, H, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)  # drop the sink
    return torch.einsum("thn,tnd->thd", probs, keys)


def pool_windows(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-gated sum over each window's rows, per channel (softmax in fp32).

    kv, score: (NW, rows, d) -> (NW, d)
    """
    weights = torch.softmax(score.float(), dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)


def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Lightning-indexer scores `sum_h w_h * relu(q_h . k) * scale`.

    q: (T, Hi, Di); keys: (T, J, Di); head_weights: (T, Hi) fp32. Returns (T, J) fp32.
    """
    scores = torch.einsum("thd,tjd->thj", q.float(), keys.float())
    scores = torch.relu(scores) * softmax_scale
    return (scores * head_weights.float()[:, :, None]).sum(dim=1)


def topk_lowest_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, highest first, exact ties to the lowest index.

    scores: (T, J) fp32 -> (T, k) int64. Every key is made distinct (score bits above, the reversed
    column below), so any top-k algorithm gives the same answer whatever the row width: the choice
    never depends on padding or on what else is in the batch. -0.0 counts as 0.0.
    """
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0 turns -0.0 into 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float's value
    column = torch.arange(scores.shape[-1], device=scores.device)
    keys = ordered * 2**32 + (2**32 - 1 - column)
    return keys.topk(k, dim=-1).indices


def in_index_order(chosen: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Chosen entries (T, K) re-ordered by index, the invisible ones (-1) last: one canonical order, so
    the attention's summation order never depends on how the choice was made. -> int32."""
    big = torch.iinfo(torch.int32).max
    ordered = torch.where(visible, chosen, big).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered).int()
