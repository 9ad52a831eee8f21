"""A random tiny DeepSeek-V4 checkpoint in the official layout, for tests and demos.

`make_tiny` writes `config.json` (official keys, plus the transformers keys `layer_types` /
`compress_rates` so that `transformers` accepts a heavily-compressed ratio other than 128),
`generation_config.json`, the real DeepSeek tokenizer files, and seeded random weights under their
official names in `model.safetensors` (or `shards` files with `model.safetensors.index.json`).
With `quant="w8a8"` it writes an Ascend msModelSlim W8A8_DYNAMIC checkpoint of the same weights instead:
`quant_model_description.json` plus `quant_model_weights.safetensors` (or shards with
`quant_model_weights.safetensors.index.json`), the int8 projections being `quantize_int8` of the
float ones (symmetric: zero offsets).
Scales are chosen so that activations stay O(1) through the layers and every parameter matters
(non-zero sinks, ape, mHC base, gate bias; random distinct hash-routing experts).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dsv4serve.layers.linear import quantize_int8
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.schema import MSMODELSLIM_FLOAT, tensors
from dsv4serve.models.formats import QUANT_FLOAT, QUANT_W8A8_DYNAMIC, WEIGHT_OFFSET, WEIGHT_SCALE
from dsv4serve.models.spec import Schema
from dsv4serve.models.tiny import DTYPES, copy_tokenizer, write_json, write_safetensors

QUANTS = ("w8a8",)


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The tiny model's `config.json` as a dict; `overrides` replace official keys.

    `compress_ratios` may be given with one entry per layer (a trailing 0 for the MTP layer is
    appended); `layer_types` and `compress_rates` are always derived from it.
    """
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 16,
        "num_hash_layers": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 2.0,  # official 10.0; 2.0 makes the clamp bite on O(1) activations
        "index_n_heads": 16,  # enough heads that indexer scores never tie at 0 (top-k would be ambiguous)
        "index_head_dim": 32,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    cfg.update(overrides)
    n = cfg["num_hidden_layers"]
    ratios = list(cfg.get("compress_ratios") or ([0] + [4, 16] * n)[:n])
    if len(ratios) == n:
        ratios += [0] * max(1, cfg["num_nextn_predict_layers"])  # official lists carry the MTP layers too
    cfg["compress_ratios"] = ratios
    cfg["layer_types"], cfg["compress_rates"] = _transformers_layer_types(ratios[:n])
    return cfg


def _transformers_layer_types(ratios: list[int]) -> tuple[list[str], dict[str, int]]:
    hca = {r for r in ratios if r not in (0, 4)}
    if len(hca) > 1:
        raise ValueError(
            f"compress_ratios: at most one heavily-compressed ratio besides 4, got {sorted(hca)}"
        )
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": min(hca, default=128)}
    to_type = {0: "sliding_attention", **{ratio: kind for kind, ratio in rates.items()}}
    return [to_type[r] for r in ratios], rates


def make_tiny(
    out_dir: Path | str,
    seed: int = 0,
    *,
    shards: int = 1,
    dtype: str = "float32",
    quant: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random tiny checkpoint to `out_dir` (created if needed) and return its path.

    `dtype` is the on-disk dtype of the bulk weights (mHC, sinks, ape, gate bias stay fp32 and
    tid2eid int64, as in the official checkpoints); `quant="w8a8"` writes the same weights as an
    msModelSlim W8A8_DYNAMIC checkpoint; `overrides` are `config.json` keys.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(DTYPES)}")
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"quant: {quant!r} is not None or one of {QUANTS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**{"torch_dtype": dtype, **overrides})
    model = DeepseekV4Config.from_dict(cfg)
    schema = tensors(model)
    weights = random_weights(model, schema, seed, DTYPES[dtype])
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", _generation_config(model))
    if quant is None:
        write_safetensors(weights, out, shards)
    else:
        quantized, description = w8a8_checkpoint(weights, schema)
        write_json(out / "quant_model_description.json", description)
        write_safetensors(quantized, out, shards, stem="quant_model_weights")
    copy_tokenizer(out)
    return out


def w8a8_checkpoint(
    weights: dict[str, torch.Tensor], schema: Schema
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """msModelSlim W8A8_DYNAMIC tensors and `quant_model_description.json` for float `tensors`:
    each quantized `X.weight` int8 (out, in) with `X.weight_scale` fp32 (out, 1) and zero
    `X.weight_offset` (out, 1); every other tensor unchanged and described as FLOAT."""
    out: dict[str, torch.Tensor] = {}
    description: dict[str, Any] = {
        "model_quant_type": QUANT_W8A8_DYNAMIC,
        "version": "1.0.0",
        "group_size": 0,
    }
    for name, tensor in weights.items():
        if not schema[name].int8 or name.endswith(MSMODELSLIM_FLOAT):
            out[name], description[name] = tensor, QUANT_FLOAT
            continue
        q = quantize_int8(tensor)
        scale = q.scale.unsqueeze(1).contiguous()  # (out, 1)
        base = name.removesuffix(".weight")
        parts = {name: q.qweight, base + WEIGHT_SCALE: scale, base + WEIGHT_OFFSET: torch.zeros_like(scale)}
        out |= parts
        description |= dict.fromkeys(parts, QUANT_W8A8_DYNAMIC)
    return out, description


def random_weights(
    model: DeepseekV4Config, schema: Schema, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Seeded random tensors for every checkpoint tensor, by official name (fp32 and int64 where the
    official checkpoint stores them so, `dtype` for the rest)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, spec in schema.items():
        value = _random_tensor(name, spec.shape, model, gen)
        out[name] = value if spec.disk in ("int64", "fp32") else value.to(dtype)
    return out


def _random_tensor(
    name: str, shape: tuple[int, ...], model: DeepseekV4Config, gen: torch.Generator
) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen).mul_(std).add_(mean)

    if name.endswith("tid2eid"):  # distinct experts per token: a random permutation's first k entries
        keys = torch.rand((model.vocab_size, model.n_routed_experts), generator=gen)
        return keys.argsort(dim=1)[:, : model.num_experts_per_tok].contiguous()
    if name.endswith("norm.weight"):
        return normal(0.1, mean=1.0)
    if name.endswith("_scale"):  # mHC pre / post / comb (or head) scales
        return torch.rand(shape, generator=gen) + 0.5
    if name.endswith("attn_sink"):
        return normal(1.0)
    if name.endswith((".ape", "_base")):
        return normal(0.5)
    if name.endswith("gate.bias"):
        return normal(0.3)
    if name == "embed.weight":
        return normal(1.0)
    if name == "head.weight":  # logits ~ N(0, 4^2): a peaked next-token distribution (top-1 p ~ 0.2)
        return normal(4.0 / math.sqrt(shape[1]))
    assert len(shape) == 2, name
    return normal(1.0 / math.sqrt(shape[1]))  # fan-in scaling keeps projections' outputs O(1)


def _generation_config(model: DeepseekV4Config) -> dict[str, Any]:
    eos = model.eos_token_ids[0] if len(model.eos_token_ids) == 1 else list(model.eos_token_ids)
    # the official values: sampling at temperature 1; greedy callers must ask for it explicitly
    return {
        "bos_token_id": model.bos_token_id,
        "eos_token_id": eos,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
