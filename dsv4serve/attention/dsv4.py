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

from dsv4serve.attention.compressor import CompressorCache, CompressorWeights, compress_step
from dsv4serve.attention.core import rms_norm, unweighted_rms_norm
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables, apply_rope
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
    """What one layer reads and writes: flat pool views plus the tables that address them."""

    swa: torch.Tensor  # (slots, D)
    swa_table: torch.Tensor  # (rows, max_len)
    compressed: CompressorCache | None
    index: CompressorCache | None  # indexer keys share the c4 slots


def attention_forward(
    x: torch.Tensor,
    w: AttentionWeights,
    cache: AttentionCache,
    batch: ForwardBatch,
    cfg: ModelConfig,
    ratio: int,
    rope: RopeTables,
    ops: Backend,
) -> torch.Tensor:
    """x: (T, hidden) -> (T, hidden)."""
    T, H, D, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, sin = rope.lookup(batch.positions, compress=ratio > 0)
    q_lora = rms_norm(ops.linear(x, w.wq_a), w.q_norm, eps)  # (T, q_lora)
    q = unweighted_rms_norm(ops.linear(q_lora, w.wq_b).view(T, H, D), eps)  # (T, H, D)
    q = apply_rope(q, cos, sin)
    kv = apply_rope(rms_norm(ops.linear(x, w.wkv), w.kv_norm, eps), cos, sin)  # (T, D)
    rows = batch.rows[batch.token_req]  # (T,)
    cache.swa.index_copy_(0, cache.swa_table[rows, batch.positions].long(), kv.to(cache.swa.dtype))
    keys, visible = _window_keys(cache, rows, batch.positions, cfg.sliding_window)
    if ratio > 0:
        assert w.compressor is not None and cache.compressed is not None
        compress_step(x, w.compressor, cache.compressed, batch, ratio, rope, eps, ops)
        if ratio == 4:
            assert w.indexer is not None and cache.index is not None
            compress_step(x, w.indexer.compressor, cache.index, batch, ratio, rope, eps, ops)
            ckeys, cvisible = _indexed_keys(x, q_lora, w.indexer, cache, batch, rows, cfg, rope, ops)
        else:
            ckeys, cvisible = _compressed_keys(cache.compressed, batch, rows, ratio)
        keys = torch.cat([keys, ckeys.to(keys.dtype)], dim=1)
        visible = torch.cat([visible, cvisible], dim=1)
    out = ops.sink_attention(q, keys.to(q.dtype), visible, w.sinks, D**-0.5)  # (T, H, D)
    out = apply_rope(out, cos, -sin)  # K=V carried rope into the output: rotate it back
    return _grouped_output(out, w, cfg, ops)


def _window_keys(
    cache: AttentionCache, rows: torch.Tensor, positions: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw keys t-W+1..t of every query t: (T, W, D) and a (T, W) visibility mask."""
    offsets = torch.arange(window - 1, -1, -1, device=positions.device)
    pos = positions[:, None] - offsets  # (T, W)
    slots = cache.swa_table[rows[:, None], pos.clamp(min=0)].long()
    return cache.swa[slots], pos >= 0


def _entry_slots(
    table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, ratio: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of compressed entries 0..count-1 per query (T, J) and which are visible (j < (t+1)//r)."""
    j = torch.arange(count, device=positions.device)
    visible = j[None, :] < ((positions + 1) // ratio)[:, None]  # (T, J)
    return table[rows[:, None], j[None, :]].long(), visible


def _compressed_keys(
    cache: CompressorCache, batch: ForwardBatch, rows: torch.Tensor, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    slots, visible = _entry_slots(cache.out_table, rows, batch.positions, ratio, batch.max_seq_len // ratio)
    return cache.out[slots], visible  # (T, J, D), (T, J)


def _indexed_keys(
    x: torch.Tensor,
    q_lora: torch.Tensor,
    w: IndexerWeights,
    cache: AttentionCache,
    batch: ForwardBatch,
    rows: torch.Tensor,
    cfg: ModelConfig,
    rope: RopeTables,
    ops: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer picks the top `index_topk` visible ratio-4 entries per query."""
    assert cache.index is not None and cache.compressed is not None
    T, Hi, Di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    count = batch.max_seq_len // 4
    slots, visible = _entry_slots(cache.index.out_table, rows, batch.positions, 4, count)  # (T, J)
    cos, sin = rope.lookup(batch.positions, compress=True)
    qi = apply_rope(ops.linear(q_lora, w.wq_b).view(T, Hi, Di), cos, sin)  # (T, Hi, Di)
    head_w = F.linear(x, w.weights_proj).float() * Hi**-0.5  # (T, Hi)
    scores = ops.indexer_scores(qi, cache.index.out[slots], head_w, Di**-0.5)  # (T, J)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(cfg.index_topk, count), dim=-1).indices  # (T, K)
    chosen = slots.gather(1, top)
    return cache.compressed.out[chosen], visible.gather(1, top)


def _grouped_output(out: torch.Tensor, w: AttentionWeights, cfg: ModelConfig, ops: Backend) -> torch.Tensor:
    T, G = out.shape[0], cfg.o_groups
    grouped = out.reshape(T, G, -1)  # (T, G, H*D/G)
    wo_a = w.wo_a.view(G, cfg.o_lora_rank, -1)  # (G, o_lora, H*D/G)
    mixed = torch.einsum("tgi,goi->tgo", grouped, wo_a).reshape(T, G * cfg.o_lora_rank)
    return ops.linear(mixed, w.wo_b)
