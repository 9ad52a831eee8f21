"""Triton kernels of MLA (the contracts of `attention/mla.py`): the fused split + q_a / kv_a RMSNorm
and the attention over the paged latent pool.

Split + norm: one program per token reads its row of the `q_a_proj | kv_a_proj_with_mqa` output once
and writes all three outputs: the normed q latent (skipped when q_lora_rank is None), the normed kv
latent and the rope part k_pe (copied out contiguous). Norms in fp32, weights in fp32, the result
rounded to the activation dtype, as the reference does.

Attention, absorbed as the reference is: q_lat = q_nope W_uk and o = o_lat W_uv are cuBLAS GEMMs
around the kernel; one program per (token, block of heads) walks the token's keys, its request's
positions 0..its own, reading each key's latent row [c | k_pe] straight from the pool through the
request's slots (one row serves every head: c is both the key's first part and the value), with an
online softmax in fp32. Small steps (decodes) split each token's keys over programs of SPLIT keys
(flash-decoding) and fold the partial states in split order in a second kernel; the grid follows
host-known bounds only, so a captured decode step replays it whatever its positions. Keys past a
token's position or past its split are never loaded (masked loads give 0, their logits -inf). Memory:
the partial states of split steps, O(tokens x heads x latent) per split; nothing per key.
The same source is what triton-ascend would compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4serve.attention.mla import MlaDims, MlaMeta, QkvLatents
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2, softmax_update

SPLIT_TOKENS = 64  # steps of at most this many tokens split each token's keys (decodes)
SPLIT = 256  # keys per split program
BLOCK_N = 32  # keys per tile
PREFILL_TOKENS_HEADS = (2, 16)  # a prefill program's rows: 2 tokens x 16 heads (bf16; untuned)
PREFILL_TOKENS_HEADS_FP32 = (1, 16)  # fp32: the registers of 16 rows x 512
NO_MAX = tl.constexpr(-1e30)  # the running max before any key (finite: exp(NO_MAX - m) is 0, not NaN)


@triton.jit
def _norm_part(y_ptr, w_ptr, out_ptr, start, N, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(y_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (w * (x * scale)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_norm_kernel(
    y_ptr,
    q_w_ptr,
    kv_w_ptr,
    q_ptr,
    kv_ptr,
    pe_ptr,
    Q,
    KV,
    R,
    stride_y,
    stride_q,
    stride_kv,
    stride_pe,
    eps,
    HAS_Q: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = y_ptr + t * stride_y
    if HAS_Q:
        _norm_part(row, q_w_ptr, q_ptr + t * stride_q, 0, Q, eps, BLOCK_Q)
    _norm_part(row, kv_w_ptr, kv_ptr + t * stride_kv, Q, KV, eps, BLOCK_KV)
    cols = tl.arange(0, BLOCK_R)
    mask = cols < R
    pe = tl.load(row + Q + KV + cols, mask=mask, other=0.0)
    tl.store(pe_ptr + t * stride_pe + cols, pe, mask=mask)


def qkv_split_norm(
    y: torch.Tensor,
    q_norm: torch.Tensor | None,
    kv_norm: torch.Tensor,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    eps: float,
) -> QkvLatents:
    """y: (T, [q_lora_rank +] kv_lora_rank + rope), rows contiguous."""
    q_width = q_lora_rank or 0
    assert (q_norm is None) == (q_lora_rank is None), "q_norm goes with q_lora_rank"
    assert y.dim() == 2 and y.stride(-1) == 1, "y must be (T, width) with contiguous rows"
    rope = y.shape[1] - q_width - kv_lora_rank
    assert rope > 0, f"{tuple(y.shape)} too narrow for the latents and the rope part"
    assert kv_norm.shape == (kv_lora_rank,) and kv_norm.is_contiguous()
    assert q_norm is None or (q_norm.shape == (q_width,) and q_norm.is_contiguous())
    t = y.shape[0]
    q = torch.empty(t, q_width, dtype=y.dtype, device=y.device) if q_norm is not None else None
    kv = torch.empty(t, kv_lora_rank, dtype=y.dtype, device=y.device)
    k_pe = torch.empty(t, rope, dtype=y.dtype, device=y.device)
    if t:
        q_arg = q if q is not None else kv  # never touched when HAS_Q is off
        _split_norm_kernel[(t,)](
            y,
            q_norm if q_norm is not None else kv_norm,
            kv_norm,
            q_arg,
            kv,
            k_pe,
            q_width,
            kv_lora_rank,
            rope,
            y.stride(0),
            q_arg.stride(0),
            kv.stride(0),
            k_pe.stride(0),
            eps,
            HAS_Q=q is not None,
            BLOCK_Q=pow2(q_width),
            BLOCK_KV=pow2(kv_lora_rank),
            BLOCK_R=pow2(rope),
            num_warps=4,
            **launch_options(y),
        )
    return QkvLatents(q=q, kv=kv, k_pe=k_pe)


@triton.jit
def _attend_keys(
    q_lat, q_pe, acc, m, s_sum, cache_ptr, slots_ptr, lo, hi, last, stride_cache, L, l, lmask, r, rmask,
    scale, FP32: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Keys lo..hi-1 of one request (their slots at slots_ptr) into the online softmax state of each
    row (a (token, head) pair) that sees them: row i sees keys 0..last[i] (causal)."""
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = j < hi
        slot = tl.load(slots_ptr + j, mask=valid, other=0).to(tl.int64)
        row = cache_ptr + slot[:, None] * stride_cache
        c = tl.load(row + l[None, :], mask=valid[:, None] & lmask[None, :], other=0.0)  # (N, L): key, value
        pe = tl.load(row + L + r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)  # (N, R)
        if FP32:
            logits = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            logits += tl.dot(q_pe, tl.trans(pe), input_precision="ieee")
        else:
            logits = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(pe))
        seen = valid[None, :] & (j[None, :] <= last[:, None])  # (rows, N)
        logits = tl.where(seen, logits * scale, float("-inf"))
        acc, m, s_sum = softmax_update(acc, m, s_sum, logits, c, FP32)
    return acc, m, s_sum


@triton.jit
def _mla_attention_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, slots_ptr, req_ptr, pos_ptr, out_ptr, ml_ptr, H, L, R, stride_qt,
    stride_qh, stride_pt, stride_ph, stride_cache, stride_slots, stride_ot, stride_oh, scale,
    FP32: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token's keys (SPLIT == 0) or its split sp's SPLIT keys, for a block of heads: the output
    (SPLIT == 0), else the partial state (unnormalised output at out_ptr[sp], max and sum at ml_ptr)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    l, r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
    lmask, rmask = l < L, r < R
    n = tl.load(pos_ptr + t) + 1  # keys 0..position
    lo, hi = n * 0, n
    if SPLIT:
        lo = tl.program_id(2) * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
    m = tl.full((BLOCK_H,), NO_MAX, tl.float32)
    s_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    if lo < hi:
        q_mask = hmask[:, None] & lmask[None, :]
        q_lat = tl.load(
            q_lat_ptr + t * stride_qt + h[:, None] * stride_qh + l[None, :], mask=q_mask, other=0.0
        )
        pe_mask = hmask[:, None] & rmask[None, :]
        q_pe = tl.load(
            q_pe_ptr + t * stride_pt + h[:, None] * stride_ph + r[None, :], mask=pe_mask, other=0.0
        )
        slots = slots_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_slots
        last = tl.full((BLOCK_H,), n - 1, tl.int32)
        acc, m, s_sum = _attend_keys(q_lat, q_pe, acc, m, s_sum, cache_ptr, slots, lo, hi, last, stride_cache,
                                     L, l, lmask, r, rmask, scale, FP32, BLOCK_N)  # fmt: skip
    out_mask = hmask[:, None] & lmask[None, :]
    if SPLIT:
        part = (tl.program_id(2) * tl.num_programs(0) + t) * H + h  # (split, token, head) rows
        tl.store(out_ptr + part.to(tl.int64)[:, None] * L + l[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + part * 2, m, mask=hmask)
        tl.store(ml_ptr + part * 2 + 1, s_sum, mask=hmask)
    else:
        dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + l[None, :]
        tl.store(dst, (acc / s_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _mla_prefill_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, slots_ptr, cu_ptr, pos_ptr, out_ptr, H, L, R, stride_qt, stride_qh,
    stride_pt, stride_ph, stride_cache, stride_slots, stride_ot, stride_oh, scale, FP32: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK_T consecutive tokens of one request (block program_id(1) of request program_id(0)) x
    BLOCK_H heads: one row per (token, head), every key tile read once for all of them; each row sees
    its request's keys 0..its token's position."""
    enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    first = tl.load(cu_ptr + b) + tl.program_id(1) * BLOCK_T
    end = tl.minimum(tl.load(cu_ptr + b + 1), first + BLOCK_T)
    if first < end:
        i = tl.arange(0, BLOCK_T * BLOCK_H)
        tok, h = first + i // BLOCK_H, tl.program_id(2) * BLOCK_H + i % BLOCK_H
        rows = (tok < end) & (h < H)
        l, r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
        lmask, rmask = l < L, r < R
        last = tl.load(pos_ptr + tok, mask=rows, other=-1).to(tl.int32)
        q_lat = tl.load(q_lat_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + l[None, :],
                        mask=rows[:, None] & lmask[None, :], other=0.0)  # fmt: skip
        q_pe = tl.load(q_pe_ptr + tok[:, None] * stride_pt + h[:, None] * stride_ph + r[None, :],
                       mask=rows[:, None] & rmask[None, :], other=0.0)  # fmt: skip
        m = tl.full((BLOCK_T * BLOCK_H,), NO_MAX, tl.float32)
        s_sum = tl.zeros((BLOCK_T * BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_T * BLOCK_H, BLOCK_L), tl.float32)
        hi = tl.load(pos_ptr + end - 1) + 1  # the block's last token sees the most keys
        slots = slots_ptr + b * stride_slots
        acc, m, s_sum = _attend_keys(q_lat, q_pe, acc, m, s_sum, cache_ptr, slots, 0, hi, last, stride_cache,
                                     L, l, lmask, r, rmask, scale, FP32, BLOCK_N)  # fmt: skip
        s_sum = tl.where(rows, s_sum, 1.0)  # padding rows: no 0 / 0
        dst = out_ptr + tok[:, None] * stride_ot + h[:, None] * stride_oh + l[None, :]
        tl.store(
            dst, (acc / s_sum[:, None]).to(out_ptr.dtype.element_ty), mask=rows[:, None] & lmask[None, :]
        )


@triton.jit
def _mla_fold_kernel(
    part_ptr, ml_ptr, pos_ptr, out_ptr, T, H, L, stride_ot, stride_oh, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A token's split states folded in split order, normalised and stored."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    l = tl.arange(0, BLOCK_L)
    mask = hmask[:, None] & (l < L)[None, :]
    m = tl.full((BLOCK_H,), NO_MAX, tl.float32)
    s_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for sp in range(0, tl.cdiv(tl.load(pos_ptr + t) + 1, SPLIT)):
        part = ((sp * T + t) * H + h).to(tl.int64)
        m_s = tl.load(ml_ptr + part * 2, mask=hmask, other=NO_MAX)
        s_s = tl.load(ml_ptr + part * 2 + 1, mask=hmask, other=0.0)
        a_s = tl.load(part_ptr + part[:, None] * L + l[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha, beta = tl.exp(m - m_new), tl.exp(m_s - m_new)
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        s_sum = s_sum * alpha + s_s * beta
        m = m_new
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + l[None, :]
    s_sum = tl.where(hmask, s_sum, 1.0)  # heads past H: no 0 / 0
    tl.store(dst, (acc / s_sum[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    meta: MlaMeta,
    dims: MlaDims,
) -> torch.Tensor:
    """`mla.mla_attention` on CUDA: the reference's two GEMMs around `latent_attention`."""
    w = kv_b.view(dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    w_uk, w_uv = w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim :]  # (H, nope, L), (H, v, L)
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # (T, H, L)
    o_lat = latent_attention(q_lat, q_pe, cache, meta, dims.softmax_scale)
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def latent_attention(
    q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: MlaMeta, scale: float
) -> torch.Tensor:
    """(T, H, L): per token and head, softmax over its request's keys 0..position of
    (q_lat . c + q_pe . k_pe) * scale, times c. q_lat (T, H, L), q_pe (T, H, R) with contiguous rows;
    cache (slots, L + R); meta.key_slots (B, N) the requests' slots, meta.token_req, meta.positions."""
    T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    assert q_pe.shape[:2] == (T, H) and cache.shape[1] == L + R, (q_pe.shape, cache.shape)
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and cache.stride(-1) == 1
    slots = meta.key_slots
    assert slots.stride(-1) == 1, "key_slots rows must be contiguous"
    out = torch.empty_like(q_lat)
    if T == 0:
        return out
    fp32 = q_lat.dtype == torch.float32
    block_n = 16 if fp32 else BLOCK_N
    block_l, block_r = pow2(L, 16), pow2(R, 16)
    args = (H, L, R, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
            slots.stride(0), out.stride(0), out.stride(1), scale)  # fmt: skip
    if meta.spans is not None and T > SPLIT_TOKENS:  # a prefill: blocks of one request's tokens
        block_t, block_h = PREFILL_TOKENS_HEADS_FP32 if fp32 else PREFILL_TOKENS_HEADS
        blocks = triton.cdiv(max(count for _, count, _ in meta.spans), block_t)
        _mla_prefill_kernel[(len(meta.spans), blocks, triton.cdiv(H, block_h))](
            q_lat, q_pe, cache, slots, meta.cu_seqlens, meta.positions, out, *args, FP32=fp32,
            BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_L=block_l, BLOCK_R=block_r,
            num_warps=8 if block_t * block_h * block_l >= 8192 else 4, **launch_options(q_lat),
        )  # fmt: skip
        return out
    block_h = min(pow2(H, 16), 16 if fp32 else 32)  # fp32 tiles of 32 heads x 512 spill (compile report)
    heads = triton.cdiv(H, block_h)
    warps = 8 if block_h * block_l >= 8192 else 4
    n = slots.shape[1]  # host-known bound on every token's keys
    split = SPLIT if T <= SPLIT_TOKENS and n > SPLIT else 0
    common = dict(BLOCK_H=block_h, BLOCK_L=block_l, num_warps=warps, **launch_options(q_lat))
    inputs = (q_lat, q_pe, cache, slots, meta.token_req, meta.positions)
    if not split:
        _mla_attention_kernel[(T, heads, 1)](
            *inputs, out, out, *args, FP32=fp32, SPLIT=0, BLOCK_N=block_n, BLOCK_R=block_r, **common
        )
        return out
    splits = triton.cdiv(n, split)
    part = torch.empty(splits, T, H, L, dtype=torch.float32, device=q_lat.device)
    ml = torch.empty(splits, T, H, 2, dtype=torch.float32, device=q_lat.device)
    _mla_attention_kernel[(T, heads, splits)](
        *inputs, part, ml, *args, FP32=fp32, SPLIT=split, BLOCK_N=block_n, BLOCK_R=block_r, **common
    )
    _mla_fold_kernel[(T, heads)](
        part, ml, meta.positions, out, T, H, L, out.stride(0), out.stride(1), SPLIT=split, **common
    )
    return out
