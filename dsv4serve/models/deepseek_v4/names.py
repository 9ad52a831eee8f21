"""transformers' names for DeepSeek-V4 tensors -> the official names the loader and the model use.

The reverse of transformers' conversion mapping for `deepseek_v4` (its `conversion_mapping.py`):
`DeepseekV4ForCausalLM`'s modules are named `model.layers.L.self_attn.q_a_proj`, `...mlp.experts.
gate_up_proj` (W1 and W3 stacked and concatenated), `model.hc_head.hc_fn`, and so on. Its
`save_pretrained` writes those native names with `save_original_format=False`; by default it runs the
mapping backwards, which leaves a mix: official names, plus `model.embed_tokens.weight`,
`model.hc_head.hc_*` and `layers.L.attn.norm.weight` (the attention's `kv_norm`, renamed by the mapping's
generic `.norm.` -> `.kv_norm.` rule). Every one of these maps here; official names are kept.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dsv4serve.models.spec import CheckpointNames

if TYPE_CHECKING:
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
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # save_pretrained's reverse mapping of the attention's kv_norm
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


def stacked_expert_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int, int]] | None:
    """transformers' stacked experts as official per-expert tensors: (name, expert, first row, end row).

    `layers.L.ffn.experts.gate_up_proj` (E, 2I, H) holds w1 in rows [0, I) and w3 in [I, 2I) of each
    expert; `layers.L.ffn.experts.w2` (transformers' `down_proj`, (E, H, I)) holds w2. None for any
    other name or shape (such a tensor is then reported as unexpected or mis-shaped).
    """
    stem, _, leaf = name.rpartition(".experts.")
    if not stem or len(shape) != 3 or leaf not in ("gate_up_proj", "w2"):
        return None
    num, rows = shape[0], shape[1]
    if leaf == "w2":
        return [(f"{stem}.experts.{e}.w2.weight", e, 0, rows) for e in range(num)]
    if rows % 2:
        return None
    inter = rows // 2
    return [
        (f"{stem}.experts.{e}.{proj}.weight", e, start, start + inter)
        for e in range(num)
        for proj, start in (("w1", 0), ("w3", inter))
    ]


# a routed expert's tensor, one by one as the official checkpoint stores them: (stem, expert, part)
EXPERTS = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
NAMES = CheckpointNames(
    EXPERTS,
    parts={"w1": "w1", "w2": "w2", "w3": "w3"},
    skip=lambda name: name.startswith("mtp."),  # the MTP block
    rename=official_name,
    split=stacked_expert_parts,
)
