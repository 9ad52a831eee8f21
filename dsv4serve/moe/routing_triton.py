"""Triton router (the contract of `routing.route`): the gate logits through the backend's GEMM, then one
program per token applies the score function, adds the selection-only bias, picks the top k (exact ties
to the lowest expert id) or the hash table's experts, and renormalizes and scales the chosen scores,
rounding to the activation dtype where the reference's ops do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dsv4serve.quant import Weight
from dsv4serve.triton_utils import pow2

SCORINGS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _log1p(e):
    """log(1 + e) accurate for small e (the classic u = 1 + e correction)."""
    u = 1.0 + e
    return tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    tid2eid_ptr,
    input_ids_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_l,
    scaling,
    K: tl.constexpr,
    SCORING: tl.constexpr,
    HASH: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    DTYPE = logits_ptr.dtype.element_ty
    x = tl.arange(0, BLOCK_E)
    xmask = x < E
    logit = tl.load(logits_ptr + t * stride_l + x, mask=xmask, other=0.0).to(tl.float32)
    if SCORING == 0:  # sqrt(softplus), torch's threshold 20
        soft = tl.where(logit > 20.0, logit, tl.maximum(logit, 0.0) + _log1p(tl.exp(-tl.abs(logit))))
        score = tl.sqrt(soft.to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    elif SCORING == 1:
        score = tl.sigmoid(logit).to(DTYPE).to(tl.float32)
    else:
        e = tl.where(xmask, tl.exp(logit - tl.max(tl.where(xmask, logit, float("-inf")), axis=0)), 0.0)
        score = (e / tl.sum(e, axis=0)).to(DTYPE).to(tl.float32)
    score = tl.where(xmask, score, 0.0)
    j = tl.arange(0, BLOCK_K)
    if HASH:
        token = tl.load(input_ids_ptr + t)
        ids = tl.load(tid2eid_ptr + token * K + j, mask=j < K, other=0)
    else:
        chosen = tl.where(xmask, score + tl.load(bias_ptr + x, mask=xmask, other=0.0), float("-inf"))
        ids = tl.zeros((BLOCK_K,), tl.int64)
        for slot in tl.static_range(K):
            best = tl.max(chosen, axis=0)
            pick = tl.min(tl.where(chosen == best, x, BLOCK_E), axis=0)  # ties: the lowest expert id
            ids = tl.where(j == slot, pick, ids)
            chosen = tl.where(x == pick, float("-inf"), chosen)
    weight = tl.zeros((BLOCK_K,), tl.float32)
    for slot in tl.static_range(K):
        expert = tl.sum(tl.where(j == slot, ids, 0), axis=0)
        weight = tl.where(j == slot, tl.sum(tl.where(x == expert, score, 0.0), axis=0), weight)
    total = (tl.sum(tl.where(j < K, weight, 0.0), axis=0).to(DTYPE).to(tl.float32) + 1e-20).to(DTYPE)
    weight = (weight / total.to(tl.float32)).to(DTYPE).to(tl.float32)
    weight = (weight * scaling).to(DTYPE)
    tl.store(weights_ptr + t * K + j, weight.to(weights_ptr.dtype.element_ty), mask=j < K)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=j < K)


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
    linear: Callable[[torch.Tensor, Weight], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = x.shape[0], gate.shape[0]
    logits = linear(x, gate)  # (T, E) in x's dtype, as F.linear gives it
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, ids
    hashed = tid2eid is not None
    assert hashed or bias is not None, "top-k routing needs the correction bias"
    if hashed:
        assert input_ids is not None and tid2eid is not None and tid2eid.is_contiguous()
        assert tid2eid.shape[1] == top_k
    _route_kernel[(T,)](
        logits, bias if bias is not None else logits, tid2eid if hashed else ids,
        input_ids if hashed else ids, weights, ids, E, logits.stride(0), scaling,
        K=top_k, SCORING=SCORINGS[scoring], HASH=hashed, BLOCK_E=pow2(E, 16), BLOCK_K=pow2(top_k, 2),
        num_warps=4,
    )  # fmt: skip
    return weights, ids
