"""GLM-4.7-Flash (`model_type: glm4_moe_lite`): its config, its weight schema and its math, over one
paged latent pool.

Pre-norm decoder layers: MLA attention (`attention/mla.py`), then a dense SwiGLU MLP (the layers that
`mlp_layer_types` marks "dense", by default the first `first_k_dense_replace`) or a MoE (sigmoid scores
in fp32, the correction bias used for selection only, grouped top-k, renormalized weights times
`routed_scaling_factor`, plus the shared expert). The schema (`glm_tensors`) is the one declaration
of the checkpoint's tensors, in its HF names without the `model.` prefix; the loader, `make-tiny`
and the model read it. The MTP block (`layers.{num_layers}.*`) is not part of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dsv4serve.attention.metadata import ForwardBatch
from dsv4serve.attention.mla import MlaDims, MlaMeta, mla_meta, rope_interleaved, rope_inv_freq
from dsv4serve.config import ConfigError
from dsv4serve.layout import BufferSpec, KVLayout, PoolSpec
from dsv4serve.moe.experts import swiglu
from dsv4serve.quant import Weight, Weights, plain

if TYPE_CHECKING:
    from dsv4serve.backend import Backend
    from dsv4serve.memory.buffers import LayoutBuffers
    from dsv4serve.memory.tables import SlotTables

MODEL_TYPE = "glm4_moe_lite"
Shape = tuple[int, ...]
ATTN_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm keep the RMSNorm default, not rms_norm_eps
EXPERT_PARTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # loaded stacked per layer


@dataclass(frozen=True, slots=True)
class GlmConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    dense_layers: tuple[bool, ...]  # per layer: a dense MLP (else MoE)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    num_nextn_predict_layers: int = 0
    quantization: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    model_type: str = MODEL_TYPE

    @property
    def mla(self) -> MlaDims:
        return MlaDims(
            num_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            norm_eps=ATTN_NORM_EPS,
            softmax_scale=(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5,
        )

    @property
    def kv_layout(self) -> KVLayout:
        """One pool: every raw position keeps its latent row [c | k_pe] in every layer."""
        latent = BufferSpec(
            "latent", self.kv_lora_rank + self.qk_rope_head_dim, tuple(range(self.num_layers))
        )
        return KVLayout((PoolSpec("full", "raw", buffers=(latent,)),))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GlmConfig:
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"model_type: expected {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
        for key, ok in (("rope_scaling", None), ("attention_bias", False)):
            if raw.get(key, ok) not in (ok, {}):
                raise ConfigError(f"{key}: only {ok!r} is supported, got {raw[key]!r}")
        if raw.get("rope_interleave", True) is not True or _float(raw, "partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(
                "rope_interleave / partial_rotary_factor: only interleaved full rope is supported"
            )
        if raw.get("hidden_act", "silu") != "silu" or raw.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError("hidden_act / scoring_func: only silu and sigmoid are supported")
        n = _int(raw, "num_hidden_layers")
        eos = raw.get("eos_token_id", [])
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        if not eos_ids or not all(isinstance(e, int) and e >= 0 for e in eos_ids):
            raise ConfigError(f"eos_token_id: expected an int or a non-empty list of ints, got {eos!r}")
        q_lora = raw.get("q_lora_rank")
        cfg = cls(
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=_int(raw, "hidden_size"),
            num_layers=n,
            num_heads=_int(raw, "num_attention_heads"),
            q_lora_rank=None if q_lora is None else _int(raw, "q_lora_rank"),
            kv_lora_rank=_int(raw, "kv_lora_rank"),
            qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
            v_head_dim=_int(raw, "v_head_dim"),
            intermediate_size=_int(raw, "intermediate_size"),
            moe_intermediate_size=_int(raw, "moe_intermediate_size"),
            n_routed_experts=_int(raw, "n_routed_experts"),
            n_shared_experts=_int(raw, "n_shared_experts", 1),
            num_experts_per_tok=_int(raw, "num_experts_per_tok"),
            dense_layers=_dense_layers(raw, n),
            n_group=_int(raw, "n_group", 1),
            topk_group=_int(raw, "topk_group", 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=_float(raw, "routed_scaling_factor", 1.0),
            rms_norm_eps=_float(raw, "rms_norm_eps", 1e-5),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=_int(raw, "max_position_embeddings"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("torch_dtype", raw.get("dtype", "bfloat16"))),
            num_nextn_predict_layers=_int(raw, "num_nextn_predict_layers", 0),
            quantization=raw.get("quantization_config"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "kv_lora_rank",
            "n_routed_experts",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank: must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
            raise ConfigError(f"qk_rope_head_dim: must be even and positive, got {self.qk_rope_head_dim}")
        e, g = self.n_routed_experts, self.n_group
        if g < 1 or e % g or not 1 <= self.topk_group <= g:
            raise ConfigError(
                f"n_group / topk_group: {g} groups must divide {e} experts, 1 <= topk_group <= n_group"
            )
        if not 1 <= self.num_experts_per_tok <= self.topk_group * e // g:
            raise ConfigError("num_experts_per_tok: must be in [1, topk_group * n_routed_experts / n_group]")
        if g > 1 and e // g < 2:
            raise ConfigError(
                "n_group: each group needs at least 2 experts (groups are scored by their top 2)"
            )
        if not self.norm_topk_prob:
            raise ConfigError("norm_topk_prob: only true is supported")
        if self.quantization is not None:
            raise ConfigError("quantization_config: quantized GLM checkpoints are not supported yet")


def _int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{key}: expected a non-negative int, got {value!r}")
    return value


def _float(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        if params.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope_parameters.rope_type: only 'default' is supported, got {params['rope_type']!r}"
            )
        return _float(params, "rope_theta", _float(raw, "rope_theta", 10000.0))
    return _float(raw, "rope_theta", 10000.0)


def _dense_layers(raw: dict[str, Any], n: int) -> tuple[bool, ...]:
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        k = _int(raw, "first_k_dense_replace", 1)
        return tuple(i < k for i in range(n))
    if not isinstance(kinds, list) or len(kinds) != n or not set(kinds) <= {"dense", "sparse"}:
        raise ConfigError(f"mlp_layer_types: expected {n} entries of 'dense' / 'sparse', got {kinds!r}")
    return tuple(k == "dense" for k in kinds)


# ---------------------------------------------------------------------------------------- schema


def glm_tensors(cfg: GlmConfig) -> dict[str, Shape]:
    """Every tensor of a checkpoint (MTP block excluded), by name without `model.`, as on disk."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Shape] = {"embed_tokens.weight": (v, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        out |= _attention_tensors(cfg, p + "self_attn.")
        out |= _mlp_tensors(cfg, p + "mlp.", cfg.dense_layers[i])
    return out


def _attention_tensors(cfg: GlmConfig, a: str) -> dict[str, Shape]:
    h, heads, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    out: dict[str, Shape] = {}
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = (heads * qk, h)
    else:
        out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
        out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (heads * qk, cfg.q_lora_rank)
    return out | {
        a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (h, heads * cfg.v_head_dim),
    }


def _mlp_tensors(cfg: GlmConfig, m: str, dense: bool) -> dict[str, Shape]:
    h = cfg.hidden_size
    if dense:
        return _swiglu(m, cfg.intermediate_size, h)
    out: dict[str, Shape] = {m + "gate.weight": (cfg.n_routed_experts, h)}
    out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
    for e in range(cfg.n_routed_experts):
        out |= _swiglu(f"{m}experts.{e}.", cfg.moe_intermediate_size, h)
    if cfg.n_shared_experts:
        out |= _swiglu(m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts, h)
    return out


def _swiglu(p: str, inner: int, h: int) -> dict[str, Shape]:
    return {
        p + "gate_proj.weight": (inner, h),
        p + "up_proj.weight": (inner, h),
        p + "down_proj.weight": (h, inner),
    }


def fp32_tensor(name: str) -> bool:
    """Kept in fp32 whatever the engine dtype (as in the official checkpoint and transformers)."""
    return name.endswith(("e_score_correction_bias", "mlp.gate.weight"))


def is_mtp_tensor(name: str, cfg: GlmConfig) -> bool:
    """The MTP block's tensors (`layers.{num_layers + j}.*`), which the engine skips for now."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= cfg.num_layers


# ---------------------------------------------------------------------------------------- math


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
        experts = (w[m + "experts.w1"], w[m + "experts.w2"], w[m + "experts.w3"])
        shared = _swiglu_weights(w, m + "shared_experts.") if cfg.n_shared_experts else None
        mlp = MlpWeights(
            None, plain(w, m + "gate.weight"), plain(w, m + "gate.e_score_correction_bias"), experts, shared
        )
    p = f"layers.{i}."
    return GlmLayer(
        plain(w, p + "input_layernorm.weight"), plain(w, p + "post_attention_layernorm.weight"), attn, mlp
    )


def _swiglu_weights(w: Weights, p: str) -> tuple[Weight, Weight, Weight]:
    return w[p + "gate_proj.weight"], w[p + "down_proj.weight"], w[p + "up_proj.weight"]


class Glm4MoeLite:
    """Holds the weights (loaded names: experts stacked) and runs forwards over the latent pool."""

    def __init__(self, cfg: GlmConfig, weights: Weights, ops: Backend) -> None:
        self.cfg, self.ops, self.dims = cfg, ops, cfg.mla
        self.embed, self.norm = plain(weights, "embed_tokens.weight"), plain(weights, "norm.weight")
        self.head = self.embed if cfg.tie_word_embeddings else plain(weights, "lm_head.weight")
        self.layers = [_layer(weights, cfg, i) for i in range(cfg.num_layers)]
        self.inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, self.embed.device)

    def forward(
        self, batch: ForwardBatch, pools: LayoutBuffers, tables: SlotTables, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits (S, vocab) of the sampled tokens, or (T, vocab) for every token if all_logits."""
        meta = mla_meta(batch, tables.full, self.inv_freq)  # all layers
        x = self.embed[batch.input_ids]  # (T, hidden)
        caches = pools.flat("latent")
        eps = self.cfg.rms_norm_eps
        for i, layer in enumerate(self.layers):
            x = x + self._attention(self.ops.rms_norm(x, layer.in_norm, eps), layer.attn, caches[i], meta)
            x = x + self._mlp(self.ops.rms_norm(x, layer.post_norm, eps), layer.mlp)
        if not all_logits:
            x = x[batch.sample_index]
        return self.ops.linear(self.ops.rms_norm(x, self.norm, eps), self.head)

    def _attention(self, x: torch.Tensor, w: AttnWeights, cache: torch.Tensor, meta: MlaMeta) -> torch.Tensor:
        ops, d = self.ops, self.dims
        lat = ops.qkv_split_norm(
            ops.linear(x, w.qkv_a), w.q_norm, w.kv_norm, d.q_lora_rank, d.kv_lora_rank, d.norm_eps
        )
        q = ops.linear(lat.q if lat.q is not None else x, w.q_b)
        q = q.view(x.shape[0], d.num_heads, d.qk_nope_head_dim + d.qk_rope_head_dim)  # (T, H, nope + rope)
        q_nope, q_pe = (
            q[..., : d.qk_nope_head_dim],
            rope_interleaved(q[..., d.qk_nope_head_dim :], meta.cos, meta.sin),
        )
        k_pe = rope_interleaved(lat.k_pe, meta.cos, meta.sin)  # (T, rope)
        ops.mla_store(cache, meta, lat.kv, k_pe)
        out = ops.mla_attention(q_nope, q_pe, cache, w.kv_b, meta, d)  # (T, H, v)
        return ops.linear(out.reshape(x.shape[0], -1), w.o)

    def _mlp(self, x: torch.Tensor, w: MlpWeights) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        if w.gate_up_down is not None:
            return swiglu(x, *w.gate_up_down, limit=math.inf, matmul=ops.linear)
        assert w.router is not None and w.experts is not None
        weights, ids = ops.gating_top_k(
            torch.nn.functional.linear(x.float(), w.router.float()),  # (T, E) fp32 logits
            cfg.num_experts_per_tok,
            bias=w.bias,
            k_group=cfg.topk_group,
            group_count=cfg.n_group,
            group_select_mode=1,
            norm_type=1,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        return ops.routed_experts(x, weights.to(x.dtype), ids, *w.experts, math.inf, w.shared)
