"""DeepSeek-V4 attention over paged pools: sliding window + compressed sparse (ratio 4, with the
lightning indexer) + heavily compressed, one shared K=V head, per-head sinks.

This is the math of one layer's attention; every pool read and write goes through the backend's op
families (`Backend.dsv4`), which address the pools through the slot tables. Each query attends over its
last `W` raw positions (SWA pool) plus compressed entries: the indexer's top-k for ratio 4, every
visible one for the heavily compressed ratio. Compressed entry j is visible to query t iff
j < (t + 1) // r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.int8_index import Int8Rows
from dsv4serve.attention.step import StepMeta
from dsv4serve.layers.linear import Weight
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config

if TYPE_CHECKING:
    from dsv4serve.backends import Backend


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
    wo_a: Weight  # (G*o_lora, H*D/G): a float tensor, or FP8 blocks (one group's rows whole blocks)
    wo_b: Weight  # (hidden, G*o_lora)
    sinks: torch.Tensor  # (H,) fp32
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class AttentionCache:
    """One layer's buffers, as flat views (one row per slot); the step's tables address them."""

    window: torch.Tensor  # (slots, D) the sliding window's K=V rows
    state: torch.Tensor | None  # (slots, 2*coff*D) fp32 compressor state
    compressed: torch.Tensor | None  # (slots, D) compressed entries
    index_state: torch.Tensor | None  # (slots, 2*2*Di) fp32 indexer compressor state (ratio 4)
    index_keys: torch.Tensor | Int8Rows | None  # (slots, Di) indexer keys at the c4 slots (int8: rows)


def attention_forward(
    x: torch.Tensor,
    w: AttentionWeights,
    cache: AttentionCache,
    meta: StepMeta,
    cfg: DeepseekV4Config,
    ratio: int,
    ops: Backend,
) -> torch.Tensor:
    """x: (T, hidden), already normed -> (T, hidden): the sum over the weights' heads (a rank's
    share of them under tensor parallelism; the KV, compressors and indexer are whole on every rank)."""
    T, H, D, eps = x.shape[0], w.sinks.shape[0], cfg.head_dim, cfg.rms_norm_eps
    compress, dsv4 = ratio > 0, ops.dsv4  # layers with a compressor use the compress rope throughout

    def queries() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        q_lora = ops.rms_norm(ops.linear(x, w.wq_a), w.q_norm, eps)  # (T, q_lora)
        q = dsv4.q_norm_rope(ops.linear(q_lora, w.wq_b).view(T, H, D), meta, compress, eps)  # (T, H, D)
        return q, _indexer_queries(x, q_lora, w.indexer, meta, cfg, ops) if ratio == 4 else None

    def keys() -> None:  # this step's window entries and compressed entries: nothing queries() reads
        dsv4.kv_norm_rope_store(ops.linear(x, w.wkv), w.kv_norm, cache.window, meta, compress, eps)
        if ratio:
            assert w.compressor is not None and cache.state is not None and cache.compressed is not None
            dsv4.compressor(x, w.compressor, cache.state, cache.compressed, meta, ratio, eps)
        if ratio == 4:
            assert w.indexer is not None and cache.index_state is not None and cache.index_keys is not None
            dsv4.compressor(x, w.indexer.compressor, cache.index_state, cache.index_keys, meta, ratio, eps)

    (q, index_queries), _ = ops.beside(x, queries, keys)
    chosen = None
    if index_queries is not None:  # the lightning indexer's top index_topk visible ratio-4 entries
        assert cache.index_keys is not None
        qi, head_w = index_queries
        scale = cfg.index_head_dim**-0.5
        chosen = dsv4.indexer_topk(qi, head_w, cache.index_keys, meta, cfg.index_topk, scale)
    out = dsv4.sparse_attention(q, cache.window, cache.compressed, chosen, meta, w.sinks, D**-0.5, ratio)
    return _grouped_output(out, w, cfg, ops)  # out: (T, H, D), its rope slice rotated back


def _indexer_queries(
    x: torch.Tensor,
    q_lora: torch.Tensor,
    w: IndexerWeights | None,
    meta: StepMeta,
    cfg: DeepseekV4Config,
    ops: Backend,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The lightning indexer's queries (T, Hi, Di) and head weights (T, Hi) fp32: (T, K) int32 entries
    come from them and the index keys (`indexer_topk`, -1 = none); None when no query of the step can
    see more than `index_topk` entries (then it chooses them all)."""
    assert w is not None
    if meta.num_entries[4] <= cfg.index_topk:
        return None
    T, Hi, Di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    qi = ops.dsv4.rope(ops.linear(q_lora, w.wq_b).view(T, Hi, Di), meta, True, False)  # (T, Hi, Di)
    return qi, ops.linear(x, w.weights_proj).float() * Hi**-0.5


def _grouped_output(
    out: torch.Tensor, w: AttentionWeights, cfg: DeepseekV4Config, ops: Backend
) -> torch.Tensor:
    """Each output group's heads through its rows of wo_a (mixed[t, g] = wo_a[g] @ out[t, g]), then
    wo_b."""
    T, R = out.shape[0], cfg.o_lora_rank
    G = w.wo_a.shape[0] // R  # the weights' output groups
    return ops.linear(ops.grouped_linear(out.reshape(T, -1), w.wo_a, G), w.wo_b)
