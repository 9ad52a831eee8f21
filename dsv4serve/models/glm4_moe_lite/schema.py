"""GLM-4.7-Flash's checkpoint tensors, declared once: names, shapes and storage.

Names are the HF ones without the `model.` prefix (`embed_tokens.weight`, `layers.L.self_attn.q_a_proj.
weight`, ...), routed experts one by one as on disk (`layers.L.mlp.experts.E.gate_proj.weight`); the
loader stacks them per layer into `layers.L.mlp.experts.{w1,w2,w3}`. Everything is bf16 except the
router and its correction bias, kept in fp32 (as in the official checkpoint and transformers). The MTP
block (`layers.{num_layers}.*`) is not part of it: the loader skips it.
"""

from __future__ import annotations

from dsv4serve.models.glm4_moe_lite.config import GlmConfig
from dsv4serve.models.spec import Schema, Split, TensorSpec


def tensors(cfg: GlmConfig) -> Schema:
    """Every tensor of a checkpoint (MTP block excluded)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: Schema = {
        "embed_tokens.weight": TensorSpec((v, h), group="embed_head"),
        "norm.weight": TensorSpec((h,), group="norms"),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((v, h), linear=True, group="embed_head")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": TensorSpec((h,), group="norms"),
            p + "post_attention_layernorm.weight": TensorSpec((h,), group="norms"),
        }
        out |= _attention(cfg, p + "self_attn.")
        out |= _mlp(cfg, p + "mlp.", cfg.dense_layers[i])
    return out


def _linear(shape: tuple[int, int], group: str, split: Split | None = None, unit: int = 1) -> TensorSpec:
    return TensorSpec(shape, linear=True, group=group, split=split, split_unit=unit)


def _attention(cfg: GlmConfig, a: str) -> Schema:
    """Tensor parallelism splits the heads (q and kv_b rows, o columns); the latent is whole."""
    h, heads, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    nope_v, v = cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    out: Schema = {}
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = _linear((heads * qk, h), "attention", "rows", qk)
    else:
        out[a + "q_a_proj.weight"] = _linear((cfg.q_lora_rank, h), "attention")
        out[a + "q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), group="norms")
        out[a + "q_b_proj.weight"] = _linear((heads * qk, cfg.q_lora_rank), "attention", "rows", qk)
    return out | {
        a + "kv_a_proj_with_mqa.weight": _linear((cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), "attention"),
        a + "kv_a_layernorm.weight": TensorSpec((cfg.kv_lora_rank,), group="norms"),
        a + "kv_b_proj.weight": _linear((heads * nope_v, cfg.kv_lora_rank), "attention", "rows", nope_v),
        a + "o_proj.weight": _linear((h, heads * v), "attention", "cols", v),
    }


def _mlp(cfg: GlmConfig, m: str, dense: bool) -> Schema:
    h, e = cfg.hidden_size, cfg.n_routed_experts
    if dense:
        return _swiglu(m, cfg.intermediate_size, h, "mlp")
    out: Schema = {
        m + "gate.weight": TensorSpec((e, h), "fp32", fp32=True, group="router"),
        m + "gate.e_score_correction_bias": TensorSpec((e,), "fp32", fp32=True, group="router"),
    }
    for i in range(e):
        out |= _swiglu(f"{m}experts.{i}.", cfg.moe_intermediate_size, h, "routed_experts")
    if cfg.n_shared_experts:
        inner = cfg.moe_intermediate_size * cfg.n_shared_experts
        out |= _swiglu(m + "shared_experts.", inner, h, "shared_experts")
    return out


def _swiglu(p: str, inner: int, h: int, group: str) -> Schema:
    """Tensor parallelism splits the intermediate: gate / up rows, down columns."""
    return {
        p + "gate_proj.weight": _linear((inner, h), group, "rows"),
        p + "up_proj.weight": _linear((inner, h), group, "rows"),
        p + "down_proj.weight": _linear((h, inner), group, "cols"),
    }


def is_mtp_tensor(name: str, cfg: GlmConfig) -> bool:
    """The MTP block's tensors (`layers.{num_layers + j}.*`), which the engine skips for now."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= cfg.num_layers
