"""transformers' names for DeepSeek-V4 tensors -> the official names the loader and the model use.

The reverse of transformers' conversion mapping for `deepseek_v4` (its `conversion_mapping.py`):
`DeepseekV4ForCausalLM`'s modules are named `model.layers.L.self_attn.q_a_proj`, `...mlp.experts.
gate_up_proj` (W1 and W3 stacked and concatenated), `model.hc_head.hc_fn`, and so on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_RULES = [  # applied in order, after dropping a leading "model."
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.down_proj$", ".experts.w2"),
]


def official_name(name: str) -> str:
    """The official name of a tensor transformers names `name` (a name already official is kept)."""
    out = name.removeprefix("model.")
    for pattern, repl in _RULES:
        out = re.sub(pattern, repl, out)
    return out


def official_weights(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Official names for transformers' tensors; the stacked `[W1; W3]` experts become views w1, w3."""
    out: dict[str, torch.Tensor] = {}
    for name, value in named:
        official = official_name(name)
        if official.endswith(".experts.gate_up_proj"):
            stem = official.removesuffix("gate_up_proj")
            inter = value.shape[1] // 2
            out[stem + "w1"], out[stem + "w3"] = value[:, :inter], value[:, inter:]  # (E, I, hidden) views
        else:
            out[official] = value
    return out
