"""DeepSeek-V4: math only. mHC residual streams, DSV4 attention over pools, hash / top-k MoE.

The model takes a flat batch of tokens from many requests (`ForwardBatch`), the device pools and
the slot tables, and returns logits. No device strings, scheduling or logging here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.core import rms_norm
from dsv4serve.attention.dsv4 import AttentionCache, AttentionWeights, IndexerWeights, attention_forward
from dsv4serve.attention.geometry import StepGeometry, step_geometry
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.config import ModelConfig
from dsv4serve.memory.pools import flat
from dsv4serve.moe.experts import swiglu
from dsv4serve.moe.routing import route
from dsv4serve.quant import Weight

if TYPE_CHECKING:
    from dsv4serve.backend import Backend
    from dsv4serve.memory.pools import KVPools
    from dsv4serve.memory.tables import SlotTables

Weights = dict[str, Weight]


@dataclass(frozen=True)
class HyperConnection:
    fn: torch.Tensor  # ((2+hc)*hc, hc*hidden) fp32
    base: torch.Tensor  # ((2+hc)*hc,) fp32
    scale: torch.Tensor  # (3,) fp32


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


def _t(w: Weights, name: str) -> torch.Tensor:
    """A tensor that is never quantized (norms, mHC, sinks, compressor, router, embeddings, head)."""
    value = w[name]
    assert isinstance(value, torch.Tensor), f"{name} must stay a plain tensor"
    return value


def _compressor(w: Weights, prefix: str) -> CompressorWeights:
    return CompressorWeights(
        wkv=_t(w, f"{prefix}.wkv.weight"),
        wgate=_t(w, f"{prefix}.wgate.weight"),
        ape=_t(w, f"{prefix}.ape"),
        norm=_t(w, f"{prefix}.norm.weight"),
    )


def _layer(w: Weights, cfg: ModelConfig, i: int) -> LayerWeights:
    p, ratio = f"layers.{i}.", cfg.compress_ratios[i]
    a = p + "attn."
    indexer = None
    if ratio == 4:
        indexer = IndexerWeights(
            wq_b=w[a + "indexer.wq_b.weight"],
            weights_proj=_t(w, a + "indexer.weights_proj.weight"),
            compressor=_compressor(w, a + "indexer.compressor"),
        )
    attn = AttentionWeights(
        wq_a=w[a + "wq_a.weight"],
        q_norm=_t(w, a + "q_norm.weight"),
        wq_b=w[a + "wq_b.weight"],
        wkv=w[a + "wkv.weight"],
        kv_norm=_t(w, a + "kv_norm.weight"),
        wo_a=_t(w, a + "wo_a.weight"),
        wo_b=w[a + "wo_b.weight"],
        sinks=_t(w, a + "attn_sink"),
        compressor=_compressor(w, a + "compressor") if ratio else None,
        indexer=indexer,
    )
    f = p + "ffn."
    shared = None
    if cfg.n_shared_experts:
        shared = tuple(w[f"{f}shared_experts.{n}.weight"] for n in ("w1", "w2", "w3"))
    ffn = MoEWeights(
        gate=_t(w, f + "gate.weight"),
        bias=_t(w, f + "gate.bias") if f + "gate.bias" in w else None,
        tid2eid=_t(w, f + "gate.tid2eid") if f + "gate.tid2eid" in w else None,
        w1=w[f + "experts.w1"],
        w2=w[f + "experts.w2"],
        w3=w[f + "experts.w3"],
        shared=shared,  # type: ignore[arg-type]
    )

    def hc(kind: str) -> HyperConnection:
        return HyperConnection(*(_t(w, f"{p}hc_{kind}_{part}") for part in ("fn", "base", "scale")))

    return LayerWeights(
        ratio, _t(w, p + "attn_norm.weight"), _t(w, p + "ffn_norm.weight"), hc("attn"), hc("ffn"), attn, ffn
    )


def hc_pre(h: torch.Tensor, hc: HyperConnection, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """mHC weights from the streams h (T, hc, hidden).

    Returns post (T, hc), comb (T, hc, hc) and the collapsed block input (T, hidden).

    comb is made doubly stochastic by Sinkhorn iterations; everything in fp32.
    """
    n, eps = cfg.hc_mult, cfg.hc_eps
    flat = h.flatten(1).float()  # (T, hc*hidden)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    mixes = F.linear(flat, hc.fn.float())  # (T, (2+hc)*hc)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * hc.scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * hc.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * hc.scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
    return post, comb, collapsed


def hc_post(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a block output back into the streams and mix in the residual: post*out + comb^T h."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), h
    )


class DeepseekV4:
    """Holds the weights (as plain tensors) and runs forwards over pools."""

    def __init__(self, cfg: ModelConfig, weights: Weights, rope: RopeTables, ops: Backend) -> None:
        self.cfg, self.rope, self.ops = cfg, rope, ops
        self.embed, self.head, self.norm = (
            _t(weights, "embed.weight"),
            _t(weights, "head.weight"),
            _t(weights, "norm.weight"),
        )
        self.hc_head = HyperConnection(
            _t(weights, "hc_head_fn"), _t(weights, "hc_head_base"), _t(weights, "hc_head_scale")
        )
        self.layers = [_layer(weights, cfg, i) for i in range(cfg.num_layers)]

    def forward(
        self, batch: ForwardBatch, pools: KVPools, tables: SlotTables, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits (S, vocab) of the sampled tokens, or (T, vocab) for every token if all_logits."""
        sentinels = {
            4: pools.state_sentinel["c4_state"],
            self.cfg.hca_ratio: pools.state_sentinel["c128_state"],
        }
        ratios = {r: sentinels[r] for r in self.cfg.compress_ratio_set}
        geo = step_geometry(batch, tables, self.rope, self.cfg.sliding_window, ratios)  # shared by all layers
        x = self.embed[batch.input_ids]  # (T, hidden)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # (T, hc, hidden)
        for i, layer in enumerate(self.layers):
            h = self._layer(h, layer, batch, geo, _layer_cache(pools, i, layer.ratio))
        if not all_logits:
            h = h[batch.sample_index]
        return F.linear(rms_norm(self._collapse(h), self.norm, self.cfg.rms_norm_eps), self.head)

    def _layer(
        self, h: torch.Tensor, w: LayerWeights, batch: ForwardBatch, geo: StepGeometry, cache: AttentionCache
    ) -> torch.Tensor:
        cfg = self.cfg
        post, comb, x = hc_pre(h, w.hc_attn, cfg)
        x = attention_forward(
            rms_norm(x, w.attn_norm, cfg.rms_norm_eps),
            w.attn,
            cache,
            geo,
            cfg,
            w.ratio,
            self.ops,
        )
        h = hc_post(h, x, post, comb)
        post, comb, x = hc_pre(h, w.hc_ffn, cfg)
        return hc_post(h, self._moe(rms_norm(x, w.ffn_norm, cfg.rms_norm_eps), w.ffn, batch), post, comb)

    def _moe(self, x: torch.Tensor, w: MoEWeights, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        weights, ids = route(
            x,
            w.gate,
            top_k=cfg.num_experts_per_tok,
            scoring=cfg.scoring_func,
            scaling=cfg.routed_scaling_factor,
            bias=w.bias,
            tid2eid=w.tid2eid,
            input_ids=batch.input_ids,
        )
        out = self.ops.routed_experts(x, weights, ids, w.w1, w.w2, w.w3, cfg.swiglu_limit)
        if w.shared is not None:
            out = out + swiglu(x, *w.shared, limit=cfg.swiglu_limit, matmul=self.ops.linear)
        return out

    def _collapse(self, h: torch.Tensor) -> torch.Tensor:
        """hc_head: collapse the streams (T, hc, hidden) -> (T, hidden) before the final norm."""
        flat = h.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        mixes = F.linear(flat, self.hc_head.fn.float())  # (T, hc)
        pre = torch.sigmoid(mixes * self.hc_head.scale.float() + self.hc_head.base.float()) + self.cfg.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


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
