"""A fake `torch_npu` for tests without Ascend hardware: each function implements an op's documented
semantics in plain PyTorch (torch_npu's op-plugin docs; ../reference notes copied into the docstrings
where a convention is easy to get wrong), written from the docs, not from the engine's reference ops.
It checks the wrappers' plumbing (layouts, dtypes, index bookkeeping), not the real kernels: nothing
here has run on an Ascend NPU."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
import torch
from test_npu_routing import fake_gating_top_k
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


def fake_dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dtype in (torch.float16, torch.bfloat16) and x.dim() > 1
    scale = x.float().abs().amax(-1) / 127.0  # rowMax(|x|) / DTYPE_MAX, fp32
    q = torch.round(x.float() / scale[..., None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def fake_quant_matmul(x1, x2, scale, *, pertoken_scale=None, output_dtype=None):
    assert x1.dtype == x2.dtype == torch.int8 and x1.dim() == x2.dim() == 2
    assert x1.shape[1] == x2.shape[0] and scale.shape == (x2.shape[1],)
    assert pertoken_scale is not None and pertoken_scale.dtype == torch.float32
    assert pertoken_scale.shape == (x1.shape[0],)
    # A2/A3 rows with a per-token scale: fp32/bf16 scale -> bf16, fp32 scale -> fp16
    allowed = {torch.bfloat16: (torch.float32, torch.bfloat16), torch.float16: (torch.float32,)}
    assert scale.dtype in allowed[output_dtype], (scale.dtype, output_dtype)
    y = (x1.double() @ x2.double()) * scale.double() * pertoken_scale.double()[:, None]
    return y.to(output_dtype)


def fake_init_routing_v2(
    x, expert_idx, *, active_num=-1, expert_num=-1, expert_tokens_num_type=0, expert_tokens_num_flag=False
):
    assert expert_idx.dtype == torch.int32 and expert_tokens_num_type == 1 and expert_tokens_num_flag
    num_tokens, top_k = expert_idx.shape
    assert active_num == num_tokens * top_k
    flat = expert_idx.flatten().long()
    order = torch.sort(flat, stable=True).indices  # flat ids t*K+k in expert order
    expanded_x = x[order // top_k]
    expanded_row_idx = torch.empty(num_tokens * top_k, dtype=torch.int32)
    expanded_row_idx[order] = torch.arange(order.numel(), dtype=torch.int32)
    counts = torch.bincount(flat, minlength=expert_num)
    return expanded_x, expanded_row_idx, counts, None


def fake_grouped_matmul(
    x, weight, *, scale=None, per_token_scale=None, group_list=None, group_list_type=0,
    group_type=-1, split_item=0, output_dtype=None,
):  # fmt: skip
    assert len(x) == len(weight) == 1 and group_type == 0 and split_item in (2, 3)
    assert group_list_type == 1 and group_list.dtype == torch.int64
    xs, w = x[0], weight[0]
    assert xs.dim() == 2 and w.dim() == 3 and w.shape[1] == xs.shape[1]
    assert int(group_list.sum()) == xs.shape[0] and group_list.shape == (w.shape[0],)
    if xs.dtype == torch.int8:
        out_dtype = output_dtype
        assert {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}[out_dtype] == scale[0].dtype
        assert per_token_scale[0].dtype == torch.float32
    else:
        out_dtype = xs.dtype if output_dtype is None else output_dtype
        assert w.dtype == xs.dtype == out_dtype and scale is None
    out, start = torch.zeros(xs.shape[0], w.shape[-1], dtype=out_dtype), 0
    for e, count in enumerate(group_list.tolist()):
        rows = xs[start : start + count]
        if xs.dtype == torch.int8:
            acc = rows.double() @ w[e].double()
            y = acc * scale[0][e].double() * per_token_scale[0][start : start + count, None].double()
        else:
            y = rows.float() @ w[e].float()
        out[start : start + count] = y.to(out_dtype)
        start += count
    return [out]


def fake_token_unpermute(permuted_tokens, sorted_indices, probs=None):
    num_tokens, top_k = probs.shape
    assert sorted_indices.dtype == torch.int32 and sorted_indices.shape == (num_tokens * top_k,)
    gathered = permuted_tokens[sorted_indices.long()].view(num_tokens, top_k, -1)  # (T, K, H)
    return (gathered.float() * probs.float()[..., None]).sum(1).to(permuted_tokens.dtype)


def fake_rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x / rms(x) * gamma with fp32 statistics and gamma applied in fp32 before the cast back
    (op-plugin doc `torch_npu-npu_rms_norm.md`); returns (y, rstd)."""
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert gamma.dtype in (x.dtype, torch.float32) and gamma.shape == x.shape[-gamma.dim() :]
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def fake_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`torch_npu.npu_add_rms_norm` (op-plugin doc `torch_npu-npu_add_rms_norm.md`): the sum computed
    and rounded in the inputs' dtype, then `npu_rms_norm` of it; returns (y, rstd, sum)."""
    assert x1.dtype == x2.dtype and x1.shape == x2.shape
    total = x1 + x2
    y, rstd = fake_rms_norm(total, gamma, epsilon)
    return y, rstd, total


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((-b, a), -1).flatten(-2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def fake_rotary_mul(
    x: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """x * cos + rot(x) * sin, cos / sin (r1 / r2) at full width broadcast over x, the output in x's
    layout; "interleave" rotates pairs (x[2i], x[2i+1]) and restricts cos / sin to one broadcast head
    (op-plugin doc `torch_npu-npu_rotary_mul.md`)."""
    assert x.dim() in (3, 4) and x.shape[-1] % 2 == 0 and x.shape[-1] < 896 and rotate is None
    assert r1.shape == r2.shape and r1.dim() == x.dim() and r1.shape[-1] == x.shape[-1]
    assert r1.dtype == r2.dtype == x.dtype
    if rotary_mode == "interleave":
        assert r1.shape[-2] == 1  # one head broadcast (the 1S1D-style forms)
    rotated = _rotate_interleaved(x) if rotary_mode == "interleave" else _rotate_half(x)
    return x * r1 + rotated * r2


def fake_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`torch_npu.npu_interleave_rope` (op-plugin doc `torch_npu-npu_interleave_rope.md`, ../reference
    notes 3.2): x (B, N, S, 64) fp16 / bf16, contiguous; cos / sin (B, 1, S or 1, 64), one head broadcast,
    in the HALF layout. The pairs (x[2i], x[2i+1]) are de-interleaved to [x0, x2, ..., x1, x3, ...], then
    q * cos + rotate_half(q) * sin: the output stays in the half layout (not re-interleaved)."""
    assert x.dim() == 4 and x.shape[-1] == 64 and x.is_contiguous()
    assert x.dtype in (torch.float16, torch.bfloat16) and cos.dtype == sin.dtype == x.dtype
    B, _, S, D = x.shape
    assert cos.shape == sin.shape and cos.shape in ((B, 1, S, D), (B, 1, 1, D))
    q = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return q * cos + _rotate_half(q) * sin


def fake_hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
    """vllm-ascend `_C_ascend.npu_hc_pre_v2` (its op test's golden, ../reference notes): the streams x
    (T, hc, D) bf16 flattened and RMS-scaled, times hc_fn^T ((2+hc)*hc, hc*D) fp32, split into
    pre / post / comb; pre = sigmoid(. * scale[0] + base) + eps, post = 2 sigmoid(. * scale[1] + base),
    comb = softmax over its last dim + eps, columns normalized, then hc_sinkhorn_iters - 1 rounds of
    rows then columns; y = sum of pre-weighted streams in fp32, cast to bf16. Limits: hc 4, D 4096 or
    7168, bf16 x, fp32 parameters. Returns (y (T, D) bf16, post (T, hc), comb (T, hc, hc) fp32)."""
    _, hc, D = x.shape
    assert x.dtype == torch.bfloat16 and hc == hc_mult == 4 and D in (4096, 7168)
    assert hc_fn.dtype == hc_scale.dtype == hc_base.dtype == torch.float32
    assert (
        hc_fn.shape == ((2 + hc) * hc, hc * D)
        and hc_scale.shape == (3,)
        and hc_base.shape == ((2 + hc) * hc,)
    )
    xf = x.float().flatten(-2)
    mix = (xf @ hc_fn.t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = mix.split([hc, hc, hc * hc], -1)
    pre = torch.sigmoid(pre * hc_scale[0] + hc_base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(post * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = (comb.view(-1, hc, hc) * hc_scale[2] + hc_base[2 * hc :].view(hc, hc)).softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return (pre[..., None] * x.float()).sum(-2).to(x.dtype), post, comb


def fake_hc_post(x, residual, post, comb):
    """vllm-ascend `_C_ascend.npu_hc_post`, each operand with a leading batch dim (1): stream n is
    post[n] * x + sum_m comb[m, n] * residual[m], in fp32, cast to x's dtype. x (1, T, D), residual
    (1, T, hc, D), post (1, T, hc), comb (1, T, hc, hc) -> (1, T, hc, D)."""
    B, T, hc, D = residual.shape
    assert B == 1 and x.shape == (1, T, D) and post.shape == (1, T, hc) and comb.shape == (1, T, hc, hc)
    assert x.dtype == residual.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    mixed = torch.einsum("btmn,btmd->btnd", comb, residual.float())
    return (post[..., None] * x.float()[:, :, None] + mixed).to(x.dtype)


def fake_sparse_attn_sharedkv(
    q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None, ori_block_table=None,
    cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None,
    seqused_kv=None, sinks=None, metadata=None, softmax_scale=0.0, cmp_ratio=0, ori_mask_mode=4,
    cmp_mask_mode=3, ori_win_left=128, ori_win_right=0, layout_q="BSND", layout_kv="PA_ND",
    return_softmax_lse=False,
):  # fmt: skip
    """`npu_sparse_attn_sharedkv` (ops-transformer's sparse_attn_sharedkv README, ../reference notes):
    MQA with one shared K=V head; query t of batch entry b sits at position p = seqused_kv[b] - q_len_b
    + i (right-aligned); it reads the raw K=V at positions [p - ori_win_left, p + ori_win_right] below
    seqused_kv[b] (band, mode 4) through `ori_block_table` (page = position // block size), and the
    compressed K=V entries j < (p + 1) // cmp_ratio (mode 3) through `cmp_block_table`: at ratio 4 only
    those `cmp_sparse_indices[t, 0]` lists (-1 pads), at 128 all. softmax(scale q.k) with the head's
    sink an extra logit in the denominator; out = sum p k. No log-sum-exp output."""
    _, N, D = q.shape
    assert (
        layout_q == "TND" and layout_kv == "PA_ND" and not return_softmax_lse and ori_sparse_indices is None
    )
    assert q.dtype == torch.bfloat16 and N == 64 and D == 512 and ori_win_left == 127 and ori_win_right == 0
    assert ori_mask_mode == 4 and cmp_mask_mode == 3 and sinks.dtype == torch.float32 and sinks.shape == (N,)
    assert metadata is not None and metadata.dtype == torch.int32 and metadata.shape == (1024,)
    for kv in (ori_kv, cmp_kv):
        if kv is not None:
            assert kv.dim() == 4 and kv.shape[2:] == (1, D) and kv.shape[1] % 16 == 0 and kv.shape[1] <= 1024
    assert (cmp_kv is None) == (cmp_ratio == 0) and cmp_ratio in (0, 4, 128)
    assert (cmp_sparse_indices is not None) == (cmp_ratio == 4)
    ori = (ori_kv, ori_block_table, seqused_kv)
    cmp = (cmp_kv, cmp_block_table, seqused_kv, cmp_ratio, cmp_sparse_indices)
    return _sharedkv_attention(
        q, ori, cmp, cu_seqlens_q, sinks, softmax_scale, ori_win_left, ori_win_right
    ), None


def _sharedkv_attention(q, ori, cmp, cu_seqlens_q, sinks, scale, win_left, win_right):  # type: ignore[no-untyped-def]
    """Both generations' math (TND queries, paged K=V): query t of batch entry b at p = used[b] - q_len_b
    + i reads the raw K=V at [p - win_left, p + win_right] below used[b] through its block table, and the
    compressed entries j < (p_c + 1) // ratio, p_c its position counted back from the compressed side's raw
    length (cmp_used[b]), at ratio 4 only the listed ones (-1 pads); the sink an extra logit in the
    softmax's denominator. ori = (kv, table, used); cmp = (kv, table, cmp_used, ratio, indices)."""
    ori_kv, ori_table, used_kv = ori
    cmp_kv, cmp_table, cmp_used, ratio, indices = cmp
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1, used = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(used_kv[b])
        for t in range(q0, q1):
            p = used - (q1 - t)
            pos = torch.arange(max(0, p - win_left), min(used, p + win_right + 1))
            size = ori_kv.shape[1]
            keys = [ori_kv[ori_table[b, pos // size].long(), pos % size, 0]]
            if cmp_kv is not None:
                visible, size = (int(cmp_used[b]) - (q1 - t) + 1) // ratio, cmp_kv.shape[1]
                if indices is not None:
                    j = indices[t, 0].long()
                    j = j[j >= 0]
                    assert bool((j < visible).all()), "an index past the causal limit"
                else:
                    j = torch.arange(visible)
                keys.append(cmp_kv[cmp_table[b, j // size].long(), j % size, 0])
            k = torch.cat(keys).float()  # (keys, D): K = V
            scores = (q[t].float() @ k.T) * scale  # (N, keys)
            sink = sinks[:, None]
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            weights = (scores - top).exp()
            weights = weights / (weights.sum(-1, keepdim=True) + (sink - top).exp())
            out[t] = (weights @ k).to(q.dtype)
    return out


def fake_sparse_attn_sharedkv_metadata(
    num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, seqused_kv=None, batch_size=0, max_seqlen_q=0,
    max_seqlen_kv=0, ori_topk=0, cmp_topk=0, cmp_ratio=4, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=128,
    ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", has_ori_kv=True, has_cmp_kv=True, device="npu",
):  # fmt: skip
    """The attention's tiling (AICPU): an int32 [1024] tensor; here its arguments' consistency only."""
    assert num_heads_q == 64 and num_heads_kv == 1 and head_dim == 512 and has_ori_kv
    assert cu_seqlens_q.numel() == batch_size + 1 and seqused_kv.shape == (batch_size,)
    assert seqused_kv.dtype == cu_seqlens_q.dtype == torch.int32 and int(seqused_kv.max()) <= max_seqlen_kv
    assert cmp_topk == (512 if cmp_ratio == 4 and has_cmp_kv else 0) and ori_topk == 0
    return torch.zeros(1024, dtype=torch.int32)


COMPRESSOR_FORMS = {(4, 2, 512), (4, 2, 128), (128, 1, 512)}  # (cmp_ratio, coff, D): C4A, C4Li, C128A


def _compressor_checked(
    x, wkv, wgate, state_cache, ape, cmp_ratio, table, cu_seqlens, start_pos, coff, cache_mode
):
    """The limits both generations document (A3): x [T, H] fp16 / bf16, H 1K..10K in steps of 512; wkv /
    wgate [coff * D, H] in x's dtype; state_cache fp32 [blocks > 0, block_size (16x, <= 1024),
    2 * coff * D], contiguous (A3: no strided dim 0); ape fp32 [cmp_ratio, coff * D]; cache_mode 1 (2 is
    not supported on A3); cu_seqlens int32 [B + 1] from 0, non-decreasing; start_pos int32 [B]; the block
    table int32 [B, >= ceil(Smax / block_size)]. Returns B."""
    T, H = x.shape
    D = wkv.shape[0] // coff
    assert x.dtype in (torch.float16, torch.bfloat16) and wkv.dtype == wgate.dtype == x.dtype
    assert 1024 <= H <= 10240 and H % 512 == 0 and x.is_contiguous() and wkv.is_contiguous()
    assert wkv.shape == wgate.shape == (coff * D, H) and (cmp_ratio, coff, D) in COMPRESSOR_FORMS
    assert state_cache.dtype == torch.float32 and state_cache.dim() == 3 and state_cache.is_contiguous()
    blocks, size, width = state_cache.shape
    assert blocks > 0 and 0 < size <= 1024 and size % 16 == 0 and width == 2 * coff * D
    assert ape.dtype == torch.float32 and ape.shape == (cmp_ratio, coff * D)
    if cache_mode != 1:
        raise NotImplementedError(f"cache_mode {cache_mode}: A3 takes the paged state only (1)")
    B = cu_seqlens.numel() - 1
    cu = cu_seqlens.tolist()
    assert cu_seqlens.dtype == start_pos.dtype == table.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T
    assert all(b >= a for a, b in pairwise(cu)) and start_pos.shape == (B,) and table.shape[0] == B
    longest = max((int(start_pos[b]) + cu[b + 1] - cu[b] for b in range(B)), default=0)
    assert table.shape[1] >= -(-longest // size), "a state block table narrower than Smax"
    return B


def _compressor_pooled(x, wkv, wgate, state_cache, ape, cmp_ratio, table, cu_seqlens, start_pos, coff):
    """The compression both generations share (op README formulas; ops-transformer's
    `compressor_golden.py` for the state): kv = x Wkv, score = x Wgate + ape[p % r] in fp32. Entry b's
    tokens sit at positions start_pos[b].. ; every window [k r, (k + 1) r) whose end falls in them closes:
    softmax over its rows per channel (coff 2: the previous window's rows, channels [0, D), then its own,
    channels [D, 2D); no previous window: weight 0), the weighted kv summed. Rows of positions before
    start_pos come from the state through the block table (page = position // block_size; a read through
    block 0 is an error). Rows from (end // r - (coff - 1)) * r on are written back to the state (block 0:
    not written). Returns the closing windows packed, entry after entry, (rows, D) fp32, padded with NaN
    (the pad is undefined) to min(T, T // r + B) rows."""
    T, r = x.shape[0], cmp_ratio
    D = wkv.shape[0] // coff
    kv, score = x.float() @ wkv.float().T, x.float() @ wgate.float().T  # (T, coff * D) each
    size, cu = state_cache.shape[1], cu_seqlens.tolist()
    out = torch.full((min(T, T // r + len(cu) - 1), D), float("nan"))
    done = 0
    for b, (t0, t1) in enumerate(pairwise(cu)):
        start, end = int(start_pos[b]), int(start_pos[b]) + t1 - t0
        score[t0:t1] += ape[torch.arange(start, end) % r]

        def row(p: int, half: int, _t0: int = t0, _start: int = start, _b: int = b) -> tuple[Any, Any]:
            cols = slice(half * D, (half + 1) * D)
            if p < 0:
                return torch.zeros(D), torch.full((D,), float("-inf"))
            if p >= _start:
                return kv[_t0 + p - _start, cols], score[_t0 + p - _start, cols]
            block = int(table[_b, p // size])
            assert block != 0, "a state read through block 0"
            stored = state_cache[block, p % size]
            return stored[cols], stored[coff * D :][cols]

        for k in range(start // r, end // r):
            rows = [row(p, 0) for p in range((k - 1) * r, k * r)] if coff == 2 else []
            rows += [row(p, coff - 1) for p in range(k * r, (k + 1) * r)]
            k_rows, s_rows = torch.stack([a for a, _ in rows]), torch.stack([s for _, s in rows])
            out[done] = (k_rows * torch.softmax(s_rows, dim=0)).sum(0)
            done += 1
        for p in range(max(start, (end // r - (coff - 1)) * r), end):
            block = int(table[b, p // size])
            if block != 0:
                state_cache[block, p % size] = torch.cat([kv[t0 + p - start], score[t0 + p - start]])
    return out


def fake_compressor(
    x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table=None, cu_seqlens=None,
    seqused=None, start_pos=None, *, rope_head_dim=64, cmp_ratio=4, coff=1, norm_eps=1e-6, rotary_mode=1,
    cache_mode=1,
):  # fmt: skip
    """The custom libraries' `compressor` (vllm-ascend `_C_ascend`, SGLang `custom`; hicann ops-transformer
    `experimental/attention/compressor` README, `compressor_golden.py`), TH form: the windows' pooled
    kv (`_compressor_pooled`), then RMSNorm in fp32 with norm_weight (fp32 [D]), then rope on the last
    rope_head_dim (64) channels with row i of rope_sin / rope_cos (fp32 [rows, 64], full width) for
    output row i, interleaved (rotary_mode 2, the one supported): y[2j] = a cos[2j] - b sin[2j], y[2j+1]
    = a sin[2j+1] + b cos[2j+1]. Returns cmp_kv [min(T, T // r + B), D] in x's dtype."""
    assert seqused is None and rope_head_dim == 64 and rotary_mode == 2, "not modelled"
    _compressor_checked(
        x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table, cu_seqlens, start_pos, coff, cache_mode
    )
    pooled = _compressor_pooled(x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table, cu_seqlens,
                                start_pos, coff)  # fmt: skip
    D = pooled.shape[1]
    assert norm_weight.dtype == torch.float32 and norm_weight.shape == (D,)
    assert rope_sin.dtype == rope_cos.dtype == torch.float32
    assert rope_sin.shape == rope_cos.shape == (pooled.shape[0], rope_head_dim)
    normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight
    a, b = normed[:, -rope_head_dim::2], normed[:, -rope_head_dim + 1 :: 2]
    rotated = torch.stack(
        (a * rope_cos[:, ::2] - b * rope_sin[:, ::2], a * rope_sin[:, 1::2] + b * rope_cos[:, 1::2]), -1
    ).flatten(-2)
    return torch.cat([normed[:, :-rope_head_dim], rotated], -1).to(x.dtype)


def fake_cann_compressor(
    x, wkv, wgate, state_cache, ape, cmp_ratio, *, state_block_table=None, cu_seqlens=None, seqused=None,
    start_pos=None, coff=1, cache_mode=1,
):  # fmt: skip
    """CANN's newer `cann_ops_transformer.compressor` (ops-transformer
    `attention/compressor/docs/torchapi_compressor.md`): the windows' pooled kv (`_compressor_pooled`),
    no norm, no rope; cmp_ratio 2..128 (A3: 2, 4, ..., 128). Returns cmp_kv [min(T, T // r + B), D] in x's
    dtype."""
    assert seqused is None, "not modelled"
    assert cmp_ratio in (2, 4, 8, 16, 32, 64, 128)
    _compressor_checked(
        x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table, cu_seqlens, start_pos, coff, cache_mode
    )
    pooled = _compressor_pooled(x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table, cu_seqlens,
                                start_pos, coff)  # fmt: skip
    return pooled.to(x.dtype)


SFM_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # A3's num_heads_q
SFM_MODES = {1: (0, 0), 4: (3, 512), 128: (3, 0)}  # A3's cmp_ratio (1: SWA) -> (cmp_mask_mode, cmp_topk > 0?)
LAYOUTS = {"TND": 1, "PA_BBND": 2}


def _sfm_tiling(batch, cmp_topk, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right,
                layout_q, layout_kv, has_cmp_kv):  # type: ignore[no-untyped-def]  # fmt: skip
    """The arguments both calls must agree on, as the fake's metadata records them."""
    modes = (cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right)
    return [batch, cmp_topk, *modes, LAYOUTS[layout_q], LAYOUTS[layout_kv], int(has_cmp_kv)]


def _sfm_checked(cmp_ratio, cmp_mask_mode, cmp_topk, has_cmp, ori_mask_mode, ori_win_left, ori_win_right,
                 layout_q, layout_kv):  # type: ignore[no-untyped-def]  # fmt: skip
    """The A3 limits both calls document: SWA (ratio 1, cmp mask 0, no top-k), CSA (4, mode 3, top-k 1..8192),
    HCA (128, mode 3, no top-k); the band 127 left, 0 right; TND queries over PA_BBND pages (the one pair
    modelled)."""
    if (layout_q, layout_kv) != ("TND", "PA_BBND"):
        raise NotImplementedError(f"layouts {layout_q} / {layout_kv} are not modelled")
    assert cmp_ratio in SFM_MODES and has_cmp == (cmp_ratio != 1), "A3: SWA 1, CSA 4, HCA 128"
    mask, topk = SFM_MODES[cmp_ratio]
    assert cmp_mask_mode == mask and (0 < cmp_topk <= 8192 if topk else cmp_topk == 0)
    assert ori_mask_mode == 4 and ori_win_left == 127 and ori_win_right == 0, "A3: the band 127 / 0"


def fake_sparse_flash_mla_metadata(
    num_heads_q, num_heads_kv, head_dim, *, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None,
    seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, ori_topk_length=None,
    cmp_topk_length=None, batch_size=0, max_seqlen_q=0, max_seqlen_ori_kv=0, max_seqlen_cmp_kv=0, ori_topk=0,
    cmp_topk=0, cmp_ratio=1, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1,
    layout_q="BSND", layout_kv="BSND", has_ori_kv=True, has_cmp_kv=True,
):  # fmt: skip
    """CANN's `cann_ops_transformer.sparse_flash_mla_metadata` (ops-transformer
    `attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md`): the tiling, int32 (1024,); here the
    arguments' consistency, and the ones the main call must repeat recorded in it (its mask and window
    defaults differ from the main call's: the doc asks for them explicitly)."""
    assert num_heads_q in SFM_HEADS and num_heads_kv == 1 and head_dim == 512 and has_ori_kv
    _sfm_checked(cmp_ratio, cmp_mask_mode, cmp_topk, has_cmp_kv, ori_mask_mode, ori_win_left, ori_win_right,
                 layout_q, layout_kv)  # fmt: skip
    B = cu_seqlens_q.numel() - 1
    assert cu_seqlens_ori_kv is None and cu_seqlens_cmp_kv is None, "PA: no kv cumulative lengths"
    assert seqused_q is None and ori_topk == 0 and ori_topk_length is None and cmp_topk_length is None
    assert seqused_ori_kv is not None and seqused_ori_kv.shape == (B,), "PA: seqused_ori_kv required"
    for lengths in (cu_seqlens_q, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv):
        assert lengths is None or lengths.dtype == torch.int32
    assert max_seqlen_q > 0 and 0 < int(seqused_ori_kv.max()) <= max_seqlen_ori_kv
    assert (cmp_residual_kv is not None) == (cmp_ratio != 1), (
        "cmp_residual_kv: with cmp_kv, mode 3, ratio > 1"
    )
    out = torch.zeros(1024, dtype=torch.int32)
    tiling = _sfm_tiling(B, cmp_topk, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right,
                         layout_q, layout_kv, has_cmp_kv)  # fmt: skip
    out[: len(tiling)] = torch.tensor(tiling, dtype=torch.int32)
    return out


def _sfm_lengths_checked(B, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, cmp_ratio, cmp_kv):  # type: ignore[no-untyped-def]
    """PA lengths: int32 (B,) each; seqused_cmp_kv with the compressed pages; 0 <= residual < ratio."""
    assert seqused_ori_kv is not None and seqused_ori_kv.shape == (B,) and seqused_ori_kv.dtype == torch.int32
    if cmp_kv is None:
        assert seqused_cmp_kv is None and cmp_residual_kv is None, "SWA: no compressed lengths"
        return None
    assert seqused_cmp_kv is not None and seqused_cmp_kv.shape == (B,), "cmp_block_table needs seqused_cmp_kv"
    assert cmp_residual_kv is not None and cmp_residual_kv.shape == (B,), "CSA / HCA need cmp_residual_kv"
    assert seqused_cmp_kv.dtype == cmp_residual_kv.dtype == torch.int32
    assert bool(((cmp_residual_kv >= 0) & (cmp_residual_kv < cmp_ratio)).all()), "0 <= residual < ratio"
    assert bool((seqused_cmp_kv >= 0).all())
    return seqused_cmp_kv * cmp_ratio + cmp_residual_kv  # the raw length its causal limit counts from


def _positive_blocks(kv, table, used, cu_seqlens_q):  # type: ignore[no-untyped-def]
    """A PA block table: int32 (B, >= pages), the blocks each entry reads positive ids of the pool."""
    B, size = cu_seqlens_q.numel() - 1, kv.shape[1]
    assert table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == B
    for b in range(B):
        pages = -(-int(used[b]) // size)
        assert pages <= table.shape[1], "a kv length past the block table"
        ids = table[b, :pages]
        assert bool(((ids > 0) & (ids < kv.shape[0])).all()), "block ids: positive, inside the pool"


def fake_sparse_flash_mla(
    q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None, ori_block_table=None,
    cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None,
    seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, ori_topk_length=None,
    cmp_topk_length=None, sinks=None, metadata=None, softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=4,
    cmp_mask_mode=3, ori_win_left=-1, ori_win_right=-1, layout_q="BSND", layout_kv="BSND", topk_value_mode=1,
    return_softmax_lse=False,
):  # fmt: skip
    """CANN's `cann_ops_transformer.sparse_flash_mla` (ops-transformer
    `attention/sparse_flash_mla/docs/torchapi_sparse_flash_mla.md`), TND queries over PA_BBND pages:
    `npu_sparse_attn_sharedkv`'s math (`_sharedkv_attention`) with the raw length `seqused_ori_kv` and the
    compressed side's causal limit counted from seqused_cmp_kv * cmp_ratio + cmp_residual_kv. Checks the
    A3 limits (`_sfm_checked`), q / kv fp16 or bf16 alike (d 512, kv_n 1, block size 16x up to 1,024),
    sinks fp32 (q_n,) required, metadata from the same arguments, block ids positive. Returns (out, a
    zero (1,) without the LSE)."""
    T, N, D = q.shape
    assert q.dtype in (torch.float16, torch.bfloat16) and N in SFM_HEADS and D == 512 and T > 0
    has_cmp = cmp_kv is not None
    cmp_topk = 0 if cmp_sparse_indices is None else cmp_sparse_indices.shape[-1]
    _sfm_checked(cmp_ratio, cmp_mask_mode, cmp_topk, has_cmp, ori_mask_mode, ori_win_left, ori_win_right,
                 layout_q, layout_kv)  # fmt: skip
    assert ori_sparse_indices is None and ori_topk_length is None and cmp_topk_length is None, "reserved"
    assert (
        seqused_q is None and cu_seqlens_ori_kv is None and cu_seqlens_cmp_kv is None and topk_value_mode == 1
    )
    if return_softmax_lse:
        raise NotImplementedError("the LSE output is not modelled")
    cu = cu_seqlens_q.tolist()
    assert cu_seqlens_q.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T
    assert all(b >= a for a, b in pairwise(cu)), "cu_seqlens_q: non-decreasing"
    B = len(cu) - 1
    assert sinks is not None and sinks.dtype == torch.float32 and sinks.shape == (N,), "sinks: fp32 (q_n,)"
    assert metadata is not None and metadata.dtype == torch.int32 and metadata.shape == (1024,)
    tiling = _sfm_tiling(B, cmp_topk, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right,
                         layout_q, layout_kv, has_cmp)  # fmt: skip
    assert metadata[: len(tiling)].tolist() == tiling, "metadata from other arguments"
    for kv, table in ((ori_kv, ori_block_table), (cmp_kv, cmp_block_table)):
        if kv is not None:
            assert kv.dtype == q.dtype and kv.dim() == 4 and kv.shape[2:] == (1, D) and table is not None
            assert kv.shape[1] % 16 == 0 and 0 < kv.shape[1] <= 1024, "A2 / A3: block size 16x, <= 1,024"
    assert ori_kv is not None and (cmp_block_table is None) == (cmp_kv is None)
    assert (cmp_sparse_indices is not None) == (cmp_ratio == 4), "indices: CSA only"
    if cmp_sparse_indices is not None:
        assert cmp_sparse_indices.dtype == torch.int32 and cmp_sparse_indices.shape[:2] == (T, 1)
    cmp_used = _sfm_lengths_checked(B, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, cmp_ratio, cmp_kv)
    _positive_blocks(ori_kv, ori_block_table, seqused_ori_kv, cu_seqlens_q)
    if has_cmp:
        _positive_blocks(cmp_kv, cmp_block_table, seqused_cmp_kv, cu_seqlens_q)
    ori = (ori_kv, ori_block_table, seqused_ori_kv)
    cmp = (cmp_kv, cmp_block_table, cmp_used, cmp_ratio, cmp_sparse_indices)
    out = _sharedkv_attention(q, ori, cmp, cu_seqlens_q, sinks, softmax_scale, ori_win_left, ori_win_right)
    return out, torch.zeros(1)


def fake_mhc_pre_sinkhorn(
    x, phi, alpha, bias, hc_mult, num_iters, hc_eps=1e-6, norm_eps=1e-6, out_flag=False
):
    """CANN's `cann_ops_transformer.mhc_pre_sinkhorn` (ops-transformer
    `mhc/mhc_pre_sinkhorn/docs/torchapi_mhc_pre_sinkhorn.md`), A2 / A3: x BSND (B, S, N, C) fp16 / bf16, N 4,
    C a multiple of 128 up to 100,000, 20 iterations; phi ((N + 2) * N, N * C), alpha (3,), bias
    ((N + 2) * N,) fp32, split pre / post / res. The streams flattened are RMS-scaled (norm_eps) times phi^T;
    pre = sigmoid(alpha[0] . + b) + hc_eps, post = 2 sigmoid(alpha[1] . + b); res = softmax over its last
    dim + hc_eps, columns normalized (sum + hc_eps), then num_iters - 1 rounds of rows then columns;
    hin = the pre-weighted sum of the streams in x's dtype. Returns (hin (B, S, C), h_post (B, S, N),
    h_res (B, S, N * N) fp32); the intermediates for the backward (out_flag) are not modelled."""
    assert not out_flag, "the backward's intermediates are not modelled"
    assert x.dim() == 4, "A2 / A3: x BSND only"
    B, S, N, C = x.shape
    assert x.dtype in (torch.float16, torch.bfloat16) and N == hc_mult == 4 and num_iters == 20
    assert B * S > 0 and C % 128 == 0 and C <= 100000
    assert phi.dtype == alpha.dtype == bias.dtype == torch.float32
    assert phi.shape == ((N + 2) * N, N * C) and alpha.shape == (3,) and bias.shape == ((N + 2) * N,)
    xf = x.float().flatten(-2)  # (B, S, N * C)
    mix = (xf @ phi.t()) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    pre, post, res = mix.split([N, N, N * N], -1)
    pre = torch.sigmoid(pre * alpha[0] + bias[:N]) + hc_eps
    post = 2 * torch.sigmoid(post * alpha[1] + bias[N : 2 * N])
    res = (res.view(B, S, N, N) * alpha[2] + bias[2 * N :].view(N, N)).softmax(-1) + hc_eps
    res = res / (res.sum(-2, keepdim=True) + hc_eps)
    for _ in range(num_iters - 1):
        res = res / (res.sum(-1, keepdim=True) + hc_eps)
        res = res / (res.sum(-2, keepdim=True) + hc_eps)
    return (pre[..., None] * x.float()).sum(-2).to(x.dtype), post, res.flatten(-2)


def fake_mhc_post(x, h_res, h_out, h_post):
    """CANN's `cann_ops_transformer.mhc_post` (ops-transformer `mhc/mhc_post/docs/torchapi_mhc_post.md`):
    y[i] = h_post[i] h_out + sum_j h_res[j, i] x[j] (mixed in fp32 here, cast to x's dtype), TND x (T, n,
    D) or BSND; x / h_out fp16 or bf16 alike, h_res / h_post fp32; h_res required on A2 / A3; every
    dimension positive."""
    assert h_res is not None, "A2 / A3: h_res is required"
    lead, (n, D) = x.shape[:-2], x.shape[-2:]
    assert x.dim() in (3, 4) and all(d > 0 for d in x.shape) and x.dtype in (torch.float16, torch.bfloat16)
    assert h_out.dtype == x.dtype and h_out.shape == (*lead, D)
    assert h_res.dtype == h_post.dtype == torch.float32
    assert h_res.shape == (*lead, n, n) and h_post.shape == (*lead, n)
    mixed = torch.einsum("...mn,...md->...nd", h_res, x.float())
    return (h_post[..., None] * h_out.float()[..., None, :] + mixed).to(x.dtype)


def fake_quant_lightning_indexer(
    query, key, weights, query_dequant_scale, key_dequant_scale, *, actual_seq_lengths_query=None,
    actual_seq_lengths_key=None, block_table=None, query_quant_mode=0, key_quant_mode=0, layout_query="BSND",
    layout_key="BSND", sparse_count=2048, sparse_mode=3,
):  # fmt: skip
    """`custom.npu_quant_lightning_indexer` (ops-transformer `attention/quant_lightning_indexer` doc): the
    lightning indexer on per-token-head quantized inputs; per query token the `sparse_count` largest
    sum_g W[g] * ReLU(Scale_Q[g] * Scale_K[j] * (Q[g] . K[j])) over the keys its causal limit allows
    (sparse_mode 3). query int8 (T, 64, 128) TND, its dequant scale and the weights fp16 (T, 64); key
    int8 PA_BSND (blocks, block_size, 1, 128), its scale fp16 (blocks, block_size, 1); scales >= 0,
    W * Scale_Q representable in fp16; block size a multiple of 16 up to 1,024; quant modes 0. Returns
    int32 (T, 1, sparse_count) alone, -1 padded (highest first; no documented tie order: here the lower
    index)."""
    T, N, D = query.shape
    assert layout_query == "TND" and layout_key == "PA_BSND" and sparse_mode == 3 and N == 64 and D == 128
    assert query.dtype == key.dtype == torch.int8 and query_quant_mode == key_quant_mode == 0
    assert weights.dtype == query_dequant_scale.dtype == key_dequant_scale.dtype == torch.float16
    assert weights.shape == query_dequant_scale.shape == (T, N) and key.dim() == 4 and key.shape[2:] == (1, D)
    size = key.shape[1]
    assert key_dequant_scale.shape == key.shape[:3] and size % 16 == 0 and size <= 1024
    assert bool((query_dequant_scale >= 0).all())
    assert bool(torch.isfinite(weights * query_dequant_scale).all()), "W * Scale_Q overflows fp16"
    assert block_table.dtype == actual_seq_lengths_query.dtype == actual_seq_lengths_key.dtype == torch.int32
    assert 1 <= sparse_count <= 2048
    out = torch.full((T, 1, sparse_count), -1, dtype=torch.int32)
    for b, t, j in _causal_keys(actual_seq_lengths_query, actual_seq_lengths_key):
        page, row = block_table[b, j // size].long(), j % size
        k, k_scale = key[page, row, 0].float(), key_dequant_scale[page, row, 0].float()  # (seen, D)
        assert bool((k_scale >= 0).all()), "the keys' dequant scales are >= 0"
        dots = query[t].float() @ k.T  # (N, seen)
        scaled = query_dequant_scale[t].float()[:, None] * k_scale[None, :] * dots
        _top(out, t, (weights[t].float()[:, None] * torch.relu(scaled)).sum(0), sparse_count)
    return out


def _causal_keys(ends: torch.Tensor, lengths: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """TND's query tokens (cumulative `ends`) with the keys sparse_mode 3 lets each see: (batch entry,
    token, key indices 0 .. seen - 1), queries right-aligned to their entry's `lengths` keys."""
    start = 0
    for b, end in enumerate(ends.tolist()):
        length = int(lengths[b])
        for i, t in enumerate(range(start, end)):
            seen = length - (end - start) + i + 1
            if seen > 0:
                yield b, t, torch.arange(seen)
        start = end


def _top(out: torch.Tensor, t: int, score: torch.Tensor, count: int) -> None:
    """Token t's `count` highest scores' indices, highest first (the lower index on a tie), -1 after."""
    order = torch.sort(score, descending=True, stable=True).indices[:count]
    out[t, 0, : order.numel()] = order.to(torch.int32)


# ops of a custom-op library (vllm-ascend's `torch.ops._C_ascend`), not of torch_npu itself
CUSTOM = {
    "compressor": fake_compressor,
    "npu_quant_lightning_indexer": fake_quant_lightning_indexer,
    "npu_hc_pre_v2": fake_hc_pre_v2,
    "npu_hc_post": fake_hc_post,
    "npu_sparse_attn_sharedkv": fake_sparse_attn_sharedkv,
    "npu_sparse_attn_sharedkv_metadata": fake_sparse_attn_sharedkv_metadata,
}


def fake_lightning_indexer(
    query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3, pre_tokens=2**63 - 1,
    next_tokens=2**63 - 1, return_value=False,
):  # fmt: skip
    """`torch_npu.npu_lightning_indexer` (op-plugin doc, ops-transformer `attention/lightning_indexer`
    README): per query token the `sparse_count` largest sum_g W[g] * relu(Q[g] . K[j]) over the keys its
    causal limit allows (sparse_mode 3: query i of a batch entry's S1 sees keys j <= S2 - S1 + i);
    query (T, 64, 128) and weights (T, 64) of one dtype (fp16 / bf16), keys PA_BSND (blocks, block_size,
    1, 128) through `block_table`; TND: `actual_seq_lengths_query` cumulative ends, the keys' per entry.
    Returns int32 (T, 1, sparse_count), -1 padded (highest score first; the doc states no tie order:
    here the lower index), and the values when asked."""
    T, N, D = query.shape
    assert layout_query == "TND" and layout_key == "PA_BSND" and sparse_mode == 3 and N == 64 and D == 128
    assert query.dtype in (torch.float16, torch.bfloat16) and weights.dtype == query.dtype == key.dtype
    assert (
        weights.shape == (T, N)
        and key.dim() == 4
        and key.shape[2:] == (1, D)
        and block_table.dtype == torch.int32
    )
    assert actual_seq_lengths_query.dtype == actual_seq_lengths_key.dtype == torch.int32
    out, size = torch.full((T, 1, sparse_count), -1, dtype=torch.int32), key.shape[1]
    for b, t, j in _causal_keys(actual_seq_lengths_query, actual_seq_lengths_key):
        k = key[block_table[b, j // size].long(), j % size, 0].float()  # (seen, D)
        _top(out, t, (torch.relu(query[t].float() @ k.T) * weights[t].float()[:, None]).sum(0), sparse_count)
    return out, torch.empty(0)


FIA = "npu_fused_infer_attention_score"


def fake_fia_out(
    *args: Any, workspace: torch.Tensor, out: list[torch.Tensor], **kwargs: Any
) -> list[torch.Tensor]:
    """`npu_fused_infer_attention_score.out`: the op, its result written into `out` ([attention_out,
    softmax_lse]) given a workspace from `_npu_fused_infer_attention_score_get_max_workspace`."""
    assert isinstance(workspace, torch.Tensor) and len(out) == 2
    got, _ = fake_fused_infer_attention_score(*args, **kwargs)
    assert got.shape == out[0].shape and got.dtype == out[0].dtype, (got.shape, out[0].shape)
    out[0].copy_(got)
    return out


def fake_fia_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`_npu_fused_infer_attention_score_get_max_workspace`: the op's workspace for these arguments."""
    return torch.empty(1 << 10, dtype=torch.uint8)


MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MASK_SIDE = 2048


def _host_lengths(lengths: Any, name: str) -> list[int]:
    """A SymInt[] argument: a host list of non-negative ints (never a device tensor)."""
    assert isinstance(lengths, list | tuple), f"{name}: a host list, not {type(lengths).__name__}"
    assert all(type(n) is int and n >= 0 for n in lengths), f"{name}: non-negative ints"
    return list(lengths)


def _cumulative(ends: list[int], name: str) -> list[int]:
    """TND's cumulative ends -> each batch entry's [start, end)."""
    assert 0 < len(ends) <= 4096 and all(b >= a for a, b in pairwise(ends)), f"{name}: cumulative"
    return [0, *ends]


def _paged_rows(cache, table, b, length, block_size, heads):  # type: ignore[no-untyped-def]
    """Rows 0..length-1 of batch entry b through its block table: (length, KV_N, D). A cache is BnBsH
    (blocks, block_size, KV_N * D) or BnNBsD (blocks, KV_N, block_size, D)."""
    assert length <= table.shape[1] * block_size, "a kv length past the block table"
    j = torch.arange(length)
    blocks = table[b, j // block_size].long()
    assert bool(((blocks >= 0) & (blocks < cache.shape[0])).all()), "a block id out of range"
    if cache.dim() == 3:
        return cache[blocks, j % block_size].view(length, heads, -1)
    return cache[blocks, :, j % block_size]


def _causal_mask_checked(atten_mask: torch.Tensor | None) -> None:
    """sparse_mode 2 / 3 / 4 take the optimized mask: (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048),
    bool / int8 / uint8, 1 (masked) above the diagonal (the user guarantees its triangle)."""
    assert atten_mask is not None, "sparse_mode 3 needs the optimized atten_mask"
    assert atten_mask.dtype in (torch.bool, torch.int8, torch.uint8)
    assert atten_mask.shape in ((MASK_SIDE,) * 2, (1,) + (MASK_SIDE,) * 2, (1, 1) + (MASK_SIDE,) * 2)
    upper = torch.ones(MASK_SIDE, MASK_SIDE, dtype=torch.bool).triu(1)
    assert torch.equal(atten_mask.reshape(MASK_SIDE, MASK_SIDE).bool(), upper), "not the causal mask"


def fake_fused_infer_attention_score(
    query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
    actual_seq_lengths_kv=None, block_table=None, query_rope=None, key_rope=None, num_heads=1, scale=1.0,
    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH", num_key_value_heads=0,
    sparse_mode=0, inner_precise=0, block_size=0, antiquant_mode=0, softmax_lse_flag=False, **others,
):  # fmt: skip
    """`torch_npu.npu_fused_infer_attention_score` (op-plugin doc, ../reference notes 5.1) on Atlas A2 / A3,
    unquantized, BSND and TND: out = softmax(scale * (q . k + q_rope . k_rope) + mask) v per batch entry,
    KV head h // (N / KV_N) for query head h. TND: `actual_seq_lengths` the cumulative query ends (<= 4,096
    entries, the last = T); `actual_seq_lengths_kv` cumulative too, or per entry under PageAttention.
    PageAttention (`block_table` int32 (B, >= pages), `block_size`): key / value / key_rope are pages
    (BnBsH, or BnNBsD under TND); row j of entry b is page block_table[b, j // block_size], offset
    j % block_size; the kv lengths are required. `query_rope` / `key_rope` (D 64) together: MLA, where
    query D is 512 (modelled here), N in 1, 2, 4, ..., 128, KV_N 1, sparse_mode 0 / 3 / 4, block_size a
    multiple of 16 up to 1,024, no softmax_lse. sparse_mode 0 without a mask: none; 3: right-down causal
    (query i of an entry's S1 sees keys j <= S2 - S1 + i) with the optimized 2048 mask. S2 = 0 or no
    visible key: zeros. Inputs contiguous; the lengths host lists; `scale` explicit (default 1.0). Returns
    (out in query's layout with value's D, softmax_lse fp32 (T, N, 1) / (B, N, S, 1) with the flag, else
    a zero (1,))."""
    assert all(v in (None, 0, False) for v in others.values()), f"not modelled: {others}"
    assert pse_shift is None and antiquant_mode == 0 and inner_precise in (0, 1)
    if input_layout not in ("BSND", "TND"):
        raise NotImplementedError(f"input_layout {input_layout!r} is not modelled")
    assert query.dtype in (torch.float16, torch.bfloat16), "query: fp16 / bf16"
    assert key.dtype == value.dtype == query.dtype and key.shape == value.shape, "unquantized K, V alike"
    for t in (query, key, value, query_rope, key_rope):
        assert t is None or t.is_contiguous(), "non-contiguous inputs are not supported"
    tnd, paged, mla = input_layout == "TND", block_table is not None, query_rope is not None
    N, D = query.shape[-2:]
    kv_heads = num_key_value_heads or num_heads
    assert num_heads == N and N % kv_heads == 0 and D <= 512 and isinstance(scale, float)
    assert (key_rope is None) == (not mla), "query_rope and key_rope come together"
    if mla:
        if D != 512:
            raise NotImplementedError("MLA with query D 128 is not modelled")
        assert query_rope.shape == (*query.shape[:-1], 64) and query_rope.dtype == query.dtype
        assert key_rope.dtype == key.dtype and key_rope.shape[:-1] == key.shape[:-1]
        assert key_rope.shape[-1] == 64 * (kv_heads if paged and key.dim() == 3 else 1)
        assert N in MLA_HEADS and kv_heads == 1 and sparse_mode in (0, 3, 4) and not softmax_lse_flag
        assert not paged or (block_size % 16 == 0 and 0 < block_size <= 1024)
    else:
        assert N // kv_heads <= 64
    if sparse_mode == 3:
        _causal_mask_checked(atten_mask)
    elif sparse_mode == 0:
        if atten_mask is not None:
            raise NotImplementedError("sparse_mode 0 with a full mask is not modelled")
    elif sparse_mode in (1, 2, 4):
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not modelled")
    else:
        raise ValueError(f"sparse_mode {sparse_mode}: only 0..4 are supported")
    # each batch entry's query rows, as (entry index into query, row range)
    if tnd:
        q_starts = _cumulative(_host_lengths(actual_seq_lengths, "actual_seq_lengths"), "actual_seq_lengths")
        assert q_starts[-1] == query.shape[0], "TND: the last cumulative length is T"
        B = len(q_starts) - 1
        q_rows = [(slice(q_starts[b], q_starts[b + 1]),) for b in range(B)]
    else:
        B, S = query.shape[:2]
        q_lens = [S] * B
        if actual_seq_lengths is not None and S > 1:  # ignored for Q_S = 1 outside TND
            given = _host_lengths(actual_seq_lengths, "actual_seq_lengths")
            q_lens = given * B if len(given) == 1 else given[:B]
        q_rows = [(b, slice(0, n)) for b, n in enumerate(q_lens)]
    if paged:
        assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == B
        assert key.dim() == 3 or (tnd and key.dim() == 4), "PA caches: BnBsH (BnNBsD under TND too)"
        assert key.shape[1 if key.dim() == 3 else 2] == block_size
        kv_lens = _host_lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv")
        if not tnd:  # one length for all, or the first B
            kv_lens = kv_lens * B if len(kv_lens) == 1 else kv_lens[:B]
        assert len(kv_lens) == B, "PA: one kv length a batch entry"
        if not tnd and query.shape[1] == 1:
            assert max(kv_lens) <= 262144, "Q_S = 1: KV_S up to 262,144"
        if not mla:
            q_max = max(r[-1].stop - (r[-1].start or 0) for r in q_rows)
            assert (0 < block_size <= 512) and (q_max == 1 or block_size % 128 == 0), block_size

        def kv(cache, b):  # type: ignore[no-untyped-def]
            return _paged_rows(cache, block_table, b, kv_lens[b], block_size, kv_heads)
    elif tnd:
        kv_starts = _cumulative(_host_lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv"), "kv lengths")
        assert len(kv_starts) == B + 1 and kv_starts[-1] <= key.shape[0]

        def kv(cache, b):  # type: ignore[no-untyped-def]
            return cache[kv_starts[b] : kv_starts[b + 1]]
    else:
        kv_lens = [key.shape[1]] * B
        if actual_seq_lengths_kv is not None:
            given = _host_lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv")
            kv_lens = given * B if len(given) == 1 else given[:B]

        def kv(cache, b):  # type: ignore[no-untyped-def]
            return cache[b, : kv_lens[b]]

    value_dim = value.shape[-1] // (kv_heads if paged and value.dim() == 3 else 1)  # BnBsH: KV_N * D
    out = query.new_zeros(*query.shape[:-1], value_dim)
    lse = torch.full((*query.shape[:-1], 1), float("-inf"))  # (T, N, 1) / (B, S, N, 1)
    for b, rows in enumerate(q_rows):
        q = query[rows].float()  # (S1, N, D)
        k, v = kv(key, b).float(), kv(value, b).float()  # (S2, KV_N, D)
        S1, S2 = q.shape[0], k.shape[0]
        if S1 == 0 or S2 == 0:
            continue
        group = N // kv_heads
        scores = torch.einsum("qnd,knd->nqk", q, k.repeat_interleave(group, 1))
        if mla:
            k_rope = kv(key_rope, b).float().repeat_interleave(group, 1)
            scores = scores + torch.einsum("qnd,knd->nqk", query_rope[rows].float(), k_rope)
        scores = scores * scale
        if sparse_mode == 3:
            seen = torch.arange(S2)[None, :] <= (S2 - S1 + torch.arange(S1))[:, None]  # (S1, S2)
            scores = scores.masked_fill(~seen, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key: 0
        out[rows] = torch.einsum("nqk,knd->qnd", weights, v.repeat_interleave(group, 1)).to(query.dtype)
        lse[rows] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
    if not softmax_lse_flag:
        return out, torch.zeros(1)
    return out, (lse if tnd else lse.transpose(1, 2))  # TND (T, N, 1); else (B, N, S, 1)


FAKES = {
    "npu_dynamic_quant": fake_dynamic_quant,
    "npu_quant_matmul": fake_quant_matmul,
    "npu_moe_init_routing_v2": fake_init_routing_v2,
    "npu_grouped_matmul": fake_grouped_matmul,
    "npu_moe_token_unpermute": fake_token_unpermute,
    "npu_moe_gating_top_k": fake_gating_top_k,
    "npu_rms_norm": fake_rms_norm,
    "npu_add_rms_norm": fake_add_rms_norm,
    "npu_rotary_mul": fake_rotary_mul,
    "npu_interleave_rope": fake_interleave_rope,
    "npu_lightning_indexer": fake_lightning_indexer,
    "npu_fused_infer_attention_score": fake_fused_infer_attention_score,
    **CUSTOM,
}


# ops of CANN's newer generation (`torch.ops.cann_ops_transformer`), by their `calls` key
NEWER_COMPRESSOR = "cann_ops_transformer.compressor"
NEWER = {
    NEWER_COMPRESSOR: fake_cann_compressor,
    "cann_ops_transformer.mhc_pre_sinkhorn": fake_mhc_pre_sinkhorn,
    "cann_ops_transformer.mhc_post": fake_mhc_post,
    "cann_ops_transformer.sparse_flash_mla": fake_sparse_flash_mla,
    "cann_ops_transformer.sparse_flash_mla_metadata": fake_sparse_flash_mla_metadata,
}
# each custom-library op's newer counterpart
NEWER_OF = {
    "compressor": NEWER_COMPRESSOR,
    "npu_hc_pre_v2": "cann_ops_transformer.mhc_pre_sinkhorn",
    "npu_hc_post": "cann_ops_transformer.mhc_post",
    "npu_sparse_attn_sharedkv": "cann_ops_transformer.sparse_flash_mla",
    "npu_sparse_attn_sharedkv_metadata": "cann_ops_transformer.sparse_flash_mla_metadata",
}


class _Recorder(TorchDispatchMode):
    """Records every aten op a step runs (with its tensors: the graph's static memory); an Ascend op of
    this fake is recorded whole, as one node (`_counted`): it stands for one device kernel."""

    def __init__(self, nodes: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]) -> None:
        super().__init__()
        self.nodes = nodes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError(
                "a host sync (.item(), .tolist(), a data-dependent shape) inside a graph capture"
            )
        out = func(*args, **kwargs)
        self.nodes.append((func, args, kwargs, out))
        return out


_RECORDING: list[_Recorder] = []  # the capture under way, if any


class FakeNPUGraph:
    """`torch.npu.NPUGraph` for tests on the CPU: `graph(g)` records the ops of the step run inside it,
    `replay()` runs them again on the same tensors, writing each result into the tensor the capture
    produced (so a step that reads only its static inputs gives the new results in its static
    outputs, as a real graph does). Host syncs inside a capture raise, as they fail a real capture."""

    def __init__(self) -> None:
        self.nodes: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.nodes:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_leaves(out), tree_leaves(fresh), strict=True):
                if isinstance(old, torch.Tensor) and old is not new:
                    old.copy_(new)


@contextlib.contextmanager
def fake_graph(graph: FakeNPUGraph, pool: Any = None) -> Iterator[None]:
    recorder = _Recorder(graph.nodes)
    _RECORDING.append(recorder)
    try:
        with recorder:
            yield
    finally:
        _RECORDING.pop()


class _FakeStream:
    def __init__(self, device: Any = None) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


@dataclass
class _TaskGroup:
    """A task group of a capture (`graph_task_group_end`'s handle): the nodes it recorded."""

    nodes: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]
    start: int
    end: int

    def update(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op re-issued inside `graph_task_update_begin` / `_end`: its captured task takes the new
        arguments (it writes the same outputs) for the replays after."""
        for i in range(self.start, self.end):
            func, _, _, out = self.nodes[i]
            if func is fn:
                self.nodes[i] = (fn, args, kwargs, out)
                return out
        raise AssertionError("a task update re-issued an op its group did not capture")


_GROUP_STARTS: list[int] = []  # the open task group's first node, in the capture under way
_UPDATING: list[_TaskGroup] = []  # the task group being updated, if any


def fake_task_group_begin(stream: Any) -> None:
    """`torch.npu.graph_task_group_begin(stream)`: the ops issued until `_end` form one task group."""
    assert _RECORDING and not _GROUP_STARTS, "a task group opens inside a capture, one at a time"
    _GROUP_STARTS.append(len(_RECORDING[-1].nodes))


def fake_task_group_end(stream: Any) -> _TaskGroup:
    start, nodes = _GROUP_STARTS.pop(), _RECORDING[-1].nodes
    assert len(nodes) > start, "an empty task group"
    return _TaskGroup(nodes, start, len(nodes))


def fake_task_update_begin(stream: Any, handle: _TaskGroup) -> None:
    """`torch.npu.graph_task_update_begin(stream, handle)`: the ops issued until `_end` give the group's
    tasks their new arguments (outside any capture)."""
    assert isinstance(handle, _TaskGroup) and not _RECORDING and not _UPDATING
    _UPDATING.append(handle)


def fake_task_update_end(stream: Any) -> None:
    assert _UPDATING, "graph_task_update_end without a begin"
    _UPDATING.pop()


def fake_runtime() -> types.ModuleType:
    """The fake's `torch_npu.npu` module (torch.npu): graphs, their task groups and updates, and streams
    (one stream: the CPU's)."""
    rt = types.ModuleType("torch_npu.npu")
    rt.graph_task_group_begin = fake_task_group_begin  # type: ignore[attr-defined]
    rt.graph_task_group_end = fake_task_group_end  # type: ignore[attr-defined]
    rt.graph_task_update_begin = fake_task_update_begin  # type: ignore[attr-defined]
    rt.graph_task_update_end = fake_task_update_end  # type: ignore[attr-defined]
    rt.NPUGraph = FakeNPUGraph  # type: ignore[attr-defined]
    rt.graph = fake_graph  # type: ignore[attr-defined]
    rt.graph_pool_handle = object  # type: ignore[attr-defined]
    rt.Stream = _FakeStream  # type: ignore[attr-defined]
    rt.current_stream = _FakeStream  # type: ignore[attr-defined]
    rt.stream = lambda s: contextlib.nullcontext()  # type: ignore[attr-defined]
    return rt


def _counted(name: str, fn: Any, calls: dict[str, int]) -> Any:
    """`fn` as the fake installs it: counted under `name`; inside a graph capture recorded as one node
    (the op's own steps are the device's business); inside a task update, the new arguments of the
    node its task group captured (not run)."""

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[name] += 1
        if _UPDATING:
            return _UPDATING[-1].update(fn, args, kwargs)
        if not _RECORDING:
            return fn(*args, **kwargs)
        with _disable_current_modes():
            out = fn(*args, **kwargs)
        _RECORDING[-1].nodes.append((fn, args, kwargs, out))
        return out

    return counted


def install(
    monkeypatch: pytest.MonkeyPatch,
    missing: tuple[str, ...] = (),
    fused_compressor: bool = True,
    older: bool = True,
) -> dict[str, int]:
    """Install the fake as `torch_npu`, its custom ops as `torch.ops._C_ascend` and CANN's newer ones as
    `torch.ops.cann_ops_transformer` (without the ops `missing` names, a custom op's newer counterpart
    with it: "compressor", either generation; without the custom library's compressor unless
    `fused_compressor`, nor its mHC and attention ops unless `older`); returns how often each op was
    called."""
    calls: dict[str, int] = dict.fromkeys([*FAKES, *NEWER], 0)
    module = types.ModuleType("torch_npu")
    library, newer = types.SimpleNamespace(), types.SimpleNamespace()
    monkeypatch.setattr(torch.ops, "_C_ascend", library, raising=False)
    monkeypatch.setattr(torch.ops, "cann_ops_transformer", newer, raising=False)
    skip = set(missing) | {NEWER_OF[op] for op in missing if op in NEWER_OF}
    skip |= set() if fused_compressor else {"compressor"}
    skip |= set() if older else set(NEWER_OF) - {"compressor"}
    for name, fn in {**FAKES, **NEWER}.items():
        if name in skip:
            continue

        counted = _counted(name, fn, calls)
        if name == FIA:  # its `.out` form and workspace query (graph captures re-issue it)
            counted.out = _counted(name, fake_fia_out, calls)  # type: ignore[attr-defined]
            module._npu_fused_infer_attention_score_get_max_workspace = fake_fia_workspace  # type: ignore[attr-defined]
        target = library if name in CUSTOM else newer if name in NEWER else module
        setattr(target, name.rsplit(".", 1)[-1], counted)
    module.npu = fake_runtime()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return calls
