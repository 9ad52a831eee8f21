"""Expert FFNs: clamped SwiGLU, routed (stacked weights) and shared."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsv4serve.quant import Weight, linear


def swiglu(
    x: torch.Tensor,
    w1: Weight,
    w2: Weight,
    w3: Weight,
    limit: float,
    matmul: Callable[[torch.Tensor, Weight], torch.Tensor] = linear,
) -> torch.Tensor:
    """down(silu(min(gate, limit)) * clamp(up, -limit, limit)); gate = x W1, up = x W3.

    `matmul` is the linear to use (the reference's by default).
    """
    gate = matmul(x, w1).clamp(max=limit)
    up = matmul(x, w3).clamp(min=-limit, max=limit)
    return matmul(F.silu(gate) * up, w2)


def routed_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: Weight,
    w2: Weight,
    w3: Weight,
    limit: float,
    shared: tuple[Weight, Weight, Weight] | None = None,
) -> torch.Tensor:
    """Sum over each token's chosen experts, accumulated in expert order, plus the shared expert.

    x: (T, hidden); weights, ids: (T, k); w1, w3: (E, I, hidden); w2: (E, hidden, I); shared: its
    (w1, w2, w3), or None. The reference gathers tokens per expert (data-dependent shapes); graph
    backends use a fixed-shape grouped GEMM with the same signature.
    """
    if shared is not None:
        routed = routed_experts_reference(x, weights, ids, w1, w2, w3, limit)
        return routed + swiglu(x, *shared, limit=limit)
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        y = swiglu(x[token], w1[e], w2[e], w3[e], limit) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
