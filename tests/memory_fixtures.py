"""The tiny DeepSeek-V4 model and engine configs the memory tests share (4 layers, ratios 0/4/16/4)."""

from __future__ import annotations

from typing import Any

from dsv4serve.config import EngineConfig
from dsv4serve.models.deepseek_v4.config import DeepseekV4Config

P = 4  # tiny_engine's default page size


def tiny_model_dict() -> dict[str, Any]:
    """A fresh `config.json`-style dict for the tiny model, for tests that vary one field."""
    return {
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 16, 4],
        "hidden_size": 32,
        "num_attention_heads": 2,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "sliding_window": 8,
        "vocab_size": 100,
        "max_position_embeddings": 512,
    }


TINY = DeepseekV4Config.from_dict(tiny_model_dict())


def tiny_engine(*, max_num_seqs: int, max_total_tokens: int, **changes: Any) -> EngineConfig:
    """An engine for TINY: page size P and a 64-token step budget unless `changes` say otherwise."""
    fields: dict[str, Any] = {"page_size": P, "max_num_batched_tokens": 64, **changes}
    return EngineConfig(max_num_seqs=max_num_seqs, max_total_tokens=max_total_tokens, **fields)
