"""DeepSeek-V4: math only. mHC residual streams, DSV4 attention over pools, hash / top-k MoE.

The model is built over its weights and the KV cache (buffers and slot tables, resolved once here by
the names its layout declares: config.py's `kv_layout`), takes a flat batch of tokens from many
requests (`ForwardBatch`) and returns logits. No device strings, scheduling or logging here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4serve.attention.compressor import CompressorWeights
from dsv4serve.attention.int8_index import Int8Rows
from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.rope import RopeTables
from dsv4serve.attention.step import StepMeta, StepTables
from dsv4serve.layers.formats import FP8_BLOCK
from dsv4serve.layers.linear import Fp8BlockWeight, Weight, Weights, plain
from dsv4serve.layers.mhc import HcParams, HyperConnection
from dsv4serve.models.deepseek_v4.attention import (
    AttentionCache,
    AttentionWeights,
    IndexerWeights,
    attention_forward,
)
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.moe.experts import swiglu
from dsv4serve.moe.routing import SCORINGS

if TYPE_CHECKING:
    from dsv4serve.models.spec import ModelContext


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


def fp8_rows_or_plain(w: Weights, name: str, rows: int) -> Weight:
    """A grouped projection kept FP8 where each group's `rows` are whole 128-row blocks (its groups
    then run as linears of their own), else its float tensor (decoded here, in the embedding's dtype)."""
    value = w[name]
    if isinstance(value, Fp8BlockWeight) and rows % FP8_BLOCK[0]:
        return value.dequantized(plain(w, "embed.weight").dtype)
    assert isinstance(value, torch.Tensor | Fp8BlockWeight), f"{name}: float or FP8 blocks"
    return value


def _layer(w: Weights, cfg: DeepseekV4Config, i: int) -> LayerWeights:
    """Layer i's weights, as loaded: a rank's share under tensor parallelism (schema.py's splits)."""
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
        wo_a=fp8_rows_or_plain(w, a + "wo_a.weight", cfg.o_lora_rank),
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
    """Holds the weights (as plain tensors) and the cache's handles; runs forwards over the pools."""

    def __init__(self, cfg: DeepseekV4Config, weights: Weights, rope: RopeTables, ctx: ModelContext) -> None:
        self.cfg, self.rope, self.ops, self.shard = cfg, rope, ctx.ops, ctx.shard
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
        self.tables, self.caches = _cache_handles(cfg, ctx)

    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits (S, vocab) of the sampled tokens, or (T, vocab) for every token if all_logits."""
        ops = self.ops
        meta = ops.dsv4.prepare(batch, self.tables, self.rope, self.cfg.sliding_window)  # all layers
        T, hc = batch.input_ids.shape[0], self.cfg.hc_mult
        ids = batch.input_ids.unsqueeze(1).expand(T, hc).reshape(T * hc)  # each token's id hc times
        h = self.embed.index_select(0, ids).view(T, hc, -1)  # (T, hc, hidden): the streams in one gather
        for layer, cache in zip(self.layers, self.caches, strict=True):
            h = self._layer(h, layer, batch, meta, cache)
        if not all_logits:
            h = h[batch.sample_index]
        return ops.linear(ops.dsv4.hc_head(h, self.hc_head, self.norm, self.hc), self.head)

    def _layer(
        self, h: torch.Tensor, w: LayerWeights, batch: ForwardBatch, meta: StepMeta, cache: AttentionCache
    ) -> torch.Tensor:
        dsv4 = self.ops.dsv4
        x, post, comb = dsv4.hc_pre(h, w.hc_attn, w.attn_norm, self.hc)  # x: (T, hidden), normed
        x = self.shard.reduce(attention_forward(x, w.attn, cache, meta, self.cfg, w.ratio, self.ops))
        h = dsv4.hc_post(x, h, post, comb)
        x, post, comb = dsv4.hc_pre(h, w.hc_ffn, w.ffn_norm, self.hc)
        return dsv4.hc_post(self._moe(x, w.ffn, batch), h, post, comb)

    def _moe(self, x: torch.Tensor, w: MoEWeights, batch: ForwardBatch) -> torch.Tensor:
        cfg, sh = self.cfg, self.shard
        softmax = cfg.scoring_func == "softmax"

        def route(xs: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            weights, ids = self.ops.gating_top_k(
                self.ops.linear(xs, w.gate),  # (N, E) logits in x's dtype
                cfg.num_experts_per_tok,
                bias=w.bias,
                input_ids=input_ids if w.tid2eid is not None else None,
                tid2eid=w.tid2eid,
                norm_type=SCORINGS.index(cfg.scoring_func),
                routed_scaling_factor=1.0 if softmax else cfg.routed_scaling_factor,
            )
            if softmax:  # the op never renormalizes softmax weights; DSV4 renormalizes every score function
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
            return weights, ids

        def experts(xs: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return self.ops.routed_experts(xs, weights, ids, w.w1, w.w2, w.w3, cfg.swiglu_limit)

        if sh.exchange is None:  # the expert group is the tensor-parallel group
            weights, ids = sh.local_routes(*route(x, batch.input_ids), cfg.n_routed_experts)
            routed = self.ops.routed_experts(x, weights, ids, w.w1, w.w2, w.w3, cfg.swiglu_limit, w.shared)
            return sh.reduce(routed)
        out = sh.exchange.moe(x, batch.input_ids, batch.cores_tokens, route, experts, cfg.n_routed_experts)
        if w.shared is None:
            return out
        return out + sh.reduce(swiglu(x, *w.shared, limit=cfg.swiglu_limit, matmul=self.ops.linear))


# The layout's pools and buffers (config.py's `kv_layout`) by the role the attention gives them.
HCA = "c128"  # the heavily compressed pool's name, whatever its ratio


def _cache_handles(cfg: DeepseekV4Config, ctx: ModelContext) -> tuple[StepTables, list[AttentionCache]]:
    """The step's slot tables and each layer's buffers (flat views, one row per slot)."""
    tables, cache = ctx.tables, ctx.cache
    pools = {r: ("c4" if r == 4 else HCA) for r in cfg.compress_ratio_set}
    step_tables = StepTables(
        window=tables.table("swa"),
        entries={r: tables.table(pool) for r, pool in pools.items()},
        states={r: tables.table(f"{pool}_state") for r, pool in pools.items()},
        state_sentinels={r: cache.state_sentinel[f"{pool}_state"] for r, pool in pools.items()},
        page_size=ctx.engine.page_size,
    )
    flat = {name: cache.flat(name) for name in cache.buffers}

    def layer(i: int, ratio: int) -> AttentionCache:
        window = flat["swa"][i]
        if ratio == 4:
            keys = flat["c4_index"][i]
            index_keys = keys if "c4_index_scale" not in flat else Int8Rows(keys, flat["c4_index_scale"][i])
            state, entries = flat["c4_state"][i], flat["c4"][i]
            return AttentionCache(window, state, entries, flat["c4_index_state"][i], index_keys)
        if ratio:
            return AttentionCache(window, flat[f"{HCA}_state"][i], flat[HCA][i], None, None)
        return AttentionCache(window, None, None, None, None)

    return step_tables, [layer(i, r) for i, r in enumerate(cfg.compress_ratios)]
