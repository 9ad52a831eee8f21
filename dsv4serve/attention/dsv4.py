"""DeepSeek-V4 attention over paged pools: sliding window + compressed sparse (ratio 4, with the
lightning indexer) + heavily compressed, one shared K=V head, per-head sinks.

Keys of every query are gathered from the pools through the slot tables: the last `W` raw positions
from the SWA pool, then the compressed entries (indexer top-k for ratio 4, all visible ones for the
heavily compressed ratio). Compressed entry j is visible to query t iff j < (t + 1) // r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsv4serve.attention.compressor import CompressorWeights, compress_step
from dsv4serve.attention.core import rms_norm, unweighted_rms_norm
from dsv4serve.attention.geometry import StepGeometry
from dsv4serve.attention.rope import apply_rope
from dsv4serve.config import ModelConfig
from dsv4serve.quant import Weight

if TYPE_CHECKING:
    from dsv4serve.backend import Backend


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: Weight  # (Hi*Di, q_lora)
    weights_proj: torch.Tensor  # (Hi, hidden)
    compressor: CompressorWeights


@dataclass(frozen=True)
class AttentionWeights:
    wq_a: Weight
    q_norm: torch.Tensor
    wq_b: Weight
    wkv: Weight
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # (G*o_lora, H*D/G)
    wo_b: Weight  # (hidden, G*o_lora)
    sinks: torch.Tensor  # (H,) fp32
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class AttentionCache:
    """One layer's buffers, as flat views (one row per slot); the step geometry addresses them."""

    swa: torch.Tensor  # (slots, D)
    state: torch.Tensor | None  # (slots, 2*coff*D) fp32 compressor state
    compressed: torch.Tensor | None  # (slots, D) compressed entries
    index_state: torch.Tensor | None  # (slots, 2*2*Di) fp32 indexer compressor state (ratio 4)
    index_keys: torch.Tensor | None  # (slots, Di) indexer keys, at the c4 slots


def attention_forward(
    x: torch.Tensor,
    w: AttentionWeights,
    cache: AttentionCache,
    geo: StepGeometry,
    cfg: ModelConfig,
    ratio: int,
    ops: Backend,
) -> torch.Tensor:
    """x: (T, hidden) -> (T, hidden)."""
    T, H, D, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = geo.rope[ratio > 0]
    q_lora = rms_norm(ops.linear(x, w.wq_a), w.q_norm, eps)  # (T, q_lora)
    q = unweighted_rms_norm(ops.linear(q_lora, w.wq_b).view(T, H, D), eps)  # (T, H, D)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(rms_norm(ops.linear(x, w.wkv), w.kv_norm, eps), cos, sin)  # (T, D)
    cache.swa.index_copy_(0, geo.swa_write, kv.to(cache.swa.dtype))
    keys, visible = cache.swa[geo.window_slots], geo.window_visible  # (T, W, D), (T, W)
    if ratio > 0:
        assert w.compressor is not None and cache.state is not None and cache.compressed is not None
        cgeo = geo.compress[ratio]
        compress_step(x, w.compressor, cache.state, cache.compressed, cgeo, ratio, eps, ops)
        if ratio == 4:
            assert w.indexer is not None and cache.index_state is not None and cache.index_keys is not None
            compress_step(x, w.indexer.compressor, cache.index_state, cache.index_keys, cgeo, ratio, eps, ops)
            chosen, cvisible = _indexed_entries(x, q_lora, w.indexer, cache.index_keys, geo, cfg, ops)
        else:
            chosen, cvisible = cgeo.entry_slots, cgeo.entry_visible
        keys = torch.cat([keys, cache.compressed[chosen].to(keys.dtype)], dim=1)
        visible = torch.cat([visible, cvisible], dim=1)
    out = ops.sink_attention(q, keys.to(q.dtype), visible, w.sinks, D**-0.5)  # (T, H, D)
    out = apply_rope(out, cos, -sin)  # K=V carried rope into the output: rotate it back
    return _grouped_output(out, w, cfg, ops)


def _indexed_entries(
    x: torch.Tensor,
    q_lora: torch.Tensor,
    w: IndexerWeights,
    index_keys: torch.Tensor,
    geo: StepGeometry,
    cfg: ModelConfig,
    ops: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's top `index_topk` visible ratio-4 entries per query: slots and mask."""
    T, Hi, Di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    slots, visible = geo.compress[4].entry_slots, geo.compress[4].entry_visible  # (T, J)
    cos, sin = geo.rope[True]
    qi = apply_rope(ops.linear(q_lora, w.wq_b).view(T, Hi, Di), cos, sin)  # (T, Hi, Di)
    head_w = F.linear(x, w.weights_proj).float() * Hi**-0.5  # (T, Hi)
    scores = ops.indexer_scores(qi, index_keys[slots], head_w, Di**-0.5)  # (T, J)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(cfg.index_topk, slots.shape[1]), dim=-1).indices  # (T, K)
    return slots.gather(1, top), visible.gather(1, top)


def _grouped_output(out: torch.Tensor, w: AttentionWeights, cfg: ModelConfig, ops: Backend) -> torch.Tensor:
    T, G = out.shape[0], cfg.o_groups
    grouped = out.reshape(T, G, -1)  # (T, G, H*D/G)
    wo_a = w.wo_a.view(G, cfg.o_lora_rank, -1)  # (G, o_lora, H*D/G)
    mixed = torch.einsum("tgi,goi->tgo", grouped, wo_a).reshape(T, G * cfg.o_lora_rank)
    return ops.linear(mixed, w.wo_b)
