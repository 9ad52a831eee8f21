"""Expert FFNs: clamped SwiGLU, routed (stacked weights) and shared."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsv4serve.layers.linear import Fp8BlockWeight, Weight, linear


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
        y = (
            swiglu(x[token], _expert(w1, e), _expert(w2, e), _expert(w3, e), limit)
            * weights[token, slot, None]
        )
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _expert(w: Weight, e: int) -> Weight:
    assert not isinstance(w, Fp8BlockWeight), "routed experts in FP8 are dequantized at load"
    return w[e]


def gate_up_view(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """w1 and w3 (E, I, H) as one (E, 2I, H) tensor, without a copy, when each expert's w3 rows follow
    its w1 rows in memory (transformers' stacked `gate_up_proj`, the loader's stacks); else None."""
    E, inter, hidden = w1.shape
    stride = (2 * inter * hidden, hidden, 1)
    if w3.shape != w1.shape or w1.stride() != stride or w3.stride() != stride or w1.dtype != w3.dtype:
        return None
    if w3.data_ptr() != w1.data_ptr() + inter * hidden * w1.element_size():
        return None
    if w3.untyped_storage().data_ptr() != w1.untyped_storage().data_ptr():  # adjacent, but apart
        return None
    return w1.as_strided((E, 2 * inter, hidden), stride)


def stacked_gate_up(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty w1 and w3 stacks of `shape` (E, I, H), the two halves of one (E, 2I, H) buffer
    (`gate_up_view` of them is that buffer): the layout the loaders give float experts."""
    num, inter, hidden = shape
    both = torch.empty(num, 2 * inter, hidden, dtype=dtype, device=device)
    return both[:, :inter], both[:, inter:]
