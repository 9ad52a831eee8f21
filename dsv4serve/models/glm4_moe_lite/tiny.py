"""A random tiny GLM-4.7-Flash checkpoint in the HF layout, for tests and demos.

`make_tiny_glm` writes `config.json` (the official keys, plus `mlp_layer_types` so that transformers
agrees with `first_k_dense_replace`), `generation_config.json`, tokenizer files and seeded random
weights under the HF names (`model.` prefix, `lm_head.weight`) from the model's schema
(`glm_tensors`), with an MTP block `model.layers.{N}.*` when `num_nextn_predict_layers` is 1 (the
engine skips it; so does transformers). `Glm4MoeLiteForCausalLM.from_pretrained` loads it. The
tokenizer is DeepSeek-V4's (the GLM tokenizer is not available offline), so `vocab_size` defaults
to its 129,280, GLM's special tokens are plain text to it, and `chat_template.jinja` is the one
written here (`CHAT_TEMPLATE`) in GLM-4.7's documented format:

    [gMASK]<sop>[<|system|>\\n# Tools ... <tools>\\n{tool JSON per line}\\n</tools> ...]<|system|>{system}
    <|user|>{user}<|assistant|></think>{answer}<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>
    </tool_call><|observation|><tool_response>{result}</tool_response>...<|assistant|><think>

(no separators between turns). Reasoning is kept only in assistant turns after the last user message
(all of them with `clear_thinking=false`), other turns open with a bare `</think>`; the generation
prompt is `<|assistant|><think>`, or `<|assistant|></think>` with `enable_thinking=false`; string
argument values are written as they are, others as JSON.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from dsv4serve.models.glm4_moe_lite.config import GlmConfig
from dsv4serve.models.glm4_moe_lite.schema import tensors
from dsv4serve.models.tiny import DTYPES, copy_tokenizer, write_json, write_safetensors

CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You can call functions to help with the request. Their signatures, one JSON object a line:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

Call a function by writing its name and its arguments as key / value pairs:
<tool_call>{function-name}<arg_key>{key-1}</arg_key><arg_value>{value-1}</arg_value>\
<arg_key>{key-2}</arg_key><arg_value>{value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- set keep_all = clear_thinking is defined and not clear_thinking -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if m.reasoning_content and (keep_all or loop.index0 > ns.last_user) -%}
<think>{{ m.reasoning_content | trim }}</think>
{%- else -%}
</think>
{%- endif -%}
{{ m.content | trim }}
{%- for call in m.tool_calls or [] -%}
<tool_call>{{ call.function.name }}
{%- for key, value in call.function.arguments.items() -%}
{%- set text = value if value is string else value | tojson(ensure_ascii=False) -%}
<arg_key>{{ key }}</arg_key><arg_value>{{ text }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif -%}
"""


def tiny_glm_config(**overrides: Any) -> dict[str, Any]:
    """The tiny model's `config.json`; `overrides` replace keys (`mlp_layer_types` is re-derived)."""
    cfg: dict[str, Any] = {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "vocab_size": 129280,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "rope_scaling": None,
        "partial_rotary_factor": 1.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "pad_token_id": 2,
        "eos_token_id": [1, 2],
        "initializer_range": 0.02,
        "use_cache": True,
    }
    cfg.update(overrides)
    n, k = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    cfg["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(n)]
    return cfg


def make_tiny_glm(
    out_dir: Path | str, seed: int = 0, *, dtype: str = "float32", shards: int = 1, **overrides: Any
) -> Path:
    """Write a random tiny GLM checkpoint to `out_dir` (created if needed) and return its path."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {tuple(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_glm_config(**{"torch_dtype": dtype, **overrides})
    cfg = GlmConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    weights = {
        _hf_name(n): _random(n, spec.shape, gen, torch.float32 if spec.fp32 else DTYPES[dtype])
        for n, spec in tensors(cfg).items()
    }
    if cfg.num_nextn_predict_layers:
        weights |= _mtp_block(cfg, gen, DTYPES[dtype])
    write_json(out / "config.json", raw)
    generation = {
        "eos_token_id": list(cfg.eos_token_ids),
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    write_json(out / "generation_config.json", generation)
    write_safetensors(weights, out, shards)
    copy_tokenizer(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return out


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A seeded random value of tensor `name`, in `dtype`."""
    if name.endswith("norm.weight"):
        value = torch.randn(shape, generator=gen) * 0.1 + 1.0
    elif name.endswith("e_score_correction_bias"):
        value = torch.randn(shape, generator=gen) * 0.3
    elif name == "embed_tokens.weight":
        value = torch.randn(shape, generator=gen)
    elif name == "lm_head.weight":  # logits ~ N(0, 4^2): a peaked next-token distribution
        value = torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[1]))
    else:  # fan-in scaling keeps every projection's output O(1)
        value = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return value.to(dtype)


def _mtp_block(cfg: GlmConfig, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The MTP layer's own tensors (eh_proj, enorm, hnorm, shared_head) plus one attention tensor."""
    h, p = cfg.hidden_size, f"model.layers.{cfg.num_layers}."
    shapes = {
        "eh_proj.weight": (h, 2 * h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "shared_head.norm.weight": (h,),
        "input_layernorm.weight": (h,),
    }
    return {p + n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}
