"""Multi-head latent attention (DeepSeek-V2/V3 MLA, GLM-4.7-Flash) over one paged latent pool: math only.

Each token caches one row per layer, `[c | k_pe]`: the RMS-normed kv latent (kv_lora_rank) and the
roped shared key part (qk_rope_head_dim). Keys and values are never cached per head.

Every token, of a prefill or a decode, attends in the absorbed form: q_nope goes through kv_b_proj's
key half (q_lat = q_nope W_uk), the scores are q_lat . c + q_pe . k_pe over the cached latents of its
request's positions 0..its own, and the latent output goes through the value half
(o = (p c) W_uv^T). (The non-absorbed form, keys and values expanded per head, is the same function
of the cache; one form for every token keeps a token's result independent of the step it runs in. A
backend may run prefills expanded, as the CUDA backend does over FlashAttention.)
An eager step (its requests' spans known on the host) gathers each request's latents once and its
tokens attend to them in chunks whose scores stay under `GATHER_ELEMENTS`; a captured step (decodes:
one token per request) gathers per token, in chunks likewise bounded. Memory is linear in tokens +
context, never tokens x context.

RoPE is GPT-J style (interleaved pairs (x0, x1), (x2, x3), ... rotated by one frequency each) with the
result laid out as [rotated evens | rotated odds], as the reference model does; q and k share the
layout, so their dot products are those of the interleaved form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4serve.attention.core import rms_norm
from dsv4serve.attention.metadata import ForwardBatch

Tensor = torch.Tensor
GATHER_ELEMENTS = 1 << 20  # values a chunk of tokens gathers or scores at once (4 MiB in fp32: cache-sized)


@dataclass(frozen=True)
class MlaDims:
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float  # q_a / kv_a RMSNorm
    softmax_scale: float

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MlaMeta:
    """Built once per step for every layer: where tokens write and which cached rows they read."""

    write_slots: Tensor  # (T,) latent-pool slot of each token
    key_slots: Tensor  # (B, N) slots of each request's positions 0..N-1, N = the step's max seq len
    token_req: Tensor  # (T,) batch index of each token's request
    cu_seqlens: Tensor  # (B + 1,) flat index of each request's first token
    positions: Tensor  # (T,) each token's position: it sees its request's keys 0..position
    cos: Tensor  # (T, rope / 2) fp32
    sin: Tensor
    spans: tuple[tuple[int, int, int], ...] | None  # the batch's host-known request spans, if any


def mla_meta(batch: ForwardBatch, full_table: Tensor, inv_freq: Tensor) -> MlaMeta:
    """Step metadata from the batch and the `full` slot table (rows x raw positions)."""
    rows_of_tokens = batch.rows[batch.token_req]  # (T,)
    n = max(batch.max_seq_len, 1)
    angles = batch.positions[:, None].float() * inv_freq[None, :]  # (T, rope / 2)
    return MlaMeta(
        write_slots=full_table[rows_of_tokens, batch.positions].long(),
        key_slots=full_table[batch.rows, :n].long(),
        token_req=batch.token_req,
        cu_seqlens=batch.cu_seqlens,
        positions=batch.positions,
        cos=angles.cos(),
        sin=angles.sin(),
        spans=batch.spans,
    )


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (T, ..., R) pairs (x[2i], x[2i+1]); cos, sin: (T, R / 2). Returns [evens' | odds'] (T, ..., R)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@dataclass(frozen=True)
class QkvLatents:
    """The fused split + norm op's outputs: every value a later step reads, on every path."""

    q: Tensor | None  # (T, q_lora_rank) normed q latent; None when the model has no q_lora_rank
    kv: Tensor  # (T, kv_lora_rank) normed kv latent
    k_pe: Tensor  # (T, qk_rope_head_dim) the rope part, not yet rotated


def qkv_split_norm(
    y: Tensor,
    q_norm: Tensor | None,
    kv_norm: Tensor,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    eps: float,
) -> QkvLatents:
    """Reference of the fused op. y: (T, [q_lora_rank +] kv_lora_rank + rope), the output of
    `q_a_proj | kv_a_proj_with_mqa` (or of kv_a_proj_with_mqa alone when q_lora_rank is None)."""
    q_width = q_lora_rank or 0
    assert (q_norm is None) == (q_lora_rank is None), "q_norm goes with q_lora_rank"
    assert y.shape[-1] > q_width + kv_lora_rank, f"{y.shape} too narrow for the latents and the rope part"
    q = rms_norm(y[:, :q_width], q_norm, eps) if q_norm is not None else None
    kv = rms_norm(y[:, q_width : q_width + kv_lora_rank], kv_norm, eps)
    return QkvLatents(q=q, kv=kv, k_pe=y[:, q_width + kv_lora_rank :])


def store_latents(cache: Tensor, meta: MlaMeta, kv: Tensor, k_pe: Tensor) -> None:
    """Write each token's row [c | k_pe] (T, latent_width) at its slot of the layer's flat buffer."""
    cache[meta.write_slots] = torch.cat([kv, k_pe], dim=-1).to(cache.dtype)


def rope_store(q_pe: Tensor, latents: QkvLatents, cache: Tensor, meta: MlaMeta) -> None:
    """The step's rope and latent write: q_pe (T, H, rope: a view of q) rotated in place, each token's
    row [c | rotated k_pe] stored at its slot."""
    store_latents(cache, meta, latents.kv, rope_interleaved(latents.k_pe, meta.cos, meta.sin))
    q_pe.copy_(rope_interleaved(q_pe, meta.cos, meta.sin))


def mla_attention(
    q: Tensor,
    cache: Tensor,
    kv_b: Tensor,
    meta: MlaMeta,
    dims: MlaDims,
    bound: int = GATHER_ELEMENTS,
) -> Tensor:
    """Attention over the cached latents (this step's rows already stored), in the absorbed form.

    q: (T, H, nope + rope), its rope part rotated; cache: (slots, L + rope) flat;
    kv_b: kv_b_proj's weight (H * (nope + v), L). Returns (T, H, v). `bound`: the values a chunk of
    tokens gathers or scores at once (a backend sets it for its device's memory and launch costs).
    """
    q_lat, q_pe, w_uv = absorbed(q, kv_b, dims)
    if meta.spans is None:
        o_lat = _per_token(q_lat, q_pe, cache, meta, dims, bound)
    else:
        o_lat = _per_request(q_lat, q_pe, cache, meta, dims, meta.spans, bound)
    return torch.einsum("thl,hvl->thv", o_lat, w_uv)


def absorbed(q: Tensor, kv_b: Tensor, dims: MlaDims) -> tuple[Tensor, Tensor, Tensor]:
    """q's latent query q_nope W_uk (T, H, L), its rope part (T, H, rope) and W_uv (H, v, L): what the
    absorbed form attends with, and the value half its latent output goes through."""
    nope = dims.qk_nope_head_dim
    w = kv_b.view(dims.num_heads, nope + dims.v_head_dim, dims.kv_lora_rank)  # (H, nope + v, L)
    q_lat = torch.einsum("thd,hdl->thl", q[..., :nope], w[:, :nope])  # (T, H, L)
    return q_lat, q[..., nope:], w[:, nope:]


def _per_request(
    q_lat: Tensor,
    q_pe: Tensor,
    cache: Tensor,
    meta: MlaMeta,
    dims: MlaDims,
    spans: tuple[tuple[int, int, int], ...],
    bound: int,
) -> Tensor:
    """Each request's latents gathered once; its tokens in chunks of scores below the bound."""
    lat, o_lat = dims.kv_lora_rank, torch.empty_like(q_lat)
    for b, (first, count, n) in enumerate(spans):
        rows = cache[meta.key_slots[b, :n]]  # (n, L + rope): positions 0..n-1, all written
        c, k_pe = rows[:, :lat], rows[:, lat:]
        span = torch.arange(n, device=q_lat.device)
        chunk = max(1, bound // (n * dims.num_heads))
        for t0 in range(first, first + count, chunk):
            t = slice(t0, min(first + count, t0 + chunk))
            scores = torch.einsum("thl,nl->thn", q_lat[t], c) + torch.einsum("thr,nr->thn", q_pe[t], k_pe)
            probs = _softmax(scores * dims.softmax_scale, span[None, :] <= meta.positions[t, None])
            o_lat[t] = torch.einsum("thn,nl->thl", probs, c)
    return o_lat


def _per_token(
    q_lat: Tensor, q_pe: Tensor, cache: Tensor, meta: MlaMeta, dims: MlaDims, bound: int
) -> Tensor:
    """Each token gathers its request's latents (a captured step: spans unknown on the host), in
    chunks of tokens whose gathers stay below the bound."""
    lat, T, o_lat = dims.kv_lora_rank, q_lat.shape[0], torch.empty_like(q_lat)
    n = meta.key_slots.shape[1]
    span = torch.arange(n, device=q_lat.device)
    chunk = max(1, bound // (n * cache.shape[1]))
    for t0 in range(0, T, chunk):
        t = slice(t0, min(T, t0 + chunk))
        visible = span[None, :] <= meta.positions[t, None]  # (t, N): causal, within the request
        rows = cache[meta.key_slots[meta.token_req[t]]]  # (t, N, L + rope)
        rows = rows.masked_fill(~visible[..., None], 0.0)  # select out (a fill, not a multiply)
        c, k_pe = rows[..., :lat], rows[..., lat:]  # (t, N, L), (t, N, rope)
        scores = torch.einsum("thl,tnl->thn", q_lat[t], c) + torch.einsum("thr,tnr->thn", q_pe[t], k_pe)
        probs = _softmax(scores * dims.softmax_scale, visible)
        o_lat[t] = torch.einsum("thn,tnl->thl", probs, c)
    return o_lat


def _softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """Softmax over visible keys in fp32, cast back; scores (T, H, N), visible (T, N)."""
    masked = scores.float().masked_fill(~visible[:, None, :], float("-inf"))
    return torch.softmax(masked, dim=-1).to(scores.dtype)
