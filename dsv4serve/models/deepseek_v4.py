"""DeepSeek-V4: math only. mHC residual streams, DSV4 attention over pools, hash / top-k MoE.

The model takes a flat batch of tokens from many requests (`ForwardBatch`), the device pools and
the slot tables, and returns logits. No device strings, scheduling or logging here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.dsv4 import AttentionCache, AttentionWeights, IndexerWeights, attention_forward
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.attention.step import StepMeta
from dsv4serve.config import ModelConfig
from dsv4serve.memory.pools import flat
from dsv4serve.mhc import HcParams, HyperConnection
from dsv4serve.moe.routing import SCORINGS
from dsv4serve.quant import Weight, Weights, plain

if TYPE_CHECKING:
    from dsv4serve.backend import Backend
    from dsv4serve.memory.pools import KVPools
    from dsv4serve.memory.tables import SlotTables


@dataclass(frozen=True)
class MoEWeights:
    gate: torch.Tensor  # (E, hidden)
    bias: torch.Tensor | None  # (E,) fp32, top-k layers
    tid2eid: torch.Tensor | None  # (vocab, k) int64, hash layers
    w1: Weight  # (E, I, hidden)
    w2: Weight  # (E, hidden, I)
    w3: Weight  # (E, I, hidden)
    shared: tuple[Weight, Weight, Weight] | None  # w1, w2, w3


@dataclass(frozen=True)
class LayerWeights:
    ratio: int
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    attn: AttentionWeights
    ffn: MoEWeights


def _compressor(w: Weights, prefix: str) -> CompressorWeights:
    return CompressorWeights(
        wkv_gate=torch.cat([plain(w, f"{prefix}.wkv.weight"), plain(w, f"{prefix}.wgate.weight")]),
        ape=plain(w, f"{prefix}.ape"),
        norm=plain(w, f"{prefix}.norm.weight"),
    )


def _layer(w: Weights, cfg: ModelConfig, i: int) -> LayerWeights:
    p, ratio = f"layers.{i}.", cfg.compress_ratios[i]
    a = p + "attn."
    indexer = None
    if ratio == 4:
        indexer = IndexerWeights(
            wq_b=w[a + "indexer.wq_b.weight"],
            weights_proj=plain(w, a + "indexer.weights_proj.weight"),
            compressor=_compressor(w, a + "indexer.compressor"),
        )
    attn = AttentionWeights(
        wq_a=w[a + "wq_a.weight"],
        q_norm=plain(w, a + "q_norm.weight"),
        wq_b=w[a + "wq_b.weight"],
        wkv=w[a + "wkv.weight"],
        kv_norm=plain(w, a + "kv_norm.weight"),
        wo_a=plain(w, a + "wo_a.weight"),
        wo_b=w[a + "wo_b.weight"],
        sinks=plain(w, a + "attn_sink"),
        compressor=_compressor(w, a + "compressor") if ratio else None,
        indexer=indexer,
    )
    f = p + "ffn."
    shared = None
    if cfg.n_shared_experts:
        shared = tuple(w[f"{f}shared_experts.{n}.weight"] for n in ("w1", "w2", "w3"))
    ffn = MoEWeights(
        gate=plain(w, f + "gate.weight"),
        bias=plain(w, f + "gate.bias") if f + "gate.bias" in w else None,
        tid2eid=plain(w, f + "gate.tid2eid") if f + "gate.tid2eid" in w else None,
        w1=w[f + "experts.w1"],
        w2=w[f + "experts.w2"],
        w3=w[f + "experts.w3"],
        shared=shared,  # type: ignore[arg-type]
    )

    def hc(kind: str) -> HyperConnection:
        return HyperConnection(*(plain(w, f"{p}hc_{kind}_{part}") for part in ("fn", "base", "scale")))

    return LayerWeights(
        ratio,
        plain(w, p + "attn_norm.weight"),
        plain(w, p + "ffn_norm.weight"),
        hc("attn"),
        hc("ffn"),
        attn,
        ffn,
    )


class DeepseekV4:
    """Holds the weights (as plain tensors) and runs forwards over pools."""

    def __init__(self, cfg: ModelConfig, weights: Weights, rope: RopeTables, ops: Backend) -> None:
        self.cfg, self.rope, self.ops = cfg, rope, ops
        self.embed, self.head, self.norm = (
            plain(weights, "embed.weight"),
            plain(weights, "head.weight"),
            plain(weights, "norm.weight"),
        )
        self.hc_head = HyperConnection(
            plain(weights, "hc_head_fn"), plain(weights, "hc_head_base"), plain(weights, "hc_head_scale")
        )
        self.layers = [_layer(weights, cfg, i) for i in range(cfg.num_layers)]
        self.hc = HcParams(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(
        self, batch: ForwardBatch, pools: KVPools, tables: SlotTables, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits (S, vocab) of the sampled tokens, or (T, vocab) for every token if all_logits."""
        state_pool = {4: "c4_state", self.cfg.hca_ratio: "c128_state"}
        ratios = {r: pools.state_sentinel[state_pool[r]] for r in self.cfg.compress_ratio_set}
        meta = self.ops.prepare(batch, tables, self.rope, self.cfg.sliding_window, ratios)  # all layers
        T, hc = batch.input_ids.shape[0], self.cfg.hc_mult
        ids = batch.input_ids.unsqueeze(1).expand(T, hc).reshape(T * hc)  # each token's id hc times
        h = self.embed.index_select(0, ids).view(T, hc, -1)  # (T, hc, hidden): the streams in one gather
        for i, layer in enumerate(self.layers):
            h = self._layer(h, layer, batch, meta, _layer_cache(pools, i, layer.ratio))
        if not all_logits:
            h = h[batch.sample_index]
        return self.ops.linear(self.ops.hc_head(h, self.hc_head, self.norm, self.hc), self.head)

    def _layer(
        self, h: torch.Tensor, w: LayerWeights, batch: ForwardBatch, meta: StepMeta, cache: AttentionCache
    ) -> torch.Tensor:
        ops = self.ops
        x, post, comb = ops.hc_pre(h, w.hc_attn, w.attn_norm, self.hc)  # x: (T, hidden), normed
        x = attention_forward(x, w.attn, cache, meta, self.cfg, w.ratio, ops)
        h = ops.hc_post(x, h, post, comb)
        x, post, comb = ops.hc_pre(h, w.hc_ffn, w.ffn_norm, self.hc)
        return ops.hc_post(self._moe(x, w.ffn, batch), h, post, comb)

    def _moe(self, x: torch.Tensor, w: MoEWeights, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        softmax = cfg.scoring_func == "softmax"
        weights, ids = self.ops.gating_top_k(
            self.ops.linear(x, w.gate),  # (T, E) logits in x's dtype
            cfg.num_experts_per_tok,
            bias=w.bias,
            input_ids=batch.input_ids if w.tid2eid is not None else None,
            tid2eid=w.tid2eid,
            norm_type=SCORINGS.index(cfg.scoring_func),
            routed_scaling_factor=1.0 if softmax else cfg.routed_scaling_factor,
        )
        if softmax:  # the op never renormalizes softmax weights; DSV4 renormalizes every score function
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        return self.ops.routed_experts(x, weights, ids, w.w1, w.w2, w.w3, cfg.swiglu_limit, w.shared)


def _layer_cache(pools: KVPools, i: int, ratio: int) -> AttentionCache:
    """Layer i's buffers as flat views (one row per slot)."""
    if ratio == 4:
        return AttentionCache(
            flat(pools.swa[i]),
            flat(pools.c4_state[i]),
            flat(pools.c4[i]),
            flat(pools.c4_index_state[i]),
            flat(pools.c4_index[i]),
        )
    if ratio:
        return AttentionCache(flat(pools.swa[i]), flat(pools.c128_state[i]), flat(pools.c128[i]), None, None)
    return AttentionCache(flat(pools.swa[i]), None, None, None, None)
