"""Multi-head latent attention (DeepSeek-V2/V3 MLA, GLM-4.7-Flash) over one paged latent pool: math only.

Each token caches one row per layer, `[c | k_pe]`: the RMS-normed kv latent (kv_lora_rank) and the
roped shared key part (qk_rope_head_dim). Keys and values are never cached per head.
  prefill chunk   non-absorbed: the latents of the visible keys go through `kv_b_proj` to per-head
                  k_nope and v, and the query attends over [k_nope | k_pe]
  decode          absorbed: q_nope goes through kv_b_proj's key half (q_lat = q_nope W_uk), the
                  scores are q_lat . c + q_pe . k_pe over the latents, and the latent output goes
                  through the value half (o = (p c) W_uv^T)
Both are the same function of the cache; a step whose every request brings one token (a decode step)
takes the absorbed form, any other step the non-absorbed one.

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
    key_valid: Tensor  # (B, N) bool: the position is cached (n < seq_len)
    visible: Tensor  # (T, N) bool: causal, key position <= the token's position
    token_req: Tensor  # (T,) batch index of each token's request
    cos: Tensor  # (T, rope / 2) fp32
    sin: Tensor
    decode: bool  # every request brings exactly one token: the absorbed form


def mla_meta(batch: ForwardBatch, full_table: Tensor, inv_freq: Tensor) -> MlaMeta:
    """Step metadata from the batch and the `full` slot table (rows x raw positions)."""
    rows_of_tokens = batch.rows[batch.token_req]  # (T,)
    n = max(batch.max_seq_len, 1)
    span = torch.arange(n, device=batch.positions.device)
    angles = batch.positions[:, None].float() * inv_freq[None, :]  # (T, rope / 2)
    return MlaMeta(
        write_slots=full_table[rows_of_tokens, batch.positions].long(),
        key_slots=full_table[batch.rows, :n].long(),
        key_valid=span[None, :] < batch.seq_lens[:, None],
        visible=span[None, :] <= batch.positions[:, None],
        token_req=batch.token_req,
        cos=angles.cos(),
        sin=angles.sin(),
        decode=batch.num_tokens == int(batch.rows.shape[0]),
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


def mla_attention(
    q_nope: Tensor, q_pe: Tensor, cache: Tensor, kv_b: Tensor, meta: MlaMeta, dims: MlaDims
) -> Tensor:
    """Attention over the cached latents (this step's rows already stored).

    q_nope: (T, H, nope); q_pe: (T, H, rope) rotated; cache: (slots, L + rope) flat;
    kv_b: kv_b_proj's weight (H * (nope + v), L). Returns (T, H, v).
    """
    lat = dims.kv_lora_rank
    rows = cache[meta.key_slots]  # (B, N, L + rope)
    rows = rows.masked_fill(~meta.key_valid[..., None], 0.0)  # select out (a fill, not a multiply)
    c, k_pe = rows[..., :lat], rows[..., lat:]  # (B, N, L), (B, N, rope)
    w = kv_b.view(dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim, lat)  # (H, nope + v, L)
    w_uk, w_uv = w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim :]  # (H, nope, L), (H, v, L)
    req = meta.token_req
    rope_scores = torch.einsum("thr,tnr->thn", q_pe, k_pe[req])  # (T, H, N)
    if meta.decode:
        q_lat = torch.einsum("thd,hdl->thl", q_nope, w_uk)  # (T, H, L)
        scores = torch.einsum("thl,tnl->thn", q_lat, c[req]) + rope_scores
        probs = _softmax(scores * dims.softmax_scale, meta.visible)
        o_lat = torch.einsum("thn,tnl->thl", probs, c[req])  # (T, H, L)
        return torch.einsum("thl,hvl->thv", o_lat, w_uv)
    kv = torch.einsum("bnl,hel->bnhe", c, w)  # (B, N, H, nope + v)
    k_nope, v = kv[..., : dims.qk_nope_head_dim], kv[..., dims.qk_nope_head_dim :]
    scores = torch.einsum("thd,tnhd->thn", q_nope, k_nope[req]) + rope_scores
    probs = _softmax(scores * dims.softmax_scale, meta.visible)
    return torch.einsum("thn,tnhv->thv", probs, v[req])


def _softmax(scores: Tensor, visible: Tensor) -> Tensor:
    """Softmax over visible keys in fp32, cast back; scores (T, H, N), visible (T, N)."""
    masked = scores.float().masked_fill(~visible[:, None, :], float("-inf"))
    return torch.softmax(masked, dim=-1).to(scores.dtype)
