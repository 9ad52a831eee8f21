"""GLM-4.7-Flash: math only. Pre-norm decoder layers over one paged latent pool.

Each layer: MLA attention (`attention/mla.py`), then a dense SwiGLU MLP or a MoE (sigmoid scores in fp32,
the correction bias used for selection only, grouped top-k, renormalized weights times
`routed_scaling_factor`, plus the shared expert). The model is built over its weights and the KV cache
(the `latent` buffer and the `full` table, the names its layout declares: config.py's `kv_layout`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.mla import MlaDims, MlaMeta, rope_inv_freq
from dsv4serve.layers.linear import Weight, Weights, plain
from dsv4serve.models.glm4_moe_lite.config import GlmConfig
from dsv4serve.moe.experts import swiglu

if TYPE_CHECKING:
    from dsv4serve.models.spec import ModelContext

ATTN_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm keep the RMSNorm default, not rms_norm_eps


def mla_dims(cfg: GlmConfig) -> MlaDims:
    return MlaDims(
        num_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        norm_eps=ATTN_NORM_EPS,
        softmax_scale=(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5,
    )


@dataclass(frozen=True)
class AttnWeights:
    qkv_a: Weight  # q_a_proj | kv_a_proj_with_mqa rows (or kv_a_proj_with_mqa alone)
    q_norm: torch.Tensor | None
    q_b: Weight  # q_b_proj, or q_proj (applied to the hidden state) when q_lora_rank is None
    kv_norm: torch.Tensor
    kv_b: torch.Tensor  # (H * (nope + v), L), read by both attention forms
    o: Weight


@dataclass(frozen=True)
class MlpWeights:
    gate_up_down: tuple[Weight, Weight, Weight] | None  # dense layers: w1, w2, w3
    router: torch.Tensor | None  # (E, hidden) fp32
    bias: torch.Tensor | None  # (E,) fp32, selection only
    experts: tuple[Weight, Weight, Weight] | None  # stacked w1 (E, I, H), w2 (E, H, I), w3
    shared: tuple[Weight, Weight, Weight] | None


@dataclass(frozen=True)
class GlmLayer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttnWeights
    mlp: MlpWeights


def _layer(w: Weights, cfg: GlmConfig, i: int) -> GlmLayer:
    """Layer i's weights, as loaded: a rank's share under tensor parallelism (schema.py's splits)."""
    a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
    kv_a = plain(w, a + "kv_a_proj_with_mqa.weight")
    if cfg.q_lora_rank is None:
        qkv_a, q_norm, q_b = kv_a, None, w[a + "q_proj.weight"]
    else:
        qkv_a = torch.cat([plain(w, a + "q_a_proj.weight"), kv_a])
        q_norm, q_b = plain(w, a + "q_a_layernorm.weight"), w[a + "q_b_proj.weight"]
    attn = AttnWeights(
        qkv_a,
        q_norm,
        q_b,
        plain(w, a + "kv_a_layernorm.weight"),
        plain(w, a + "kv_b_proj.weight"),
        w[a + "o_proj.weight"],
    )
    if cfg.dense_layers[i]:
        mlp = MlpWeights(_swiglu_weights(w, m), None, None, None, None)
    else:
        w1, w2, w3 = (w[m + f"experts.{n}"] for n in ("w1", "w2", "w3"))
        shared = _swiglu_weights(w, m + "shared_experts.") if cfg.n_shared_experts else None
        router = plain(w, m + "gate.weight").float()  # fp32 once, not per step
        bias = plain(w, m + "gate.e_score_correction_bias")
        mlp = MlpWeights(None, router, bias, (w1, w2, w3), shared)
    p = f"layers.{i}."
    return GlmLayer(
        plain(w, p + "input_layernorm.weight"), plain(w, p + "post_attention_layernorm.weight"), attn, mlp
    )


def _swiglu_weights(w: Weights, p: str) -> tuple[Weight, Weight, Weight]:
    return w[p + "gate_proj.weight"], w[p + "down_proj.weight"], w[p + "up_proj.weight"]


class Glm4MoeLite:
    """Holds the weights (loaded names: experts stacked) and runs forwards over the latent pool."""

    def __init__(self, cfg: GlmConfig, weights: Weights, ctx: ModelContext) -> None:
        self.cfg, self.ops, self.shard = cfg, ctx.ops, ctx.shard
        heads = ctx.shard.count(cfg.num_heads, "num_attention_heads")
        self.dims = dataclasses.replace(mla_dims(cfg), num_heads=heads)  # this rank's heads
        self.embed, self.norm = plain(weights, "embed_tokens.weight"), plain(weights, "norm.weight")
        self.head = self.embed if cfg.tie_word_embeddings else plain(weights, "lm_head.weight")
        self.layers = [_layer(weights, cfg, i) for i in range(cfg.num_layers)]
        self.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, self.embed.device)
        self.table = ctx.tables.table("full")  # raw position -> latent slot
        latent = ctx.cache.flat("latent")
        self.caches = [latent[i] for i in range(cfg.num_layers)]  # each layer's (slots, L + rope) rows

    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits (S, vocab) of the sampled tokens, or (T, vocab) for every token if all_logits."""
        meta = self.ops.mla.prepare(batch, self.table, self.inv_freq)  # all layers
        x = self.embed[batch.input_ids]  # (T, hidden): the residual stream
        ops, eps = self.ops, self.cfg.rms_norm_eps
        h = ops.rms_norm(x, self.layers[0].in_norm, eps)  # (num_layers > 0: the config's check)
        # each block's output joins the stream in the op that norms the stream for the next block
        after = [layer.in_norm for layer in self.layers[1:]] + [self.norm]
        for layer, cache, norm in zip(self.layers, self.caches, after, strict=True):
            x, h = ops.add_rms_norm(x, self._attention(h, layer.attn, cache, meta), layer.post_norm, eps)
            x, h = ops.add_rms_norm(x, self._mlp(h, layer.mlp, batch.cores_tokens), norm, eps)
        return ops.linear(h if all_logits else h[batch.sample_index], self.head)

    def _attention(self, x: torch.Tensor, w: AttnWeights, cache: torch.Tensor, meta: MlaMeta) -> torch.Tensor:
        ops, d = self.ops, self.dims
        lat = ops.mla.qkv_split_norm(
            ops.linear(x, w.qkv_a), w.q_norm, w.kv_norm, d.q_lora_rank, d.kv_lora_rank, d.norm_eps
        )
        q = ops.linear(lat.q if lat.q is not None else x, w.q_b)
        q = q.view(x.shape[0], d.num_heads, d.qk_nope_head_dim + d.qk_rope_head_dim)  # (T, H, nope + rope)
        ops.mla.rope_store(q[..., d.qk_nope_head_dim :], lat, cache, meta)  # q's rope part; [c | k_pe] stored
        out = ops.mla.attention(q, cache, w.kv_b, meta, d)  # (T, H, v): this rank's heads
        return self.shard.reduce(ops.linear(out.reshape(x.shape[0], -1), w.o))

    def _mlp(self, x: torch.Tensor, w: MlpWeights, cores_tokens: tuple[int, ...]) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        if w.gate_up_down is not None:
            return self.shard.reduce(swiglu(x, *w.gate_up_down, limit=math.inf, matmul=ops.linear))
        assert w.router is not None and w.experts is not None
        sh, router, routed_w = self.shard, w.router, w.experts

        def route(xs: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            return ops.gating_top_k(
                torch.nn.functional.linear(xs.float(), router),  # (N, E) fp32 logits (the router in fp32)
                cfg.num_experts_per_tok,
                bias=w.bias,
                k_group=cfg.topk_group,
                group_count=cfg.n_group,
                group_select_mode=1,
                norm_type=1,
                routed_scaling_factor=cfg.routed_scaling_factor,
            )

        def experts(xs: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return ops.routed_experts(xs, weights.to(xs.dtype), ids, *routed_w, math.inf)

        if sh.exchange is None:  # the expert group is the tensor-parallel group
            weights, ids = sh.local_routes(*route(x, None), cfg.n_routed_experts)
            return sh.reduce(ops.routed_experts(x, weights.to(x.dtype), ids, *w.experts, math.inf, w.shared))
        out = sh.exchange.moe(x, None, cores_tokens, route, experts, cfg.n_routed_experts)
        if w.shared is None:
            return out
        return out + sh.reduce(swiglu(x, *w.shared, limit=math.inf, matmul=ops.linear))
