"""Triton kernels of MLA (the contracts of `attention/mla.py`): the fused split + q_a / kv_a RMSNorm
and the attention over the paged latent pool.

Split + norm: `backends/split_norm.py`'s source (the npu backend compiles it with triton-ascend), here
launched with PDL.

Attention, absorbed as the reference is: q_lat = q_nope W_uk and o = o_lat W_uv are cuBLAS GEMMs
around the kernel; one program per (token, block of heads) walks the token's keys, its request's
positions 0..its own, reading each key's latent row [c | k_pe] straight from the pool through the
request's slots (one row serves every head: c is both the key's first part and the value), with an
online softmax in fp32. Small steps (decodes) split each token's keys over programs of SPLIT keys
(flash-decoding) and fold the partial states in split order in a second kernel; the grid follows
host-known bounds only, so a captured decode step replays it whatever its positions. Keys past a
token's position or past its split are never loaded (masked loads give 0, their logits -inf). Memory:
the partial states of split steps, O(tokens x heads x latent) per split; nothing per key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4serve.attention.mla import MlaDims, MlaMeta, QkvLatents, absorbed
from dsv4serve.backends import split_norm
from dsv4serve.backends.cuda.transfers import to_device
from dsv4serve.backends.cuda.triton_utils import enter, launch_options, pow2, softmax_update
from dsv4serve.backends.split_norm import split_norm_row

SPLIT_TOKENS = 64  # steps of at most this many tokens split each token's keys (decodes)
# launch choices measured on the H200 (benchmarks/bench_mla.py --sweep, RESULTS.md run 66)
SPLIT = 512  # keys per split program of steps with SPLIT_PROGRAMS (token, head block, split) programs or
SPLIT_PROGRAMS = 128  # more; fewer programs: about FEW_SPLITS splits a token, SPLIT_MIN keys or more each
SPLIT_MIN, FEW_SPLITS = 128, 8
FOLD_L, FOLD_SPLITS = 32, 8  # a fold program's latent columns, and splits it loads at once
BLOCK_N = 64  # keys per tile (bf16)
PREFILL_ROWS = 64  # a prefill program's (token, head) rows (bf16)
PREFILL_ROWS_FP32 = 16  # fp32: the registers of 16 rows x 512
PREFILL_BLOCK_N = 32  # keys per tile of a prefill program (64: faster, but spills)
# bf16 launch options of each kernel family over the rule's warps and Triton's default stages
LAUNCH: dict[str, dict[str, int]] = {"decode": {}, "prefill": {"num_stages": 2}}
NO_MAX = tl.constexpr(-1e30)  # the running max before any key (finite: exp(NO_MAX - m) is 0, not NaN)


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
    split_norm_row(
        y_ptr, q_w_ptr, kv_w_ptr, q_ptr, kv_ptr, pe_ptr, tl.program_id(0).to(tl.int64), Q, KV, R,
        stride_y, stride_q, stride_kv, stride_pe, eps, HAS_Q, BLOCK_Q, BLOCK_KV, BLOCK_R,
    )  # fmt: skip


# the shared source (`backends/split_norm.py`) launched as CUDA launches every kernel (PDL on Hopper)
def _split_norm_options(y: torch.Tensor) -> dict[str, Any]:
    return {"num_warps": 4, **launch_options(y)}


qkv_split_norm = partial(split_norm.qkv_split_norm, kernel=_split_norm_kernel, options=_split_norm_options)


@triton.jit
def _rotate(src, dst, cos, sin, j, jmask, HALF, DTYPE: tl.constexpr):
    """Interleaved pairs (src[2j], src[2j + 1]) rotated to [evens' | odds'] at dst (dst may be src:
    every load before any store), with the rounding of the reference's ops in DTYPE (cos and sin
    rounded first, each product, then the sum)."""
    x1 = tl.load(src + 2 * j, mask=jmask, other=0.0).to(tl.float32)
    x2 = tl.load(src + 2 * j + 1, mask=jmask, other=0.0).to(tl.float32)
    tl.debug_barrier()
    a, b = (x1 * cos).to(DTYPE).to(tl.float32), (x2 * sin).to(DTYPE).to(tl.float32)
    c, d = (x2 * cos).to(DTYPE).to(tl.float32), (x1 * sin).to(DTYPE).to(tl.float32)
    tl.store(dst + j, (a - b).to(DTYPE).to(dst.dtype.element_ty), mask=jmask)
    tl.store(dst + HALF + j, (c + d).to(DTYPE).to(dst.dtype.element_ty), mask=jmask)


@triton.jit
def _rope_store_kernel(
    q_ptr, kv_ptr, pe_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr, H, L, HALF, stride_qt, stride_qh,
    stride_kv, stride_pe, stride_cos, stride_cache, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token: its q_pe heads rotated in place (all heads in one block: a loop over them left a
    batch-1 step waiting on each head's loads in turn), its row [c | rotated k_pe] written at its slot
    of the latent pool."""
    enter(PDL)
    DTYPE = q_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    cos = tl.load(cos_ptr + t * stride_cos + j, mask=jmask, other=0.0).to(DTYPE).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_cos + j, mask=jmask, other=0.0).to(DTYPE).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    heads = q_ptr + t * stride_qt + h[:, None] * stride_qh  # (BLOCK_H, 1)
    both = (h < H)[:, None] & jmask[None, :]
    _rotate(heads, heads, cos[None, :], sin[None, :], j[None, :], both, HALF, DTYPE)
    row = cache_ptr + tl.load(slots_ptr + t).to(tl.int64) * stride_cache
    l = tl.arange(0, BLOCK_L)
    c = tl.load(kv_ptr + t * stride_kv + l, mask=l < L)
    tl.store(row + l, c.to(cache_ptr.dtype.element_ty), mask=l < L)
    _rotate(pe_ptr + t * stride_pe, row + L, cos, sin, j, jmask, HALF, DTYPE)


def rope_store(q_pe: torch.Tensor, latents: QkvLatents, cache: torch.Tensor, meta: MlaMeta) -> None:
    """`mla.rope_store` in one kernel a token: q_pe (T, H, R) rotated in place (unit last stride)."""
    T, H, R = q_pe.shape
    kv, k_pe = latents.kv, latents.k_pe
    L = kv.shape[1]
    assert q_pe.stride(-1) == 1 and kv.stride(-1) == 1 and k_pe.stride(-1) == 1 and cache.stride(-1) == 1
    assert meta.cos.stride(-1) == 1 and meta.sin.stride() == meta.cos.stride()
    if T == 0:
        return
    _rope_store_kernel[(T,)](
        q_pe, kv, k_pe, meta.cos, meta.sin, meta.write_slots, cache, H, L, R // 2, q_pe.stride(0),
        q_pe.stride(1), kv.stride(0), k_pe.stride(0), meta.cos.stride(0), cache.stride(0), BLOCK_H=pow2(H),
        BLOCK_L=pow2(L, 16), BLOCK_HALF=pow2(R // 2, 16), num_warps=4, **launch_options(q_pe),
    )  # fmt: skip


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Rows program_id(1) * BLOCK_M.. of request program_id(0)'s (token, head) pairs, token-major (so
    no head is padded whatever H is): every key tile read once for all of them; each row sees its
    request's keys 0..its token's position."""
    enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    start, stop = tl.load(cu_ptr + b), tl.load(cu_ptr + b + 1)
    i = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(1) * BLOCK_M < (stop - start) * H:
        tok, h = start + i // H, i % H
        rows = tok < stop
        l, r = tl.arange(0, BLOCK_L), tl.arange(0, BLOCK_R)
        lmask, rmask = l < L, r < R
        last = tl.load(pos_ptr + tok, mask=rows, other=-1).to(tl.int32)
        q_lat = tl.load(q_lat_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + l[None, :],
                        mask=rows[:, None] & lmask[None, :], other=0.0)  # fmt: skip
        q_pe = tl.load(q_pe_ptr + tok[:, None] * stride_pt + h[:, None] * stride_ph + r[None, :],
                       mask=rows[:, None] & rmask[None, :], other=0.0)  # fmt: skip
        m = tl.full((BLOCK_M,), NO_MAX, tl.float32)
        s_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_L), tl.float32)
        hi = tl.max(last) + 1  # the block's last token sees the most keys
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
    FOLD_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A token's split states folded, normalised and stored: BLOCK_L latent columns (block
    program_id(2)) of a block of heads; FOLD_SPLITS splits loaded at once, those groups in order."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask = hmask[:, None] & (l < L)[None, :]
    m = tl.full((BLOCK_H,), NO_MAX, tl.float32)
    s_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    splits = tl.cdiv(tl.load(pos_ptr + t) + 1, SPLIT)
    for first in range(0, splits, FOLD_SPLITS):
        sp = first + tl.arange(0, FOLD_SPLITS)
        live = (sp < splits)[:, None] & hmask[None, :]  # (S, heads)
        part = ((sp[:, None] * T + t) * H + h[None, :]).to(tl.int64)
        m_s = tl.load(ml_ptr + part * 2, mask=live, other=NO_MAX)
        s_s = tl.load(ml_ptr + part * 2 + 1, mask=live, other=0.0)
        a_s = tl.load(part_ptr + part[:, :, None] * L + l[None, None, :], mask=live[:, :, None] & mask[None],
                      other=0.0)  # fmt: skip
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        w = tl.exp(m_s - m_new[None, :])  # (S, heads): 0 for splits past the token's keys
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.sum(a_s * w[:, :, None], axis=0)
        s_sum = s_sum * alpha + tl.sum(s_s * w, axis=0)
        m = m_new
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + l[None, :]
    s_sum = tl.where(hmask, s_sum, 1.0)  # heads past H: no 0 / 0
    tl.store(dst, (acc / s_sum[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _flash_varlen() -> Callable[..., torch.Tensor] | None:
    """torch's FlashAttention over ragged batches, causal aligned bottom-right (a query sees the keys
    up to its own place at the end of its sequence's keys), or None where this torch has none or
    there is no GPU."""
    if torch.cuda.device_count() == 0:  # (through NVML: importing this module starts no CUDA)
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "num_splits" in params:
        causal["num_splits"] = 1  # no split over keys: a request's result independent of the batch

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: float) -> torch.Tensor:  # fmt: skip
        out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal)
        assert isinstance(out, torch.Tensor)
        return out

    return attend


FLASH_VARLEN = _flash_varlen()  # the expanded prefill path needs it (tests substitute a reference)


def expanded_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    meta: MlaMeta,
    dims: MlaDims,
    spans: tuple[tuple[int, int, int], ...],
) -> torch.Tensor:
    """A prefill step in the expanded form: each request's keys [c W_uk | k_pe] and values c W_uv
    expanded from its latents once for the step (O(context) memory), then FlashAttention over the
    ragged batch. Half the products of the absorbed form per key (qk 256 + v 256 against 576 + 512
    at GLM's dimensions); the same softmax and scale."""
    assert FLASH_VARLEN is not None
    H, nope, R, L = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.kv_lora_rank
    counts, lengths = [n for _, n, _ in spans], [s for _, _, s in spans]
    assert [first for first, _, _ in spans] == list(accumulate(counts[:-1], initial=0))
    rows = torch.cat([meta.key_slots[b, :seq_len] for b, seq_len in enumerate(lengths)])
    latents = cache[rows.long()]  # (keys, L + R): each request's keys once
    kv = F.linear(latents[:, :L], kv_b).view(-1, H, nope + dims.v_head_dim)
    k = torch.empty(kv.shape[0], H, nope + R, dtype=kv.dtype, device=kv.device)
    k[..., :nope], k[..., nope:] = kv[..., :nope], latents[:, None, L:]  # (two copies: faster than cat)
    v = kv[..., nope:]  # rows and heads strided: FlashAttention needs only a unit last stride
    bounds = [list(accumulate(counts, initial=0)), list(accumulate(lengths, initial=0))]
    cu_q, cu_k = to_device(torch.tensor(bounds, dtype=torch.int32), q.device)  # no wait for the device
    return FLASH_VARLEN(q, k, v, cu_q, cu_k, max(counts), max(lengths), dims.softmax_scale)


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_b: torch.Tensor,
    meta: MlaMeta,
    dims: MlaDims,
) -> torch.Tensor:
    """`mla.mla_attention` on CUDA: prefill steps of 16-bit activations in the expanded form over
    FlashAttention where torch has it (qk and v head dims equal, as FlashAttention needs); every other
    step the reference's two GEMMs around `latent_attention`."""
    spans = meta.spans
    expandable = dims.qk_nope_head_dim + dims.qk_rope_head_dim == dims.v_head_dim
    if (spans is not None and q.shape[0] > SPLIT_TOKENS and expandable and FLASH_VARLEN is not None
            and q.dtype in (torch.bfloat16, torch.float16) and q.stride(-1) == 1):  # fmt: skip
        return expanded_prefill(q, cache, kv_b, meta, dims, spans)
    q_lat, q_pe, w_uv = absorbed(q, kv_b, dims)
    o_lat = latent_attention(q_lat, q_pe, cache, meta, dims.softmax_scale)
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def split_keys(n: int, rows: int) -> int:
    """Keys per split program of a small step of `rows` (token, head block) pairs over at most n keys:
    SPLIT where that makes SPLIT_PROGRAMS programs, else a power of two near n / FEW_SPLITS within
    [SPLIT_MIN, SPLIT] (more programs for short contexts; few splits for the fold to combine)."""
    if rows * triton.cdiv(n, SPLIT) >= SPLIT_PROGRAMS:
        return SPLIT
    return max(SPLIT_MIN, min(SPLIT, 1 << max(n // FEW_SPLITS, 1).bit_length() - 1))


def tuned(family: str, fp32: bool) -> dict[str, int]:
    return {} if fp32 else LAUNCH[family]


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
        block_m = PREFILL_ROWS_FP32 if fp32 else PREFILL_ROWS
        blocks = triton.cdiv(max(count for _, count, _ in meta.spans) * H, block_m)
        launch = {"num_warps": 8 if block_m * block_l >= 8192 else 4} | tuned("prefill", fp32)
        _mla_prefill_kernel[(len(meta.spans), blocks)](
            q_lat, q_pe, cache, slots, meta.cu_seqlens, meta.positions, out, *args, FP32=fp32,
            BLOCK_M=block_m, BLOCK_N=block_n if fp32 else PREFILL_BLOCK_N, BLOCK_L=block_l,
            BLOCK_R=block_r, **launch, **launch_options(q_lat),
        )  # fmt: skip
        return out
    block_h = min(pow2(H, 16), 16 if fp32 else 32)  # fp32 tiles of 32 heads x 512 spill (compile report)
    heads = triton.cdiv(H, block_h)
    warps = 8 if block_h * block_l >= 8192 else 4
    n = slots.shape[1]  # host-known bound on every token's keys
    split = split_keys(n, T * heads)
    split = split if T <= SPLIT_TOKENS and n > split else 0
    common = dict(BLOCK_H=block_h, BLOCK_L=block_l, **({"num_warps": warps} | tuned("decode", fp32)))
    common |= launch_options(q_lat)
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
    fold_l = min(FOLD_L, block_l)
    _mla_fold_kernel[(T, heads, triton.cdiv(L, fold_l))](
        part, ml, meta.positions, out, T, H, L, out.stride(0), out.stride(1), SPLIT=split,
        FOLD_SPLITS=min(FOLD_SPLITS, pow2(splits, 1)), **(common | {"BLOCK_L": fold_l, "num_warps": 4}),
    )  # fmt: skip
    return out
