"""Routed experts on Ascend through torch_npu (the `npu` backend's `routed_experts`).

Written against the documented torch_npu API (op-plugin docs `torch_npu-npu_grouped_matmul.md`,
`torch_npu-npu_dynamic_quant.md`, and vllm-ascend's op documentation for
`npu_moe_init_routing_v2` and `npu_moe_token_unpermute`). **This code has never run on an Ascend
NPU**; the tests check its plumbing against a fake `torch_npu` that implements the documented
semantics in plain PyTorch.

Dataflow (fixed shapes, no host syncs, so capturable in a graph): permute the T*k (token, expert)
rows into expert order, grouped GEMMs (gate and up, as one when the weights are stacked [W1; W3];
down) split along the rows by the per-expert counts, the clamped SwiGLU in torch between them (no
documented fused op has DeepSeek-V4's clamp-then-SiLU form), and a weighted un-permute back to tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from dsv4serve.layers.linear import Int8Weight, Weight
from dsv4serve.moe.experts import gate_up_view, swiglu

ExpertsFn = Callable[..., torch.Tensor]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT8_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)  # npu_dynamic_quant inputs
MAX_GROUPS = 1024  # grouped matmul: "group_list supports at most 1024 groups"
INNER_LIMIT = 65536  # grouped matmul: last dims of x and weight must be below InnerLimit


def npu_routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: Weight,
    w2: Weight,
    w3: Weight,
    limit: float,
    shared: tuple[Weight, Weight, Weight] | None = None,
    *,
    npu: ModuleType,
    fallback: ExpertsFn,
    linear: Callable[[torch.Tensor, Weight], torch.Tensor],
) -> torch.Tensor:
    """Same contract as `experts.routed_experts_reference`.

    x: (T, hidden); weights, ids: (T, k); w1, w3: (E, I, hidden); w2: (E, hidden, I). Float weights
    need x's dtype; int8 weights need fp16 / bf16 activations (other combinations go to `fallback`).
    With bf16 activations the int8 GEMMs use the weight scales rounded to bf16 (the only per-token
    row of the documented dtype table with a bf16 output); fp16 keeps them in fp32.
    """
    if shared is not None:  # the shared expert through the backend's linear family (`linear`)
        routed = npu_routed_experts(
            x, weights, ids, w1, w2, w3, limit, npu=npu, fallback=fallback, linear=linear
        )
        return routed + swiglu(x, *shared, limit=limit, matmul=linear)
    if not _supported(x, w1, w2, w3):
        return fallback(x, weights, ids, w1, w2, w3, limit)
    _check_layout(x, weights, ids, w1, w2, w3)
    num_tokens, top_k = ids.shape
    sorted_x, gather_index, counts, _ = npu.npu_moe_init_routing_v2(
        x,
        ids.to(torch.int32),
        active_num=num_tokens * top_k,
        expert_num=w1.shape[0],
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
    )  # (T*k, hidden) rows in expert order; (T*k,) int32: entry t*k+j = row of (t, j); (E,) counts
    rows = _GroupedRows(npu, sorted_x, counts)
    w13 = gate_up_view(w1, w3) if isinstance(w1, torch.Tensor) and isinstance(w3, torch.Tensor) else None
    if w13 is not None:  # one GEMM over the stacked [W1; W3] (the loaders' layout)
        both = rows.matmul(w13)  # (T*k, 2I)
        gate, up = both[:, : w1.shape[1]], both[:, w1.shape[1] :]
    else:
        gate, up = rows.matmul(w1), rows.matmul(w3)  # (T*k, I) each
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    hidden = _GroupedRows(npu, F.silu(gate) * up, counts)
    out = hidden.matmul(w2)  # (T*k, hidden)
    return npu.npu_moe_token_unpermute(out, gather_index, probs=weights.to(out.dtype))


class _GroupedRows:
    """Rows sorted by expert, quantized per token once if an int8 GEMM needs them."""

    def __init__(self, npu: ModuleType, rows: torch.Tensor, counts: torch.Tensor) -> None:
        self.npu, self.rows, self.counts = npu, rows, counts
        self._quantized: tuple[torch.Tensor, torch.Tensor] | None = None

    def matmul(self, w: Weight) -> torch.Tensor:
        """rows of expert e @ w[e]^T -> (rows, out) in the rows' dtype."""
        common = {"group_list": self.counts, "group_list_type": 1, "group_type": 0, "split_item": 2}
        if isinstance(w, torch.Tensor):
            return self.npu.npu_grouped_matmul([self.rows], [w.transpose(1, 2)], **common)[0]
        assert isinstance(w, Int8Weight), "npu experts: float or int8 weights (MXFP4 runs the reference)"
        if self._quantized is None:
            self._quantized = self.npu.npu_dynamic_quant(self.rows)  # (rows, in) int8, (rows,) fp32
        xq, xs = self._quantized
        dtype = self.rows.dtype
        scale = w.scale if dtype == torch.float16 else w.scale.to(torch.bfloat16)  # (E, out)
        return self.npu.npu_grouped_matmul(
            [xq],
            [w.qweight.transpose(1, 2)],  # (E, in, out) view of (E, out, in)
            scale=[scale],
            per_token_scale=[xs],
            output_dtype=dtype,
            **common,
        )[0]


def _supported(x: torch.Tensor, *ws: Weight) -> bool:
    if all(isinstance(w, torch.Tensor) and w.dtype == x.dtype for w in ws):
        return x.dtype in FLOAT_DTYPES
    return all(isinstance(w, Int8Weight) for w in ws) and x.dtype in INT8_ACTIVATION_DTYPES


def _check_layout(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: Weight, w2: Weight, w3: Weight
) -> None:
    num_experts, inter, hidden = w1.shape
    assert x.dim() == 2 and x.shape[1] == hidden, (x.shape, w1.shape)
    assert ids.dim() == 2 and ids.shape[0] == x.shape[0] and weights.shape == ids.shape
    assert w3.shape == (num_experts, inter, hidden) and w2.shape == (num_experts, hidden, inter)
    assert num_experts <= MAX_GROUPS and max(inter, hidden) < INNER_LIMIT, w1.shape
    for w in (w1, w2, w3):
        if isinstance(w, Int8Weight):
            assert w.qweight.dtype == torch.int8 and w.scale.dtype == torch.float32
            assert w.scale.shape == w.qweight.shape[:2], (w.scale.shape, w.qweight.shape)
