"""DeepSeek-V4 (Flash, Pro): the family's spec.

config.py (the config and its KV layout: full, swa, c4, c128 and their compressor-state pools),
schema.py (the checkpoint's tensors), names.py (transformers' names), model.py + attention.py (the
math), chat.py + dsml.py (the chat template and its output parser), tiny.py (the tiny checkpoint
writer), configs/ (the official Flash and Pro `config.json`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4serve.models.deepseek_v4.config import DeepseekV4Config
from dsv4serve.models.deepseek_v4.names import NAMES
from dsv4serve.models.deepseek_v4.schema import MSMODELSLIM_FLOAT, tensors
from dsv4serve.models.spec import CheckpointError, CheckpointNames, ModelContext, ModelSpec, Schema

if TYPE_CHECKING:
    from dsv4serve.chat import ChatTemplate
    from dsv4serve.layers.linear import Weights
    from dsv4serve.models.spec import ServedModel


class DeepseekV4Spec(ModelSpec[DeepseekV4Config]):
    model_type = "deepseek_v4"
    msmodelslim_float = MSMODELSLIM_FLOAT

    def config(self, raw: dict[str, Any]) -> DeepseekV4Config:
        return DeepseekV4Config.from_dict(raw)

    def schema(self, cfg: DeepseekV4Config) -> Schema:
        return tensors(cfg)

    def names(self, cfg: DeepseekV4Config) -> CheckpointNames:
        return NAMES

    def build(self, cfg: DeepseekV4Config, weights: Weights, ctx: ModelContext) -> ServedModel:
        import torch

        from dsv4serve.attention.rope import RopeTables
        from dsv4serve.models.deepseek_v4.model import DeepseekV4

        length = ctx.engine.resolved_max_model_len(cfg) + 1
        return DeepseekV4(cfg, weights, RopeTables.build(cfg, length, torch.device(ctx.engine.device)), ctx)

    def check_weights(self, cfg: DeepseekV4Config, weights: Weights) -> None:
        """Hash routing's expert ids are experts."""
        from dsv4serve.layers.linear import plain

        for layer in range(cfg.num_hash_layers):
            name = f"layers.{layer}.ffn.gate.tid2eid"
            table = plain(weights, name)
            if table.numel() and (int(table.min()) < 0 or int(table.max()) >= cfg.n_routed_experts):
                raise CheckpointError(f"{name}: expert ids outside [0, {cfg.n_routed_experts})")

    def make_tiny(self, out_dir: Path | str, seed: int = 0, **overrides: Any) -> Path:
        from dsv4serve.models.deepseek_v4.tiny import make_tiny

        return make_tiny(out_dir, seed, **overrides)

    def chat_template(self, model_dir: Path) -> ChatTemplate:
        from dsv4serve.models.deepseek_v4.chat import DeepSeekV4Template

        return DeepSeekV4Template()


SPEC = DeepseekV4Spec()
