"""GLM-4.7-Flash's config (`model_type: glm4_moe_lite`): `config.json` in plain numbers, and its KV layout.

DeepSeek-V3-style MLA attention (one paged pool of latent rows) with a sigmoid grouped top-k MoE; the
layers that `mlp_layer_types` marks "dense" (by default the first `first_k_dense_replace`) have a dense
SwiGLU MLP instead. A value out of range raises `ConfigError` naming its key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dsv4serve.config import ConfigError
from dsv4serve.memory.layout import BufferSpec, KVLayout, PoolSpec

MODEL_TYPE = "glm4_moe_lite"


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
