"""Triton router (the contract of `routing.gating_top_k`) on the router logits: one program per token
applies the score function, adds the selection-only bias, keeps the best groups, picks the top k
(exact ties to the lowest group and expert id) or the hash table's experts, and renormalizes and
scales the chosen scores, rounding to the logits' dtype where the reference's ops do. One launch,
no host sync (capture-safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2


@triton.jit
def _log1p(e):
    """log(1 + e) accurate for small e (the classic u = 1 + e correction)."""
    u = 1.0 + e
    return tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))


@triton.jit
def _scores(logit, xmask, NORM_TYPE: tl.constexpr, DTYPE: tl.constexpr):
    """norm_type's scores (0 softmax, 1 sigmoid, 2 sqrt(softplus)), each torch op's result rounded."""
    if NORM_TYPE == 2:  # torch's softplus threshold 20
        soft = tl.where(logit > 20.0, logit, tl.maximum(logit, 0.0) + _log1p(tl.exp(-tl.abs(logit))))
        score = tl.sqrt(soft.to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    elif NORM_TYPE == 1:
        score = tl.sigmoid(logit).to(DTYPE).to(tl.float32)
    else:
        e = tl.where(xmask, tl.exp(logit - tl.max(tl.where(xmask, logit, float("-inf")), axis=0)), 0.0)
        score = (e / tl.sum(e, axis=0)).to(DTYPE).to(tl.float32)
    return tl.where(xmask, score, 0.0)


@triton.jit
def _keep_groups(
    sel, x, E, GROUPS: tl.constexpr, K_GROUP: tl.constexpr, SELECT_MODE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """sel with the experts outside the K_GROUP best of GROUPS groups at -inf; a group scores its max
    (mode 0) or the sum of its top 2 (mode 1); ties to the lower group."""
    g = tl.arange(0, BLOCK_G)
    member = ((x[None, :] // (E // GROUPS)) == g[:, None]) & (x[None, :] < E)  # (BLOCK_G, BLOCK_E)
    vals = tl.where(member, sel[None, :], float("-inf"))
    group_score = tl.max(vals, axis=1)  # (BLOCK_G,)
    if SELECT_MODE == 1:
        first = tl.min(tl.where(vals == group_score[:, None], x[None, :], BLOCK_E), axis=1)
        group_score = group_score + tl.max(
            tl.where(x[None, :] == first[:, None], float("-inf"), vals), axis=1
        )
    group_score = tl.where(g < GROUPS, group_score, float("-inf"))
    keep = g < 0
    for _ in tl.static_range(K_GROUP):
        pick = tl.min(tl.where(group_score == tl.max(group_score, axis=0), g, BLOCK_G), axis=0)
        keep = keep | (g == pick)
        group_score = tl.where(g == pick, float("-inf"), group_score)
    kept = tl.max(tl.where(member & keep[:, None], 1, 0), axis=0) > 0  # (BLOCK_E,)
    return tl.where(kept, sel, float("-inf"))


@triton.jit
def _gating_top_k_kernel(
    logits_ptr,
    bias_ptr,
    tid2eid_ptr,
    input_ids_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_l,
    scaling,
    eps,
    K: tl.constexpr,
    NORM_TYPE: tl.constexpr,
    HASH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,
    K_GROUP: tl.constexpr,
    SELECT_MODE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    DTYPE = logits_ptr.dtype.element_ty
    x = tl.arange(0, BLOCK_E)
    xmask = x < E
    logit = tl.load(logits_ptr + t * stride_l + x, mask=xmask, other=0.0).to(tl.float32)
    score = _scores(logit, xmask, NORM_TYPE, DTYPE)
    j = tl.arange(0, BLOCK_K)
    if HASH:
        token = tl.load(input_ids_ptr + t)
        ids = tl.load(tid2eid_ptr + token * K + j, mask=j < K, other=0)
    else:
        sel = score
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + x, mask=xmask, other=0.0).to(tl.float32)
        sel = tl.where(xmask, sel, float("-inf"))
        if GROUPS > 1:
            sel = _keep_groups(sel, x, E, GROUPS, K_GROUP, SELECT_MODE, BLOCK_E, BLOCK_G)
        ids = tl.zeros((BLOCK_K,), tl.int64)
        for slot in tl.static_range(K):
            pick = tl.min(tl.where(sel == tl.max(sel, axis=0), x, BLOCK_E), axis=0)  # ties: the lowest id
            ids = tl.where(j == slot, pick, ids)
            sel = tl.where(x == pick, float("-inf"), sel)
    weight = tl.zeros((BLOCK_K,), tl.float32)
    for slot in tl.static_range(K):
        expert = tl.sum(tl.where(j == slot, ids, 0), axis=0)
        weight = tl.where(j == slot, tl.sum(tl.where(x == expert, score, 0.0), axis=0), weight)
    if NORM_TYPE != 0:  # sigmoid, sqrtsoftplus: renormalized; softmax never
        total = (tl.sum(tl.where(j < K, weight, 0.0), axis=0).to(DTYPE).to(tl.float32) + eps).to(DTYPE)
        weight = (weight / total.to(tl.float32)).to(DTYPE).to(tl.float32)
    weight = (weight * scaling).to(DTYPE)
    tl.store(weights_ptr + t * K + j, weight, mask=j < K)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int32), mask=j < K)


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
    """`routing.gating_top_k` on logits x (T, E): (weights (T, k) in x's dtype, ids (T, k) int32)."""
    T, E = x.shape
    assert renorm == 0 and norm_type in (0, 1, 2) and x.stride(1) == 1, (renorm, norm_type)
    assert E % group_count == 0 and 1 <= k_group <= group_count
    assert 1 <= k <= k_group * (E // group_count), (k, k_group, E, group_count)
    weights = torch.empty(T, k, dtype=x.dtype, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int32, device=x.device)
    hashed = input_ids is not None and tid2eid is not None
    if hashed:
        assert tid2eid is not None and tid2eid.is_contiguous() and tid2eid.shape[1] == k
        assert input_ids is not None and input_ids.shape == (T,)
    if T == 0:
        return weights, ids
    _gating_top_k_kernel[(T,)](
        x, bias if bias is not None else x, tid2eid if hashed else ids, input_ids if hashed else ids,
        weights, ids, E, x.stride(0), routed_scaling_factor, eps,
        K=k, NORM_TYPE=norm_type, HASH=hashed, HAS_BIAS=bias is not None, GROUPS=group_count,
        K_GROUP=k_group, SELECT_MODE=group_select_mode, BLOCK_E=pow2(E, 16), BLOCK_G=pow2(group_count, 2),
        BLOCK_K=pow2(k, 2), num_warps=4, **launch_options(x),
    )  # fmt: skip
    return weights, ids
