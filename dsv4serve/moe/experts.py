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

    `matmul` is the backend's linear (the shared expert runs it); routed experts use the reference.
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
) -> torch.Tensor:
    """Sum over each token's chosen experts, accumulated in expert order.

    x: (T, hidden); weights, ids: (T, k); w1, w3: (E, I, hidden); w2: (E, hidden, I).
    The reference gathers tokens per expert (data-dependent shapes); graph backends use a
    fixed-shape grouped GEMM with the same signature.
    """
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        y = swiglu(x[token], w1[e], w2[e], w3[e], limit) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def routed_experts_dense(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: Weight,
    w2: Weight,
    w3: Weight,
    limit: float,
) -> torch.Tensor:
    """Same result as the reference with fixed shapes and no host syncs (graph-capturable).

    Every expert runs on every token and is weighted by the token's routing weight for it (0 when not
    chosen): E/k times the FLOPs of the gathered form, so meant for small decode batches.
    """
    num_experts = w1.shape[0]
    gate_of = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device)  # (T, E)
    gate_of.scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        y = swiglu(x, w1[e], w2[e], w3[e], limit) * gate_of[:, e, None]
        out += y.to(out.dtype)
    return out
